"""Triton kernels for contextual sparsity at decode time (Deja Vu §4.4, Appendix E).

One kernel per module, each with a checking wrapper, a plain-PyTorch ``*_ref`` and a CPU path
(the reference, or the Triton kernel itself under ``TRITON_INTERPRET=1``), grouped by family:
``mlp/`` (up, down, fused), ``threshold/`` (gemv, tile, fused, lowrank), ``cats/`` (mlp, up, sums),
``attention/`` (sparse, core, kv_window), ``rope/`` (rotate, qkv, epilogue), ``norm``, and for
DejaVu's predictors ``predict`` (their scores in two launches) and ``select`` (a one-program
top-k; the engine keeps ``torch.topk``, which measured faster). The
helpers they share live in ``_common`` (checks), ``_neurons`` (activations, row dots),
``_reduce``, ``_workspace`` and ``pdl``; ``tuning`` reads the tuned launch tables of ``tuned/``:

- :func:`sparse_mlp_up`   — selected rows of W1 (or gate/up), fused bias and activation.
- :func:`sparse_mlp_down` — selected rows of W2 stored transposed (coalesced), reduced.
- :func:`sparse_attention` — QKV for the selected heads, attention over their KV cache, W_O.
- :func:`threshold_gemv` — TEAL/WINA input-sparse GEMV, the mask ``|x| > thr`` computed inside
  (one token: :mod:`.threshold.tile`, one masked tile per program; :func:`threshold_gemv_act`
  fuses the MLP's activation into it; :func:`~dejavu_lab.kernels.threshold.lowrank.lowrank_add`
  adds R-Sparse's low-rank term for the entries it drops).
- :func:`fused_sparse_mlp` — up (or gate/up), activation and down of the kept neurons, one launch.
- :func:`cats_mlp` — CATS: dense gate (cuBLAS), then up/down of the kept neurons only.
- :func:`cats_up`  — CATS's thresholded up step: the up rows of the neurons the gate keeps.

All take a union batch of 1-32 tokens that share one index set (Appendix C.1).
:mod:`dejavu_lab.bench.kernels` times them for ``kernels/bench_*.py`` (with the clocks of
:mod:`dejavu_lab.bench.timing`; recorded in ``results/``); :mod:`dejavu_lab.report.kernels` draws
those results for the chapter
``notebooks/60_sparse_kernels.md``.

A sparse MLP is the up kernel then the down kernel over one index set; keeping every neuron
gives the dense MLP:

>>> import torch
>>> _ = torch.manual_seed(0)
>>> x, w1, w2t = (torch.randn(*s, dtype=torch.float16) / 4 for s in ((16,), (64, 16), (64, 16)))
>>> every = torch.arange(64)
>>> y = sparse_mlp_down(sparse_mlp_up(x, w1, every), w2t, every)
>>> torch.allclose(y, torch.relu(x @ w1.T) @ w2t, atol=1e-2)
True
"""

from ._common import use_triton
from .attention.core import query_slots, sparse_attention_core, sparse_attention_core_ref
from .attention.kv_window import kv_window_write, kv_window_write_ref
from .attention.sparse import sparse_attention, sparse_attention_ref
from .cats.mlp import cats_hidden, cats_mlp, cats_mlp_ref, cats_sums
from .cats.up import cats_up, cats_up_ref
from .mlp.down import sparse_mlp_down, sparse_mlp_down_ref
from .mlp.fused import FUSED_ACTIVATIONS, fused_sparse_mlp, fused_sparse_mlp_ref
from .mlp.up import ACTIVATIONS, sparse_mlp_up, sparse_mlp_up_ref
from .norm import row_norm, row_norm_ref
from .rope.epilogue import residual_norm, rope_sums
from .rope.qkv import qkv_rope, qkv_rope_ref
from .rope.rotate import rope_, rope_ref
from .threshold.fused import threshold_gemv_act, threshold_sums
from .threshold.gemv import threshold_gemv, threshold_gemv_ref

__all__ = [
    "cats_hidden",
    "cats_sums",
    "query_slots",
    "qkv_rope",
    "qkv_rope_ref",
    "residual_norm",
    "rope_",
    "rope_ref",
    "rope_sums",
    "threshold_sums",
    "use_triton",
    "ACTIVATIONS",
    "FUSED_ACTIVATIONS",
    "cats_mlp",
    "cats_mlp_ref",
    "cats_up",
    "cats_up_ref",
    "fused_sparse_mlp",
    "fused_sparse_mlp_ref",
    "kv_window_write",
    "kv_window_write_ref",
    "row_norm",
    "row_norm_ref",
    "sparse_attention",
    "sparse_attention_core",
    "sparse_attention_core_ref",
    "sparse_attention_ref",
    "sparse_mlp_down",
    "sparse_mlp_down_ref",
    "sparse_mlp_up",
    "sparse_mlp_up_ref",
    "threshold_gemv",
    "threshold_gemv_act",
    "threshold_gemv_ref",
]
