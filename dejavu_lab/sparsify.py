"""Run a Hugging Face model with contextual sparsity applied (Deja Vu §4, Knowl 1, 5, 9).

Per token and per layer, keep only a subset of the MLP's hidden neurons (``S_M``) and of the
attention heads (``S_A``); the others contribute nothing to the residual stream:

- ``mode="oracle"`` — the ideal sets, chosen from the true activations: the top-(1−s) fraction
  of neurons by ``|mlp.hook_post|`` and of query heads by per-head output norm ``‖z_h W_O,h‖``
  (§3.1's "contextual sparsity" upper bound).
- ``mode="static"`` — one set per layer for every token, chosen by average magnitude over a
  calibration text (:func:`static_sets`): the paper's static-sparsity baseline.
- ``mode="predicted"`` — the sets DejaVu's low-rank predictors choose from the layer input
  (same-layer) or from the previous layer's input (lookahead, Knowl 2); see
  :mod:`dejavu_lab.predictors`.

Sparsity is always the fraction REMOVED (the paper's "85% MLP sparsity" keeps 15% of neurons),
a float or a per-layer list in [0, 1). Masks are applied through the writable hook points of
:mod:`dejavu_lab.hooks` (``mlp.hook_post`` and ``attn.hook_z``), so the model's own forward runs
unchanged. This measures *quality*: the dense work still happens on CPU; the speed side lives in
:mod:`dejavu_lab.bytes_model` and the Triton kernels.

Deferred KV (Knowl 5) for token-by-token generation is in :mod:`dejavu_lab.deferred_kv`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from .arch import Arch, get_arch
from .corpus import CorpusError, perplexity
from .hooks import hooks

__all__ = [
    "head_gram",
    "MODES",
    "PAPER_KNOWL9",
    "PAPER_TASKS",
    "StaticSets",
    "budgets",
    "n_keep",
    "head_output_norms",
    "lm_eval_tasks",
    "sparse_perplexity",
    "sparsified",
    "static_sets",
    "topk_mask",
]

MODES = ("oracle", "static", "predicted")


# ---------------------------------------------------------------------------------------------
# budgets


def budgets(value, n_layers: int, what: str = "sparsity") -> list[float]:
    """Validate a sparsity (fraction removed): a number or one per layer, each in [0, 1).

    >>> budgets(0.5, 3)
    [0.5, 0.5, 0.5]
    >>> budgets(1.0, 3)
    Traceback (most recent call last):
    ...
    ValueError: sparsity must be in [0, 1) (the fraction removed; 0 = dense), got 1.0.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(
            f"{what} must be a number in [0, 1) or a list of {n_layers} of them, got {value!r}."
        )
    if isinstance(value, Sequence) or hasattr(value, "__len__"):
        values = list(value)
        if len(values) != n_layers:
            raise ValueError(
                f"{what} has {len(values)} entries but the model has {n_layers} layers; "
                f"pass one number or one per layer."
            )
    else:
        values = [value] * n_layers
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be numbers in [0, 1), got {v!r}.") from None
        if isinstance(v, bool) or not math.isfinite(f) or not 0.0 <= f < 1.0:
            where = "" if len(set(map(str, values))) == 1 else f" at layer {i}"
            raise ValueError(
                f"{what} must be in [0, 1) (the fraction removed; 0 = dense), got {v!r}{where}."
            )
        out.append(f)
    return out


