"""The shared machinery: one context manager that runs any registered sparsity method.

:func:`sparsified` validates the budget, builds a :class:`SparseContext` and asks the method's
builder (registered with :func:`register`, one module per method) for hook callbacks; the
callbacks replace activations at the writable hook points of :mod:`dejavu_lab.hooks`, so the
model's own forward runs unchanged. Two kinds of builders share helpers here:

- unit masks (oracle, static, DejaVu predictors): keep a subset of MLP neurons
  (``mlp.hook_post``) and of query heads (``attn.hook_z``) per token — :func:`unit_mask_hooks`;
- input thresholds (TEAL, WINA, CATS): zero the entries of a linear layer's input below a
  threshold (one number per site, or one per input column for WINA) at one of the
  :data:`SITES` — :func:`threshold_hooks`.

This measures *quality*: the dense work still happens on CPU; what a sparse step reads is
counted by :mod:`dejavu_lab.step_bytes`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..budgets import budgets, n_keep
from ..checks.models import not_a_bundle
from ..corpus import CorpusError
from ..errors import InputError
from ..hooks import hooks
from ..vocab import ALIASES, SITES
from ..vocab import METHODS as TABLE
from ..vocab import method as method_spec
from .kept import Kept
from .sites import _apply, column_norms, site_weights, threshold_hooks

__all__ = [
    "METHODS",
    "MODES",
    "SITES",
    "SparseContext",
    "register",
    "site_weights",
    "column_norms",
    "sparsified",
    "threshold_hooks",
    "unit_mask_hooks",
]

MODES = ("oracle", "static", "predicted")  # the original names; "predicted" is method "dejavu"

Builder = Callable[["SparseContext"], list]
METHODS: dict[str, Builder] = {}  # name -> builder; filled by the method modules


def register(name: str):
    """Decorator: make ``builder(ctx) -> [(hook name, fn), ...]`` the method ``name``.

    The method must have its row in :data:`dejavu_lab.vocab.METHODS` (what it keeps, what it
    needs): the table and this registry name the same methods.

    >>> import dejavu_lab.sparsify  # each method's module registers its builder
    >>> sorted(METHODS) == sorted(TABLE)
    True
    >>> register("magic")
    Traceback (most recent call last):
    ...
    ValueError: method 'magic' has no row in dejavu_lab.vocab.METHODS; add its Method there first.
    """
    if name not in TABLE:
        raise ValueError(
            f"method {name!r} has no row in dejavu_lab.vocab.METHODS; add its Method there first."
        )

    def deco(fn: Builder) -> Builder:
        METHODS[name] = fn
        return fn

    return deco


@dataclass
class SparseContext:
    """Everything a method's builder may use, resolved and validated by :func:`sparsified`.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> ctx = SparseContext(m.model, m.arch, "oracle", mlp=[0.5, 0.0], heads=[0.0, 0.0])
    >>> ctx.active(0), ctx.active(1)
    (True, False)
    """

    model: nn.Module
    arch: Arch
    method: str  # a key of METHODS
    mlp: list[float]  # per layer: fraction of MLP neurons removed (unit-mask methods)
    heads: list[float]  # per layer: fraction of query heads removed
    sparsity: list[float] | None = None  # per layer: the method's own budget (threshold methods)
    dense: set[int] = field(default_factory=set)  # layers left dense
    static: object = None  # StaticSets (method "static")
    predictors: object = None  # Predictors (method "dejavu")
    thresholds: object = None  # Calibration or Thresholds (the threshold methods)
    allocation: str = "uniform"  # threshold methods: "uniform" or "greedy"
    refit: object = None  # TEAL/WINA: a Refit (dejavu_lab.sparsify.refit) read after the masks
    record: dict | None = None  # receives masks (unit methods), for inspection and tests
    kept: Kept | None = None  # receives realised kept counts per (layer, site)
    state: dict = field(default_factory=dict)  # per-forward scratch shared by a method's hooks

    def active(self, layer: int) -> bool:
        """Whether ``layer`` has any budget."""
        if layer in self.dense:
            return False
        s = self.sparsity[layer] if self.sparsity is not None else 0.0
        return self.mlp[layer] > 0 or self.heads[layer] > 0 or s > 0


# ---------------------------------------------------------------------------------------------
# the context manager


@contextmanager
def sparsified(
    model: nn.Module,
    *,
    method: str | None = None,
    sparsity=None,
    mlp_sparsity=None,
    head_sparsity=None,
    mode: str | None = None,
    dense_layers: Sequence[int] = (),
    static=None,
    predictors=None,
    thresholds=None,
    allocation: str = "uniform",
    refit=None,
    arch: Arch | None = None,
    record: dict | None = None,
    kept: Kept | None = None,
) -> Iterator[None]:
    """Inside this block every forward of ``model`` runs with a sparsity method applied.

    ``method``: a method of the table :data:`dejavu_lab.vocab.METHODS` (each has its builder
    in :data:`METHODS`), ``"oracle"`` by default (``mode="predicted"`` is ``"dejavu"``);
    ``mode`` is the older name of the same argument. Budgets are fractions REMOVED, a number
    or one per layer, in [0, 1). ``sparsity``: the method's budget — for the unit-mask methods
    the default of both ``mlp_sparsity`` (neurons) and ``head_sparsity`` (query heads), for
    the threshold methods the target share of zeroed inputs (TEAL/WINA: bytes-weighted over the
    four :data:`SITES` of a layer; CATS: MLP neurons). ``dense_layers``: layers left dense.
    ``static``: a :class:`~dejavu_lab.sparsify.static.StaticSets`; ``predictors``:
    :class:`~dejavu_lab.predictors.model.Predictors`; ``thresholds``: a
    :class:`~dejavu_lab.sparsify.calibration.Calibration` (thresholds for ``sparsity`` and
    ``allocation`` are taken from it) or ready
    :class:`~dejavu_lab.sparsify.calibration.Thresholds`. ``record``: a dict receiving the unit
    masks, ``record["mlp"][layer]`` [b, p, n] and ``record["heads"][layer]`` [b, p, h].
    ``kept``: a :class:`~dejavu_lab.sparsify.kept.Kept` counting what each site kept.
    ``refit`` (TEAL, WINA): a :class:`~dejavu_lab.sparsify.refit.Refit` fitted under these
    thresholds; each refitted site's layers then read ``R x_m`` (the weights ``W R``).

    An argument the method does not read (:attr:`dejavu_lab.vocab.Method.options`) is an
    ``InputError``, as is a block inside another on the same model that names a method or a
    budget (the two would stack); one that asks for nothing, as ``sparse_perplexity(model,
    ids)`` measuring the outer block, runs the outer block's method.

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> with sparsified(model, mlp_sparsity=0.5, head_sparsity=0.25):
    ...     logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    """
    model = not_a_bundle(model)
    ctx = _context(
        model,
        method=method,
        mode=mode,
        sparsity=sparsity,
        mlp_sparsity=mlp_sparsity,
        head_sparsity=head_sparsity,
        dense_layers=dense_layers,
        static=static,
        predictors=predictors,
        thresholds=thresholds,
        allocation=allocation,
        refit=refit,
        arch=arch,
        record=record,
        kept=kept,
    )
    fns = METHODS[ctx.method](ctx)
    outer = _ACTIVE.get(model)
    if outer is not None:
        if fns or method is not None or mode is not None:
            raise InputError(
                f"sparsified blocks do not nest: this model already runs method {outer!r} in an "
                "outer block, and the two would stack their masks; leave that block first, then "
                "run the other (one method per forward)."
            )
        yield  # asks for nothing (e.g. sparse_perplexity(model, ids)): the outer block runs
        return
    _ACTIVE[model] = ctx.method
    try:
        if not fns:  # dense everywhere: run the model untouched
            yield
            return
        with hooks(model, fns, ctx.arch):
            try:
                yield
            finally:
                ctx.state.clear()
    finally:
        _ACTIVE.pop(model, None)


# model -> the method of the sparsified block it runs in (blocks do not nest)
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_options(spec, given: dict) -> None:
    """Refuse an argument the method does not read (:attr:`dejavu_lab.vocab.Method.options`):
    dropped in silence, ``method="dense", sparsity=0.5`` ran dense and ``method="cats",
    mlp_sparsity=0.9`` ran CATS at its own budget.

    >>> from dejavu_lab.vocab import METHODS as T
    >>> _check_options(T["cats"], {"sparsity": 0.5, "mlp_sparsity": 0.9})
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: method='cats' does not use mlp_sparsity; it takes sparsity, thresholds (and dense_layers): pass only those.
    """
    unused = [
        k
        for k, v in given.items()
        if k not in spec.options and (v != "uniform" if k == "allocation" else v is not None)
    ]
    if unused:
        if spec.family == "dense":
            raise InputError(
                f"method='dense' runs the model unchanged and takes no {', '.join(unused)}; "
                "drop it, or pass a sparsity method (e.g. method='oracle')."
            )
        raise InputError(
            f"method={spec.name!r} does not use {', '.join(unused)}; it takes "
            f"{', '.join(spec.options)} (and dense_layers): pass only those."
        )
    both = given["mlp_sparsity"] is not None and given["head_sparsity"] is not None
    if spec.family == "unit" and both and given["sparsity"] is not None:
        raise InputError(
            "sparsity is the default of mlp_sparsity and head_sparsity, and both are given, so "
            "it would be unused; pass sparsity alone, or the two budgets."
        )


def _method_name(method, mode) -> str:
    names = ", ".join(sorted(set(METHODS) | set(MODES)))
    if method is not None and mode is not None and ALIASES.get(mode, mode) != method:
        raise ValueError(f"pass method= or mode=, not both ({method!r} and {mode!r}).")
    name = method if method is not None else (mode if mode is not None else "oracle")
    what = "method" if method is not None else "mode"
    if not isinstance(name, str) or ALIASES.get(name, name) not in METHODS:
        raise ValueError(f"{what} must be one of {names}, got {name!r}.")
    return ALIASES.get(name, name)


def _context(
    model,
    *,
    method,
    mode,
    sparsity,
    mlp_sparsity,
    head_sparsity,
    dense_layers,
    static,
    predictors,
    thresholds,
    allocation,
    refit,
    arch,
    record,
    kept,
) -> SparseContext:
    arch = arch or get_arch(model)
    name = _method_name(method, mode)
    spec = method_spec(name)
    _check_options(
        spec,
        dict(sparsity=sparsity, mlp_sparsity=mlp_sparsity, head_sparsity=head_sparsity,
             static=static, predictors=predictors, thresholds=thresholds, allocation=allocation,
             refit=refit),
    )  # fmt: skip
    L = arch.n_layers
    unit = spec.family not in ("threshold", "topk")  # dense and unit masks: mlp/head budgets
    if spec.needs == "static sets":
        # duck-typed: the sets come from dejavu_lab.sparsify.static (which imports this module)
        if not all(hasattr(static, a) for a in ("mlp_score", "head_score", "mlp_sparsity")):
            raise ValueError("mode='static' needs static=static_sets(model, windows, ...).")
        if sparsity is None:
            mlp_sparsity = static.mlp_sparsity if mlp_sparsity is None else mlp_sparsity
            head_sparsity = static.head_sparsity if head_sparsity is None else head_sparsity
    if spec.needs == "predictors":
        if predictors is None:
            raise ValueError(
                "mode='predicted' needs predictors=...; train them with "
                "dejavu_lab.predictors.train_predictors or `dejavu-lab train-predictors`."
            )
        predictors.check_model(model, arch)
    # the budgets' one check on the library's side (the CLI checks its flags while parsing):
    # everything inward takes these per-layer lists as they are
    s = None if sparsity is None else budgets(sparsity, L, "sparsity")
    default = 0.0 if s is None or not unit else s
    ms = budgets(default if mlp_sparsity is None else mlp_sparsity, L, "mlp_sparsity")
    hs = budgets(default if head_sparsity is None else head_sparsity, L, "head_sparsity")
    dense = set()
    for i in dense_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not -L <= i < L:
            raise ValueError(f"dense_layers must hold layer indices in 0..{L - 1}, got {i!r}.")
        dense.add(i % L)
    for i in dense:  # the one place dense layers lose their budget
        ms[i] = hs[i] = 0.0
        if s is not None:
            s[i] = 0.0
    if spec.family == "dense":
        ms, hs = [0.0] * L, [0.0] * L
    if allocation not in ("uniform", "greedy"):
        raise ValueError(f"allocation must be 'uniform' or 'greedy', got {allocation!r}.")
    if record is not None:
        record.setdefault("mlp", {})
        record.setdefault("heads", {})
    return SparseContext(
        model=model,
        arch=arch,
        method=name,
        mlp=ms,
        heads=hs,
        sparsity=None if unit else s,
        dense=dense,
        static=static,
        predictors=predictors,
        thresholds=thresholds,
        allocation=allocation,
        refit=refit,
        record=record,
        kept=kept,
    )


@register("dense")
def _dense(ctx: SparseContext) -> list:
    return []


# ---------------------------------------------------------------------------------------------
# helpers for unit-mask methods (oracle, static, dejavu)


def unit_mask_hooks(ctx: SparseContext, mlp_keep, head_keep) -> list:
    """Hooks that keep, per token, the neurons ``mlp_keep(i, a, k)`` and heads ``head_keep(i, z,
    k)`` choose (bool masks [b, p, n] / [b, p, h]) at the context's budgets.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> ctx = SparseContext(m.model, m.arch, "first", mlp=[0.5, 0.5], heads=[0.0, 0.0])
    >>> first = lambda i, a, k: torch.arange(a.shape[-1]) < k  # always the first k neurons
    >>> [name for name, _ in unit_mask_hooks(ctx, first, None)]
    ['blocks.0.mlp.hook_post', 'blocks.1.mlp.hook_post']
    """
    arch, fns = ctx.arch, []
    for i in range(arch.n_layers):
        if ctx.mlp[i] > 0:
            k = n_keep(ctx.mlp[i], arch.d_mlp)
            fns.append((f"blocks.{i}.mlp.hook_post", _mlp_masker(ctx, i, k, mlp_keep)))
        if ctx.heads[i] > 0:
            k = n_keep(ctx.heads[i], arch.n_heads)
            fns.append((f"blocks.{i}.attn.hook_z", _head_masker(ctx, i, k, head_keep)))
    return fns


def _mlp_masker(ctx, i, k, choose):
    def fn(a: torch.Tensor, name: str) -> torch.Tensor:  # a: [b, p, n]
        keep = choose(i, a, k).expand_as(a)
        if ctx.record is not None:
            ctx.record["mlp"][i] = keep.cpu()
        if ctx.kept is not None:
            ctx.kept.add(i, "mlp", keep)
        return _apply(a, keep)

    return fn


def _head_masker(ctx, i, k, choose):
    arch = ctx.arch

    def fn(z: torch.Tensor, name: str) -> torch.Tensor:  # z: [b, p, h, dh]
        keep = choose(i, z, k).expand(z.shape[:-1])
        if ctx.record is not None:
            ctx.record["heads"][i] = keep.cpu()
        if ctx.kept is not None:
            ctx.kept.add(i, "heads", keep)
            kv = keep.reshape(*keep.shape[:-1], arch.n_kv_heads, arch.heads_per_kv).any(-1)
            ctx.kept.add(i, "kv", kv)
        return _apply(z, keep[..., None])

    return fn


# ---------------------------------------------------------------------------------------------
# quality


def _check_windows(windows: torch.Tensor) -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[0] == 0:
        shape = tuple(windows.shape) if isinstance(windows, torch.Tensor) else type(windows)
        raise CorpusError(
            f"windows must be a non-empty LongTensor [n, window] from token_windows, got {shape}."
        )
    return windows
