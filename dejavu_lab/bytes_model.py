"""The paper's ideal bytes per token for a sparsity budget and its speedup (Deja Vu §2.2, §4.4).

Generating one token at batch size 1 is bound by memory bandwidth, so the ideal speedup of a
sparse step is

    dense bytes / sparse bytes,

an upper bound that real kernels approach but do not reach (a naive Triton gather-GEMV measured
2.9× over dense at 90% sparsity where this model says 10×; DejaVu reports
~2× end to end on OPT-175B at 75% overall sparsity, §5.1).

The bytes are counted by :func:`dejavu_lab.step_bytes.step_bytes`; this module reads a budget
as the paper reasons about it: the kept counts :func:`~dejavu_lab.budgets.n_keep` gives, per
layer; a skipped head saves its slices of W_Q and W_O, and its key/value head's W_K, W_V and
KV-cache entries when no query head of its group is selected; the predictors at the weights'
width, without biases, in the layers where they select something.

Which key/value heads are needed under grouped-query attention: with ``k`` of ``h`` query heads
kept and ``g = h / kv`` query heads per KV head, a KV head is skipped only when none of its group
is kept; for a uniformly random choice that happens with probability C(h−g, k) / C(h, k).

Our engine (:class:`dejavu_lab.engine.Decoder`) reads a little more — every head's KV cache,
every K/V head under GQA, fp32 predictors with their biases: :func:`~dejavu_lab.step_bytes.
step_bytes`'s ``mlp_kept``/``head_kept`` count that.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from .arch import Arch
from .budgets import budgets, n_keep
from .step_bytes import predictor_bytes, step_bytes

__all__ = ["ByteCount", "bytes_per_token", "predicted_speedup", "kv_heads_needed"]


@dataclass(frozen=True)
class ByteCount:
    """Bytes read per generated token, by part.

    >>> b = ByteCount(attn_weights=4, kv_cache=1, mlp_weights=8, predictors=0, unembed=2)
    >>> b.total, b.as_dict()["total"]
    (15, 15)
    """

    attn_weights: float  # W_Q, W_K, W_V, W_O slices of the kept heads
    kv_cache: float  # keys and values of the context for the needed KV heads
    mlp_weights: float  # W1 (and gate) rows and W2 columns of the kept neurons
    predictors: float  # the low-rank predictors (0 for dense)
    unembed: float  # the vocab × d output matrix (read in full)

    @property
    def total(self) -> float:
        return self.attn_weights + self.kv_cache + self.mlp_weights + self.predictors + self.unembed

    def as_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


def kv_heads_needed(n_heads: int, n_kv_heads: int, kept: int) -> float:
    """Expected KV heads with at least one kept query head (uniformly random choice).

    >>> round(kv_heads_needed(32, 8, 8), 2)  # Llama-3-8B shape, 8 of 32 query heads kept
    5.64
    >>> kv_heads_needed(32, 8, 32)  # dense: every KV head
    8.0
    """
    g = n_heads // n_kv_heads
    if kept >= n_heads:
        return float(n_kv_heads)
    p_skip = comb(n_heads - g, kept) / comb(n_heads, kept)
    return n_kv_heads * (1 - p_skip)


def bytes_per_token(
    arch: Arch,
    vocab: int,
    *,
    mlp_sparsity=0.0,
    head_sparsity=0.0,
    dense_layers=(),
    context: int = 512,
    dtype_bytes: int = 2,
    mlp_rank: int = 0,
    head_rank: int = 0,
) -> ByteCount:
    """Bytes read to generate one token with the given budgets (batch size 1).

    ``context``: tokens already in the KV cache. ``dtype_bytes``: 2 for fp16/bf16 weights.
    ``mlp_rank``/``head_rank``: ranks of the predictors (0: no predictors, e.g. the oracle).

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> opt175b = get_arch(PRESETS["opt-175b"].config())  # the shape only, no weights
    >>> round(bytes_per_token(opt175b, 50272).total / 1e9)  # GB per token, dense fp16
    352
    >>> round(bytes_per_token(opt175b, 50272, mlp_sparsity=0.9).total / 1e9)
    143
    """
    ms = budgets(mlp_sparsity, arch.n_layers, "mlp_sparsity")
    hs = budgets(head_sparsity, arch.n_layers, "head_sparsity")
    dense = {i % arch.n_layers for i in dense_layers}
    h, n = arch.n_heads, arch.d_mlp
    sparse = [i for i in range(arch.n_layers) if i not in dense]
    kept: dict[tuple[int, str], float] = {}
    for i in sparse:
        k_h = n_keep(hs[i], h)
        kv = kv_heads_needed(h, arch.n_kv_heads, k_h) / arch.n_kv_heads  # weights and cache
        kept |= {(i, "mlp"): n_keep(ms[i], n) / n, (i, "heads"): k_h / h}
        kept |= {(i, "kv"): kv, (i, "kv_cache"): kv}
    pred = predictor_bytes(arch, mlp_rank, head_rank, dtype_bytes, biases=False,
                           mlp_layers=sum(ms[i] > 0 for i in sparse),
                           head_layers=sum(hs[i] > 0 for i in sparse))  # fmt: skip
    b = step_bytes(arch, kept, vocab=vocab, context=context, predictors=pred, esize=dtype_bytes)
    return ByteCount(b["attention"], float(b["kv_cache"]), b["mlp"], b["predictors"], b["lm_head"])


def predicted_speedup(arch: Arch, vocab: int, **budget) -> float:
    """Ideal speedup of one decoding step: dense bytes / sparse bytes (same ``context``).

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> opt175b = get_arch(PRESETS["opt-175b"].config())
    >>> round(predicted_speedup(opt175b, 50272, mlp_sparsity=0.75, head_sparsity=0.75), 2)
    3.96
    """
    keys = ("context", "dtype_bytes")
    dense = bytes_per_token(arch, vocab, **{k: v for k, v in budget.items() if k in keys})
    return dense.total / bytes_per_token(arch, vocab, **budget).total
