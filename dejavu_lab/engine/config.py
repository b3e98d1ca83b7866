"""What a user asks of the engine, and the one error it raises when it cannot (Deja Vu §5.1).

:class:`SparseConfig` says what the sparse decode step keeps per token; :class:`EngineError`
is raised, with one sentence saying what to do, for any model or request the engine cannot
run. Both sit below every other engine module, so the arrows between them run one way:
``config -> weights -> sets -> decoder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..budgets import budgets
from ..checks import engine as check_engine
from ..errors import EngineError
from ..vocab import METHODS as METHODS_TABLE
from ..vocab import method_names

__all__ = ["DENSE_ENGINES", "DENSE_OPS", "METHODS", "PLANNED", "SITES", "EngineError",
           "SparseConfig", "default_ops", "dense_layout", "dense_ops"]  # fmt: skip


METHODS = method_names(engine=True)  # what SparseConfig(method=...) runs
# the dense steps the engine benchmark times (kernels/bench_engine.py): cuBLAS ops, every op
# through the row-gather kernels, through the threshold kernels with every column kept, or
# each op the faster of the two; "vs best dense" compares with the fastest of them
DENSE_ENGINES = ("dense", "dense_triton", "dense_columns", "dense_auto")
# the decode step's dense ops; each runs through "torch" (cuBLAS, PyTorch) or "triton" (ours)
DENSE_OPS = ("qkv", "attn", "o", "mlp")
# the input-sparsity sites each threshold method thresholds (vocab.SITES; CATS: the neurons);
# LaRoSA and R-Sparse run TEAL's rule on their transformed inputs at the same four sites
SITES = {
    m: METHODS_TABLE[m].sites for m in METHODS if METHODS_TABLE[m].family in ("threshold", "topk")
}
# the methods run from a plan (dejavu_lab.sparsify.topk.TopkPlan, engine.plans)
PLANNED = method_names(family="topk", engine=True)


@dataclass(frozen=True)
class SparseConfig:
    """What the sparse path keeps per token (sparsity = fraction removed, as in the paper).

    ``method="dejavu"`` keeps the top-k neurons and heads of DejaVu's predictors (or fixed sets);
    ``"teal"``/``"wina"`` read column i of a linear layer's weight only where the input entry
    passes its threshold, ``|x_i| > thr_i``, at the four sites of every layer (attention over every
    head); ``"cats"`` computes the gate densely and the up/down rows of the neurons with
    ``|act(gate)| > thr`` only; ``"dense"`` runs the dense path. ``thresholds`` maps
    ``(layer, site)`` to one number (TEAL's and CATS's one threshold per site, passed to the
    one-token kernels as a float) or to fp32 [d_in], one per input column (WINA's ``t /
    ||W[:, i]||``): a calibration's ``Thresholds.site_thresholds(model)`` is that dict. A layer
    or site missing from it runs dense.

    >>> import torch
    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 256 neurons, 4 heads
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> dec.k_mlp, dec.k_heads, dec.window  # kept per token; deferred-KV window
    (64, 2, 16)
    >>> dec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).shape  # the sparse kernels
    torch.Size([1, 6])
    >>> SparseConfig(method="teal", thresholds={(0, "mlp_in"): torch.zeros(64)}).method
    'teal'
    >>> SparseConfig(method="teal", thresholds={(0, "mlp_in"): 0.25}).method  # one number
    'teal'
    >>> SparseConfig(method="teal", thresholds={(0, "gate"): torch.zeros(256)})
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: thresholds has site 'gate', which method 'teal' does not use; its sites are attn_in, o_in, mlp_in, down_in.

    ``"larosa"`` and ``"rsparse"`` run a plan (``plan=``, from ``dejavu_lab.sparsify.larosa.plan``
    or ``rsparse.plan`` with ``rule="threshold"``; :mod:`~dejavu_lab.engine.plans` maps it to
    the engine), or its parts given by hand: ``thresholds`` with LaRoSA's ``rotations``
    (``{layer: fp32 [kv_heads, d_head, d_head]}``, folded into W_V's rows and W_O's columns,
    and ``"residual": fp32 [d, d]`` for one basis of the residual stream; none: the weights
    given are folded already, :func:`~dejavu_lab.engine.fold_rotations`) or
    R-Sparse's ``factors`` (``{(layer, site): (U [d_out, r], V [r, d_in])}``, the low-rank term
    ``U (V x_R)`` of the entries the threshold drops).

    >>> SparseConfig(method="rsparse", thresholds={(0, "mlp_in"): 0.25},
    ...              factors={(0, "o_in"): (torch.zeros(64, 2), torch.zeros(2, 64))})
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: factors has (0, 'o_in') but thresholds do not; a low-rank term adds to a thresholded site's product.
    """

    mlp_sparsity: float = 0.0  # MLP neurons removed (OPT-175B in §5.1: 0.85); dejavu only
    head_sparsity: float = 0.0  # query heads removed (§5.1: 0.5); dejavu only
    kv_window: int = 16  # deferred KV window (1-32 tokens); 0 computes every head's K/V each step
    side_stream: bool = True  # lookahead predictors on a second CUDA stream (else inline)
    # that stream's CUDA priority (lower runs sooner: -1 lets the predictors' small launches take
    # the next free SM ahead of the layer's own programs; 0 is the default priority)
    side_priority: int = -1
    # dejavu on a GPU: the first capture times the step with each kernel for the kept sets and
    # the down projections (Decoder._kernel_choices) and keeps the fastest; False: the defaults
    tune_kernels: bool = True
    method: str = "dejavu"  # one of METHODS
    # dejavu: one-launch kernels (fused_sparse_mlp; qkv_rope = QKV + RoPE + KV write) instead of
    # up+down and QKV, RoPE, kv_window_write apart. Off by default: on the H200 the fused path is
    # slower at OPT-30B (MLP 2.79 vs 2.19 ms, attention 5.23 vs 4.39 ms per step; the fused run is
    # results/engine_e2e_fused.json) — the fused MLP runs two launches there (see its module).
    fused: bool = False
    # {(layer, site): float, or fp32 [d_in] per input column} (teal, wina, cats); not compared
    thresholds: dict | None = field(default=None, compare=False, repr=False)
    # larosa, rsparse: a TopkPlan of that method (its thresholds, rotations or factors)
    plan: object | None = field(default=None, compare=False, repr=False)
    # larosa without a plan: {layer: fp32 [kv_heads, d_head, d_head]}, each K/V group's basis
    rotations: dict | None = field(default=None, compare=False, repr=False)
    # rsparse without a plan: {(layer, site): (U [d_out, r], V [r, d_in])}
    factors: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        budgets(self.mlp_sparsity, 1, "mlp_sparsity")
        budgets(self.head_sparsity, 1, "head_sparsity")
        check_engine.size(self.kv_window, "kv_window", maximum=32, hint="tokens; 0 = no deferral")
        if not isinstance(self.side_priority, int) or isinstance(self.side_priority, bool):
            raise EngineError(f"side_priority={self.side_priority!r} must be an int stream priority "
                              "(-1 high, 0 default).")  # fmt: skip
        if self.method not in METHODS:
            raise EngineError(
                f"method={self.method!r} is not one the engine runs; choose one of "
                f"{', '.join(METHODS)}."
            )
        self._check_plan_parts()
        if self.method in ("dejavu", "dense"):
            if self.thresholds is not None:
                raise EngineError(
                    f"thresholds apply to methods teal, wina and cats, not {self.method!r}; "
                    "drop them or pick one of those methods."
                )
            if self.method == "dense" and (self.mlp_sparsity or self.head_sparsity):
                raise EngineError("method='dense' keeps everything; leave the sparsities at 0.")
            return
        if self.mlp_sparsity or self.head_sparsity:
            raise EngineError(
                f"method {self.method!r} keeps what passes its thresholds; mlp_sparsity and "
                "head_sparsity are DejaVu's budgets: leave them at 0."
            )
        if self.plan is not None:
            return
        if self.method in PLANNED and not isinstance(self.thresholds, dict):
            raise EngineError(
                f"method {self.method!r} needs plan=dejavu_lab.sparsify.{self.method}.plan(..., "
                "rule='threshold') (or thresholds with its "
                f"{'rotations' if self.method == 'larosa' else 'factors'})."
            )
        if not isinstance(self.thresholds, dict):
            raise EngineError(
                f"method {self.method!r} needs thresholds: a dict {{(layer, site): float or fp32 "
                "tensor}} (e.g. calibrated.site_thresholds(model), or engine.calibrate_thresholds)."
            )
        sites = SITES[self.method]
        for key, thr in self.thresholds.items():
            if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int)):
                raise EngineError(
                    f"thresholds has the key {key!r}; its keys are (layer: int, site: str) pairs."
                )
            if key[1] not in sites:
                raise EngineError(
                    f"thresholds has site {key[1]!r}, which method {self.method!r} does not use; "
                    f"its sites are {', '.join(sites)}."
                )
            check_engine.threshold(key, thr)  # finite numbers; tensors without NaN or -inf
        for key in self.factors or {}:
            if key not in self.thresholds:
                raise EngineError(
                    f"factors has {key!r} but thresholds do not; a low-rank term adds to a "
                    "thresholded site's product."
                )

    def _check_plan_parts(self) -> None:
        """What only the planned methods take: ``plan``, ``rotations``, ``factors``."""
        own = {"larosa": ("plan", "rotations"), "rsparse": ("plan", "factors")}
        for name in ("plan", "rotations", "factors"):
            if getattr(self, name) is not None and name not in own.get(self.method, ()):
                users = " or ".join(repr(m) for m, o in own.items() if name in o)
                raise EngineError(f"{name}= applies to method {users}, not {self.method!r}.")
        for name in ("rotations", "factors"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise EngineError(f"{name} must be a dict; see SparseConfig's docstring.")
        if self.plan is None:
            return
        if getattr(self.plan, "method", None) != self.method:
            got = getattr(self.plan, "method", type(self.plan).__name__)
            raise EngineError(
                f"plan= takes a {self.method} plan (dejavu_lab.sparsify.{self.method}.plan), "
                f"got {got!r}."
            )
        if any(getattr(self, n) is not None for n in ("thresholds", "rotations", "factors")):
            raise EngineError(
                "a plan carries its thresholds, rotations and factors; pass plan= alone."
            )


def dense_ops(spec: str | dict | None) -> dict[str, str]:
    """Resolve a dense-op choice: ``"torch"``, ``"triton"``, ``"qkv=triton,mlp=triton"`` or a
    dict; ops not named run through torch.

    >>> dense_ops("triton")
    {'qkv': 'triton', 'attn': 'triton', 'o': 'triton', 'mlp': 'triton'}
    >>> dense_ops("mlp=triton")["mlp"], dense_ops({"o": "triton"})["qkv"]
    ('triton', 'torch')
    """
    if spec is None or spec in ("torch", "triton"):
        return dict.fromkeys(DENSE_OPS, spec or "torch")
    if isinstance(spec, str):
        try:
            spec = dict(item.split("=") for item in spec.split(",") if item)
        except ValueError:
            spec = {"?": spec}
    out = dict.fromkeys(DENSE_OPS, "torch")
    for op, impl in dict(spec).items():
        if op not in DENSE_OPS or impl not in ("torch", "triton"):
            raise EngineError(
                f"dense_ops {op}={impl!r} is not a choice; name ops among {', '.join(DENSE_OPS)} "
                "with 'torch' or 'triton' (e.g. 'qkv=triton,mlp=triton')."
            )
        out[op] = impl
    return out


def default_ops(w, *, columns: bool = False) -> str:
    """The dense ops a decoder over weights ``w`` runs by default. On a GPU with fp16/bf16
    weights: over the ``"columns"`` layout alone (``columns``), every op through our kernels
    (the threshold GEMVs with every column kept: the fastest one-token step measured,
    ``dense_columns`` in ``results/engine_methods.json``); over the rows layout, the attention
    core through our kernel (one launch that appends K/V and attends, faster than PyTorch's
    masked attention over the static cache) and cuBLAS for the rest. Elsewhere every op
    through torch.

    >>> from types import SimpleNamespace
    >>> default_ops(SimpleNamespace(device=torch.device("cpu"), dtype=torch.float16))
    'torch'
    >>> default_ops(SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16), columns=True)
    'triton'
    """
    if not _kernels_run(w.device, w.dtype):
        return "torch"
    return "triton" if columns else "attn=triton"


def dense_layout(device: torch.device, dtype: torch.dtype) -> str:
    """The layout a batch-1 dense decoder builds from a Hugging Face model on ``device`` in
    ``dtype``: ``"columns"`` on a GPU with fp16/bf16 weights (where :func:`default_ops` runs
    every op through the threshold kernels), ``"rows"`` elsewhere (cuBLAS or the CPU read
    either; rows shares OPT's ``fc1`` with the model instead of copying it).

    >>> dense_layout(torch.device("cuda"), torch.bfloat16), dense_layout(torch.device("cpu"), torch.float16)
    ('columns', 'rows')
    """
    return "columns" if _kernels_run(device, dtype) else "rows"


def _kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the default step runs our kernels: a GPU with fp16/bf16 weights."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
