"""How the batch-1 half2 GEMV (:mod:`.half2`) reads its rows and adds them to its sums.

Two ways to the same half2 sums over a program's rows: the walk (every row at a constant
offset, :func:`_walk_eight`; in threshold mode a dropped row's load is predicated off by a
register bit mask, :func:`_block_bits`) and the list of kept rows (:func:`_eight`, each entry
the row's offset and its fp16 activation). Each takes eight rows at a time, their eight loads
written before the first product (ptxas then decides how far ahead each load issues). :func:`_ahead` reads a
block's first eight rows before the kernel waits for the kernel before it, under
programmatic dependent launch: the weights are no kernel's output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .half2_decode import _bits, _row

__all__ = []


@triton.jit
def _listed(base, j, n, r0, p_ptr, STRIDE_P, offs_w, mask_w):
    """Entry ``j`` of a kept-row list (none past ``n``): the row's code words and its
    activation as a half2 ``(x, x)``."""
    e = tl.load(base + j, mask=j < n, other=0)
    row = r0 + (e & 0xFFFF)
    words = tl.load(p_ptr + row.to(tl.int64) * STRIDE_P + offs_w, mask=mask_w & (j < n), other=0,
                    eviction_policy="evict_first")  # fmt: skip
    b = (e >> 16) & 0xFFFF
    return words, (b | (b << 16)) + tl.zeros_like(offs_w)


@triton.jit
def _eight(base, c, n, r0, p_ptr, STRIDE_P, offs_w, mask_w, a0, a1, a2, a3):
    """Listed rows ``c`` to ``c + 7`` added to the half2 sums: the eight rows' loads are
    written before any arithmetic, so they are in flight together."""
    w0, x0 = _listed(base, c, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w1, x1 = _listed(base, c + 1, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w2, x2 = _listed(base, c + 2, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w3, x3 = _listed(base, c + 3, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w4, x4 = _listed(base, c + 4, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w5, x5 = _listed(base, c + 5, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w6, x6 = _listed(base, c + 6, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    w7, x7 = _listed(base, c + 7, n, r0, p_ptr, STRIDE_P, offs_w, mask_w)
    return _add_eight(w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7,
                      a0, a1, a2, a3)  # fmt: skip


@triton.jit
def _take(pw, xp, r, keep, inv, mask_w, STRIDE_P: tl.constexpr, MASKED: tl.constexpr,
          EVEN_D: tl.constexpr, STASHED: tl.constexpr):  # fmt: skip
    """Row ``r`` of a block (``pw`` its row 0's words, ``xp`` its activations; ``STASHED``:
    fp32 bits): the row's code words and its activation divided by the program's magnitude, as
    a half2 ``(x, x)``. ``MASKED``: ``keep`` (the same in every thread) says whether the row is
    kept; a dropped row's load is predicated off (no bytes move) and its activation is 0 (its
    decode costs issue slots only: ``(0 - 8) x 0``). A constant ``r`` puts the load at an
    immediate offset."""
    if MASKED:
        use = mask_w & ((tl.zeros_like(mask_w.to(tl.int32)) + keep.to(tl.int32)) != 0)
        words = tl.load(pw + r * STRIDE_P, mask=use, other=0, eviction_policy="evict_first")
    else:
        words = _words(pw, r, mask_w, STRIDE_P, EVEN_D)
    return words, _x2(xp, r, keep, inv, words, MASKED, STASHED)


@triton.jit
def _x2(xp, r, keep, inv, like, MASKED: tl.constexpr, STASHED: tl.constexpr):
    """Row ``r`` 's activation (``MASKED``: 0 unless ``keep``) divided by the program's
    magnitude, as a half2 ``(x, x)`` in every lane of ``like``."""
    if STASHED:
        xv = tl.load(xp + r).to(tl.float32, bitcast=True)
    else:
        xv = tl.load(xp + r).to(tl.float32)
    if MASKED:
        xv = tl.where(keep, xv, 0.0)
    b = _bits((xv * inv).to(tl.float16))
    return (b | (b << 16)) + tl.zeros_like(like)


@triton.jit
def _words(pw, r, mask_w, STRIDE_P: tl.constexpr, EVEN_D: tl.constexpr):
    """Row ``r`` 's code words of a block (``pw`` its row 0's words), every one read."""
    if EVEN_D:
        return tl.load(pw + r * STRIDE_P, eviction_policy="evict_first")
    return tl.load(pw + r * STRIDE_P, mask=mask_w, other=0, eviction_policy="evict_first")


@triton.jit
def _ahead(pw, mask_w, STRIDE_P: tl.constexpr, EVEN_D: tl.constexpr):
    """A block's first eight rows of code words, read before the kernel waits for its inputs
    (the weights are no kernel's output, so the first round trip to memory overlaps the kernel
    before: :mod:`~dejavu_lab.kernels.pdl`)."""
    return (_words(pw, 0, mask_w, STRIDE_P, EVEN_D), _words(pw, 1, mask_w, STRIDE_P, EVEN_D),
            _words(pw, 2, mask_w, STRIDE_P, EVEN_D), _words(pw, 3, mask_w, STRIDE_P, EVEN_D),
            _words(pw, 4, mask_w, STRIDE_P, EVEN_D), _words(pw, 5, mask_w, STRIDE_P, EVEN_D),
            _words(pw, 6, mask_w, STRIDE_P, EVEN_D), _words(pw, 7, mask_w, STRIDE_P, EVEN_D))  # fmt: skip


@triton.jit
def _first_eight(w0, w1, w2, w3, w4, w5, w6, w7, xp, inv, STASHED: tl.constexpr,
                 a0, a1, a2, a3):  # fmt: skip
    """Rows 0 to 7 of a dense walk added to the half2 sums, their words read ahead
    (:func:`_ahead`)."""
    x0 = _x2(xp, 0, True, inv, w0, False, STASHED)
    x1 = _x2(xp, 1, True, inv, w0, False, STASHED)
    x2 = _x2(xp, 2, True, inv, w0, False, STASHED)
    x3 = _x2(xp, 3, True, inv, w0, False, STASHED)
    x4 = _x2(xp, 4, True, inv, w0, False, STASHED)
    x5 = _x2(xp, 5, True, inv, w0, False, STASHED)
    x6 = _x2(xp, 6, True, inv, w0, False, STASHED)
    x7 = _x2(xp, 7, True, inv, w0, False, STASHED)
    return _add_eight(w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7,
                      a0, a1, a2, a3)  # fmt: skip


@triton.jit
def _walked(pw, xp, kbits, inv, mask_w, ROW: tl.constexpr, STRIDE_P: tl.constexpr,
            MODE: tl.constexpr, EVEN_D: tl.constexpr, STASHED: tl.constexpr):  # fmt: skip
    """Row ``ROW`` of a walked block (:func:`_take` at a constant offset); threshold mode
    (``MODE`` 1): kept where bit ``ROW % 64`` of ``kbits`` (:func:`_block_bits`) is set, a
    register, so the row's load waits on no load."""
    keep = ((kbits >> (ROW % 64)) & 1) != 0
    return _take(pw, xp, ROW, keep, inv, mask_w, STRIDE_P, MODE == 1, EVEN_D, STASHED)