def n_keep(sparsity: float, n: int) -> int:
    """How many of ``n`` units a sparsity keeps: ``n - round(s * n)``, at least one.

    >>> n_keep(0.85, 3072)  # the paper's 85% MLP sparsity on OPT-125m's 3072 neurons
    461
    >>> n_keep(0.99, 4)
    1
    """
    return max(1, n - round(sparsity * n))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` largest ``scores`` along the last dim (same shape).

    >>> topk_mask(torch.tensor([[0.1, 0.7, 0.3, 0.9]]), 2)
    tensor([[False,  True, False,  True]])
    """
    n = scores.shape[-1]
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    idx = scores.topk(k, dim=-1, sorted=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


# ---------------------------------------------------------------------------------------------
# head output norms ‖z_h W_O,h‖ without materialising [b, p, h, d]


def head_gram(model: nn.Module, arch: Arch, layer: int) -> torch.Tensor:
    """G_h = W_O,hᵀ W_O,h for each head: [h, dh, dh] (float32).

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> head_gram(model, arch, layer=0).shape  # 4 heads of 16 dims
    torch.Size([4, 16, 16])
    """
    w = arch.part(model, layer, "o").weight.detach().float()  # [d, h*dh]
    w = w.view(w.shape[0], arch.n_heads, arch.d_head)
    return torch.einsum("dhi,dhj->hij", w, w)


def head_output_norms(z: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per-head output norms ‖z_h W_O,h‖ from z [..., h, dh] and the Gram [h, dh, dh]: [..., h].

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> z = torch.randn(3, arch.n_heads, arch.d_head)  # [tokens, h, dh]
    >>> w_o = arch.part(model, 0, "o").weight.detach().view(-1, arch.n_heads, arch.d_head)
    >>> direct = torch.einsum("thi,dhi->thd", z, w_o).norm(dim=-1)  # each head's output, [t, h]
    >>> torch.allclose(head_output_norms(z, head_gram(model, arch, 0)), direct, atol=1e-5)
    True
    """
    zf = z.float()
    sq = torch.einsum("...hi,hij,...hj->...h", zf, gram, zf)
    return sq.clamp_min(0).sqrt()


# ---------------------------------------------------------------------------------------------
# static sets


@dataclass
class StaticSets:
    """Per-layer importance of every neuron and head, averaged over a calibration text.

    The paper's static-sparsity baseline keeps the same units for every token; ranking by these
    scores gives those units at any budget.

    >>> sets = StaticSets(mlp_score=torch.tensor([[0.1, 0.5, 0.3, 0.2]]),
    ...                   head_score=torch.tensor([[2.0, 1.0]]), mlp_sparsity=[0.5],
    ...                   head_sparsity=[0.5], n_tokens=16)
    >>> sets.mlp_keep()  # the top half by mean magnitude, for every token
    tensor([[False,  True,  True, False]])
    >>> sets.head_keep(0.0)
    tensor([[True, True]])
    """

    mlp_score: torch.Tensor  # [n_layers, d_mlp] mean |mlp.hook_post| over calibration tokens
    head_score: torch.Tensor  # [n_layers, n_heads] mean ‖z_h W_O,h‖ over calibration tokens
    mlp_sparsity: list[float]  # the budget these sets were asked for (per layer)
    head_sparsity: list[float]
    n_tokens: int  # calibration tokens

    def mlp_keep(self, sparsity=None) -> torch.Tensor:
        """Bool [n_layers, d_mlp]: the kept neurons at ``sparsity`` (default: the set's own)."""
        s = self.mlp_sparsity if sparsity is None else budgets(sparsity, len(self.mlp_score))
        return torch.stack(
            [
                topk_mask(sc, n_keep(si, sc.numel()))
                for sc, si in zip(self.mlp_score, s, strict=True)
            ]
        )

    def head_keep(self, sparsity=None) -> torch.Tensor:
        """Bool [n_layers, n_heads]: the kept heads at ``sparsity`` (default: the set's own)."""
        s = self.head_sparsity if sparsity is None else budgets(sparsity, len(self.head_score))
        return torch.stack(
            [
                topk_mask(sc, n_keep(si, sc.numel()))
                for sc, si in zip(self.head_score, s, strict=True)
            ]
        )


@torch.no_grad()
def static_sets(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    mlp_sparsity=0.5,
    head_sparsity=0.3,
    arch: Arch | None = None,
    progress: bool = True,
) -> StaticSets:
    """Choose static neuron/head sets by average magnitude over ``windows`` [n, window].

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> sets = static_sets(model, torch.randint(0, 128, (2, 16)), progress=False)
    >>> sets.n_tokens, sets.mlp_keep().sum(-1).tolist()  # 50% of 192 neurons kept per layer
    (32, [96, 96])
    """
    arch = arch or get_arch(model)
    ms = budgets(mlp_sparsity, arch.n_layers, "mlp_sparsity")
    hs = budgets(head_sparsity, arch.n_layers, "head_sparsity")
    windows = _check_windows(windows)
    mlp_sum = torch.zeros(arch.n_layers, arch.d_mlp, dtype=torch.float64)
    head_sum = torch.zeros(arch.n_layers, arch.n_heads, dtype=torch.float64)
    grams = [head_gram(model, arch, i) for i in range(arch.n_layers)]
    count = 0

    def on_post(t: torch.Tensor, name: str) -> None:
        i = int(name.split(".")[1])
        mlp_sum[i] += t.detach().abs().flatten(0, -2).sum(0).double().cpu()

    def on_z(t: torch.Tensor, name: str) -> None:
        i = int(name.split(".")[1])
        norms = head_output_norms(t.detach(), grams[i].to(t.device))
        head_sum[i] += norms.flatten(0, -2).sum(0).double().cpu()

    device = next(model.parameters()).device
    fns = [("blocks.*.mlp.hook_post", on_post), ("blocks.*.attn.hook_z", on_z)]
    with hooks(model, fns, arch):
        for w in tqdm(windows, desc="static sets", disable=not progress, leave=False):
            model(input_ids=w[None].to(device))
            count += w.numel()
    return StaticSets(
        mlp_score=(mlp_sum / count).float(),
        head_score=(head_sum / count).float(),
        mlp_sparsity=ms,
        head_sparsity=hs,
        n_tokens=count,
    )


# ---------------------------------------------------------------------------------------------
# the context manager


@contextmanager
def sparsified(
    model: nn.Module,
    *,
    mlp_sparsity=None,
    head_sparsity=None,
    mode: str = "oracle",
    dense_layers: Sequence[int] = (),
    static: StaticSets | None = None,
    predictors=None,
    arch: Arch | None = None,
    record: dict | None = None,
) -> Iterator[None]:
    """Inside this block every forward of ``model`` runs with contextual sparsity.

    ``mlp_sparsity`` / ``head_sparsity``: fraction of MLP neurons / query heads removed per
    token, a number or one per layer, in [0, 1); default 0 (dense), or the static set's own
    budget in ``mode="static"``. ``dense_layers``: layer indices left dense (the paper keeps the
    first layers dense). ``static``: a :class:`StaticSets` (``mode="static"``). ``predictors``: a
    :class:`dejavu_lab.predictors.Predictors` (``mode="predicted"``). ``record``: a dict that
    receives the boolean masks used, ``record["mlp"][layer]`` [b, p, n] and
    ``record["heads"][layer]`` [b, p, h], for inspection and tests.

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> with sparsified(model, mlp_sparsity=0.5, head_sparsity=0.25):
    ...     logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    """
    arch = arch or get_arch(model)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    if mode == "static":
        if not isinstance(static, StaticSets):
            raise ValueError("mode='static' needs static=static_sets(model, windows, ...).")
        mlp_sparsity = static.mlp_sparsity if mlp_sparsity is None else mlp_sparsity
        head_sparsity = static.head_sparsity if head_sparsity is None else head_sparsity
    if mode == "predicted":
        if predictors is None:
            raise ValueError(
                "mode='predicted' needs predictors=...; train them with "
                "dejavu_lab.predictors.train_predictors or `dejavu-lab train-predictors`."
            )
        predictors.check_model(model, arch)
    ms = budgets(0.0 if mlp_sparsity is None else mlp_sparsity, arch.n_layers, "mlp_sparsity")
    hs = budgets(0.0 if head_sparsity is None else head_sparsity, arch.n_layers, "head_sparsity")
    dense = set()
    for i in dense_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not -arch.n_layers <= i < arch.n_layers:
            raise ValueError(
                f"dense_layers must hold layer indices in 0..{arch.n_layers - 1}, got {i!r}."
            )
        dense.add(i % arch.n_layers)
    for i in dense:
        ms[i] = hs[i] = 0.0

    fns: list = []
    if record is not None:
        record.setdefault("mlp", {})
        record.setdefault("heads", {})
    static_mlp = static.mlp_keep(ms) if mode == "static" else None
    static_heads = static.head_keep(hs) if mode == "static" else None
    inputs: dict[str, torch.Tensor] = {}  # predicted mode: layer inputs seen so far

    if mode == "predicted":
        need_pre = any(s > 0 for s in hs) or (
            predictors.mode == "lookahead" and any(s > 0 for s in ms)
        )
        need_mid = predictors.mode == "same" and any(s > 0 for s in ms)
        if need_pre:
            fns.append(("blocks.*.hook_resid_pre", _store(inputs, "pre")))
        if need_mid:
            fns.append(("blocks.*.hook_resid_mid", _store(inputs, "mid")))

    for i in range(arch.n_layers):
        if ms[i] > 0:
            k = n_keep(ms[i], arch.d_mlp)
            fns.append(
                (
                    f"blocks.{i}.mlp.hook_post",
                    _mlp_masker(i, k, mode, static_mlp, predictors, inputs, record),
                )
            )
        if hs[i] > 0:
            k = n_keep(hs[i], arch.n_heads)
            gram = head_gram(model, arch, i) if mode == "oracle" else None
            fns.append(
                (
                    f"blocks.{i}.attn.hook_z",
                    _head_masker(i, k, mode, gram, static_heads, predictors, inputs, record),
                )
            )
    if not fns:  # dense everywhere: run the model untouched
        yield
        return
    with hooks(model, fns, arch):
        try:
            yield
        finally:
            inputs.clear()


def _store(inputs: dict, kind: str):
    def fn(t: torch.Tensor, name: str) -> None:
        inputs[f"{kind}{name.split('.')[1]}"] = t.detach()

    return fn


def _predictor_input(predictors, inputs: dict, layer: int, kind: str) -> torch.Tensor:
    """The tensor a predictor of ``layer`` reads (Knowl 2): same-layer or lookahead."""
    if predictors.mode == "lookahead":
        return inputs[f"pre{max(layer - 1, 0)}"]
    return inputs[f"pre{layer}"] if kind == "heads" else inputs[f"mid{layer}"]


def _apply(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _mlp_masker(i, k, mode, static_mlp, predictors, inputs, record):
    def fn(a: torch.Tensor, name: str) -> torch.Tensor:  # a: [b, p, n]
        if mode == "oracle":
            keep = topk_mask(a.detach().abs(), k)
        elif mode == "static":
            keep = static_mlp[i].to(a.device).expand_as(a)
        else:
            x = _predictor_input(predictors, inputs, i, "mlp")
            keep = topk_mask(predictors.mlp_scores(i, x), k)
        if record is not None:
            record["mlp"][i] = keep.cpu()
        return _apply(a, keep)

    return fn


def _head_masker(i, k, mode, gram, static_heads, predictors, inputs, record):
    def fn(z: torch.Tensor, name: str) -> torch.Tensor:  # z: [b, p, h, dh]
        if mode == "oracle":
            keep = topk_mask(head_output_norms(z.detach(), gram.to(z.device)), k)
        elif mode == "static":
            keep = static_heads[i].to(z.device).expand(z.shape[:-1])
        else:
            x = _predictor_input(predictors, inputs, i, "heads")
            keep = topk_mask(predictors.head_scores(i, x), k)
        if record is not None:
            record["heads"][i] = keep.cpu()
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


def sparse_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    progress: bool = True,
    batch_size: int = 1,
    **sparsified_kwargs,
) -> float:
    """Perplexity over ``windows`` [n, window] with :func:`sparsified` applied.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> sparse_perplexity(model, ids, progress=False) == sparse_perplexity(
    ...     model, ids, mlp_sparsity=0.0, progress=False)
    True
    """
    windows = _check_windows(windows)
    with torch.no_grad(), sparsified(model, **sparsified_kwargs):
        return perplexity(model, windows, batch_size=batch_size, progress=progress)


# The paper's ablation (Knowl 9, Table: OPT-175B, separate MLP / attention sparsity), for the
# chapters to print beside our numbers. Perplexity on WikiText and C4; accuracies zero-shot.
PAPER_KNOWL9 = [
    {
        "model": "OPT-175B dense",
        "mlp_sparsity": 0.0,
        "head_sparsity": 0.0,
        "wikitext_ppl": 10.8221,
        "c4_ppl": 7.7224,
        "lambada": 0.7584,
        "piqa": 0.8096,
    },
    {
        "model": "DejaVu MLP 85%",
        "mlp_sparsity": 0.85,
        "head_sparsity": 0.0,
        "wikitext_ppl": 10.7988,
        "c4_ppl": 7.7393,
        "lambada": 0.7619,
        "piqa": 0.8096,
    },
    {
        "model": "DejaVu attention 50%",
        "mlp_sparsity": 0.0,
        "head_sparsity": 0.5,
        "wikitext_ppl": 10.8696,
        "c4_ppl": 7.7393,
        "lambada": 0.7586,
        "piqa": 0.8063,
    },
]


# The paper's zero-shot tasks (Knowl 8, 9) under their lm-evaluation-harness names.
PAPER_TASKS = ("cb", "copa", "lambada_openai", "openbookqa", "piqa", "rte", "winogrande")


def lm_eval_tasks(
    model, tokenizer, tasks=PAPER_TASKS, *, limit: int | None = None, **sparsified_kwargs
) -> dict:
    """Zero-shot accuracy through lm-evaluation-harness with :func:`sparsified` applied.

    Needs the ``lm-eval`` package and a network (the harness downloads each task's dataset);
    without either it raises :class:`RuntimeError` saying which. Returns lm-eval's
    ``results`` dict, task -> metrics.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> lm_eval_tasks(model, None, ["piqa"], limit=10, mlp_sparsity=0.5)  # lm-eval not installed
    Traceback (most recent call last):
    ...
    RuntimeError: lm_eval_tasks needs lm-evaluation-harness: pip install lm-eval ...
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise RuntimeError(
            "lm_eval_tasks needs lm-evaluation-harness: pip install lm-eval (it then downloads "
            "the task datasets, so it also needs a network); use sparse_perplexity offline."
        ) from None
    import os

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise RuntimeError(
            "lm_eval_tasks needs a network to fetch the task datasets, but HF_HUB_OFFLINE or "
            "HF_DATASETS_OFFLINE is set; unset it or use sparse_perplexity."
        )
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    with torch.no_grad(), sparsified(model, **sparsified_kwargs):
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit)
        except (ConnectionError, OSError) as e:
            raise RuntimeError(
                f"lm-eval could not fetch its task data ({type(e).__name__}); it needs a "
                "network: run it online or use sparse_perplexity."
            ) from None
    return out["results"]
