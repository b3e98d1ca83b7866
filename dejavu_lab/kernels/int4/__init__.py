"""W4A16 GEMVs on group-wise int4 weights (:class:`~dejavu_lab.quant.Int4Weight`), dense and sparse.

Activation sparsity and 4-bit weights multiply: half the input channels of a 4-bit matrix is
an eighth of its fp16 bytes. One kernel (:mod:`.kernel`) walks the codes, which are laid out
one row per input channel, so a dropped channel is a row whose bytes are never read; one token
of the dense and threshold GEMVs runs :mod:`.half2` instead (codes decoded two at a time into
half2 pairs; :mod:`.tile`, one masked fp32 tile per program on TEAL's grid, on request):

- :func:`int4_gemv` (:mod:`.dense`) — ``x @ dequant(W)``, every row;
- :func:`int4_threshold_gemv` (:mod:`.threshold`) — TEAL / WINA: the mask ``|x| > thr`` computed
  in the kernel, rows below threshold skipped, union batches of 1-32 tokens;
- :func:`int4_rows_gemv` (:mod:`.rows`) — the rows of an index list (Deja Vu's down projection
  over the kept neurons, ``W_Oᵀ`` over the kept heads).

Deja Vu's up projection and kept heads' QKV, and CATS's up rows, drop *outputs* instead: one
more kernel (:mod:`.up`) reads a rows-layout :class:`~dejavu_lab.quant.Int4Rows` (``W``, one row
of codes per output, groups along the inputs), so a dropped output is a row never read:

- :func:`int4_kept_up` (:mod:`.up`) — ``act(W[rows] x + b)`` (or ``act(gate) * up``) for the rows
  of an index list (or every row);
- :func:`int4_cats_up` (:mod:`.cats`) — CATS: every gate row, then the up rows of the neurons
  whose ``|act(gate)|`` passes the threshold, the mask formed in the kernel.

Each has a plain-PyTorch ``*_ref``; on the CPU the kernel runs under ``TRITON_INTERPRET=1``
(else the reference). ``kernels/bench_int4.py`` times them on a GPU against cuBLAS fp16 and
gemlite.
"""

from .cats import int4_cats_up, int4_cats_up_ref
from .dense import int4_gemv, int4_gemv_ref
from .rows import int4_rows_gemv, int4_rows_gemv_ref
from .threshold import int4_threshold_gemv, int4_threshold_gemv_ref
from .up import int4_kept_up, int4_kept_up_ref

__all__ = [
    "int4_cats_up",
    "int4_cats_up_ref",
    "int4_gemv",
    "int4_gemv_ref",
    "int4_kept_up",
    "int4_kept_up_ref",
    "int4_rows_gemv",
    "int4_rows_gemv_ref",
    "int4_threshold_gemv",
    "int4_threshold_gemv_ref",
]