@triton.jit
def _walk_eight(pw, xp, kbits, inv, mask_w, ROW: tl.constexpr, STRIDE_P: tl.constexpr,
                MODE: tl.constexpr, EVEN_D: tl.constexpr, STASHED: tl.constexpr,
                a0, a1, a2, a3):  # fmt: skip
    """Rows ``ROW`` to ``ROW + 7`` added to the half2 sums, every load written before the first
    product (ptxas still decides how far ahead each load issues)."""
    w0, x0 = _walked(pw, xp, kbits, inv, mask_w, ROW, STRIDE_P, MODE, EVEN_D, STASHED)
    w1, x1 = _walked(pw, xp, kbits, inv, mask_w, ROW + 1, STRIDE_P, MODE, EVEN_D, STASHED)
    w2, x2 = _walked(pw, xp, kbits, inv, mask_w, ROW + 2, STRIDE_P, MODE, EVEN_D, STASHED)
    w3, x3 = _walked(pw, xp, kbits, inv, mask_w, ROW + 3, STRIDE_P, MODE, EVEN_D, STASHED)
    w4, x4 = _walked(pw, xp, kbits, inv, mask_w, ROW + 4, STRIDE_P, MODE, EVEN_D, STASHED)
    w5, x5 = _walked(pw, xp, kbits, inv, mask_w, ROW + 5, STRIDE_P, MODE, EVEN_D, STASHED)
    w6, x6 = _walked(pw, xp, kbits, inv, mask_w, ROW + 6, STRIDE_P, MODE, EVEN_D, STASHED)
    w7, x7 = _walked(pw, xp, kbits, inv, mask_w, ROW + 7, STRIDE_P, MODE, EVEN_D, STASHED)
    return _add_eight(w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7,
                      a0, a1, a2, a3)  # fmt: skip


@triton.jit
def _block_bits(xs, h, ROWS: tl.constexpr):
    """Bit ``j`` set where row ``64 h + j`` of the program is kept (``xs`` thresholded already:
    a kept row's activation is nonzero)."""
    r = tl.arange(0, ROWS)
    bit = tl.full((ROWS,), 1, tl.int64) << (r % 64).to(tl.int64)
    return tl.sum(tl.where((xs != 0) & (r // 64 == h), bit, 0), axis=0)


@triton.jit
def _add_eight(w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7, a0, a1, a2, a3):
    """Eight loaded rows added to the half2 sums ``a0``-``a3``."""
    a0, a1, a2, a3 = _row(w0, x0, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w1, x1, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w2, x2, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w3, x3, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w4, x4, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w5, x5, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w6, x6, a0, a1, a2, a3)
    a0, a1, a2, a3 = _row(w7, x7, a0, a1, a2, a3)
    return a0, a1, a2, a3
