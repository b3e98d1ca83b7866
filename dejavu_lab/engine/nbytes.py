"""Bytes a batch-1 decode step reads, and the speedup they predict (Deja Vu §2.2, §4.4).

At batch 1 a decode step is memory-bound: its time is (bytes read) / (bandwidth) plus the gaps
between kernels. Counting the bytes of each part of :class:`dejavu_lab.engine.Decoder`'s step
gives its floor and, for a sparse configuration, the speedup it can at most reach. The counts
follow what the engine actually reads:

- attention weights: ``W_QKV`` and ``W_O``; the sparse path reads the kept heads' rows of
  ``W_Q``/``W_O`` and, with deferred KV (multi-head attention), of ``W_K``/``W_V``; with GQA
  it reads every K/V head (they are few);
- MLP weights: ``W1`` and ``W2`` (ReLU) or gate, up and down (SwiGLU), the kept neurons' rows;
- TEAL/WINA (``site_kept``): the kept fraction of each site's input columns — ``W_QKV`` at
  ``attn_in``, ``W_O`` at ``o_in``, gate/up (``fc1``) at ``mlp_in``, down at ``down_in``; CATS:
  the gate (``fc1``) dense, up and down at the kept fraction of neurons (``gate``);
- KV cache: the attention core reads every head's cache up to the current position;
- ``lm_head`` (never sparse), and the predictors' weights (fp32 in :mod:`dejavu_lab.predictors`).

:mod:`dejavu_lab.bytes_model` counts the ideal bytes of a sparse step as the paper reasons
about them: a skipped head saves its share of the KV cache too (and, under GQA, its KV head's
``W_K``/``W_V`` when no query head of the group is kept, in expectation over random choices),
budgets may vary per layer, and predictors count at the weights' width (fp16) without biases.
This module counts what our engine actually reads — every head's KV cache, every K/V head under
GQA, fp32 predictors with their output biases — so it gives the engine's floor, a little above
that ideal (OPT-6.7B at 85% MLP and 50% head sparsity, context 512: 4.30 GB per token here,
4.07 GB there).
"""

from __future__ import annotations

from ..arch import Arch

__all__ = ["predictor_bytes", "step_bytes"]


def predictor_bytes(arch: Arch, mlp_rank: int, head_rank: int, esize: int = 4) -> int:
    """Weights of DejaVu's low-rank predictors (d -> r -> n, plus the output bias), all layers.

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> arch = get_arch(PRESETS["opt-6.7b"].config())
    >>> round(predictor_bytes(arch, mlp_rank=64, head_rank=32) / 1e6, 1)  # MB, fp32
    186.8
    """
    d, n, h = arch.d_model, arch.d_mlp, arch.n_heads
    per_layer = d * mlp_rank + mlp_rank * n + n + d * head_rank + head_rank * h + h
    return arch.n_layers * per_layer * esize


def step_bytes(
    arch: Arch,
    *,
    vocab: int,
    context: int,
    mlp_kept: float = 1.0,
    head_kept: float = 1.0,
    predictors: int = 0,
    esize: int = 2,
    d_embed: int | None = None,
    site_kept: dict[str, float] | None = None,
) -> dict[str, float]:
    """Bytes per decode step by part: attention, mlp, kv_cache, lm_head, predictors, total.

    ``context`` is the number of cached positions attended; ``mlp_kept``/``head_kept`` are the
    kept fractions (1 - sparsity); ``predictors`` is :func:`predictor_bytes` (0 for dense).
    ``site_kept`` (TEAL, WINA, CATS) gives the kept fraction per site instead, e.g.
    ``{"attn_in": 0.5, "o_in": 0.5, "mlp_in": 0.5, "down_in": 0.5}`` or ``{"gate": 0.5}``;
    sites not named are read densely.

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> arch = get_arch(PRESETS["opt-6.7b"].config())
    >>> dense = step_bytes(arch, vocab=50272, context=512)
    >>> sparse = step_bytes(arch, vocab=50272, context=512, mlp_kept=0.15, head_kept=0.5,
    ...                     predictors=predictor_bytes(arch, 64, 32))
    >>> round(dense["total"] / 1e9, 1), round(sparse["total"] / 1e9, 1)  # GB per token
    (13.6, 4.3)
    >>> llama = get_arch(PRESETS["llama-2-13b"].config())
    >>> half = dict.fromkeys(("attn_in", "o_in", "mlp_in", "down_in"), 0.5)
    >>> teal = step_bytes(llama, vocab=32000, context=512, site_kept=half)
    >>> cats = step_bytes(llama, vocab=32000, context=512, site_kept={"gate": 0.5})
    >>> [round(b["mlp"] / step_bytes(llama, vocab=32000, context=512)["mlp"], 3)
    ...  for b in (teal, cats)]  # CATS reads the gate densely
    [0.5, 0.667]
    """
    L, d, n, dh = arch.n_layers, arch.d_model, arch.d_mlp, arch.d_head
    q_rows, kv_rows = arch.n_heads * dh, arch.n_kv_heads * dh
    mha = arch.n_heads == arch.n_kv_heads
    kv_kept = head_kept if mha else 1.0
    attn = (2 * q_rows * head_kept + 2 * kv_rows * kv_kept) * d
    mlp = (3 if arch.gated else 2) * n * d * mlp_kept
    if site_kept is not None:
        f = {s: 1.0 for s in ("attn_in", "o_in", "mlp_in", "down_in")} | dict(site_kept)
        attn = (q_rows + 2 * kv_rows) * d * f["attn_in"] + q_rows * d * f["o_in"]
        n_in = 2 if arch.gated else 1  # matrices reading the MLP input: gate + up, or fc1
        mlp = n_in * n * d * f["mlp_in"] + n * d * f["down_in"]
        if "gate" in f:  # CATS: the gate (fc1) dense, up (gated) and down over the survivors
            mlp = n * d + (n_in - 1) * n * d * f["gate"] + n * d * f["gate"]
    parts = {
        "attention": L * attn * esize,
        "mlp": L * mlp * esize,
        "kv_cache": L * 2 * kv_rows * context * esize,
        "lm_head": vocab * (d_embed or d) * esize,
        "predictors": float(predictors),
    }
    parts["total"] = sum(parts.values())
    return parts
