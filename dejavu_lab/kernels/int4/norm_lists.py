"""The residual add and next norm of the decode step that also lists the next int4 product's
kept rows (:mod:`.lists`), spread over programs.

:func:`~dejavu_lab.kernels.residual_norm` runs the residual add and the norm in one program,
the whole row in its registers. Listing 64 blocks of rows there too put the prefix sums of
4096 flags on one program, on the step's critical path: on an H100 that cost the Llama-3-8B
step more than the products saved by reading ready-made lists. Here each of ``n / SLICE``
programs reads the whole row (the sums, the bias, the residual: a few KB from L2), reduces it
to the norm's statistics — the same code on the same row in every program, so the same
numbers — and then adds, normalises and lists only its own slice of ``SLICE`` rows. The sums
are read by every program, so the last program to finish reading zeroes them (an arrival
counter), and the launch's remaining programs zero a consumed workspace as
:func:`~dejavu_lab.kernels.residual_norm` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._common import next_pow2
from ..pdl import await_inputs, pdl_args
from .lists import KeptLists, write_lists

__all__ = ["SLICE", "norm_lists", "norm_lists_kernel"]

#: rows each program adds, normalises and lists (four blocks of 64)
SLICE = 256


@triton.jit
def _row(src_ptr, b_ptr, res_ptr, offs, mask, HAS_BIAS: tl.constexpr, ty: tl.constexpr):
    """``h = res + (src + b)`` at ``offs``, rounded to ``ty`` and back to fp32."""
    a = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + a).to(ty)
    return h.to(tl.float32)


@triton.jit
def norm_lists_kernel(
    src_ptr,  # [N] the block's output: fp32 sums (FROM_SUMS: zeroed here) or the model's dtype
    b_ptr,  # [N] its bias (HAS_BIAS)
    res_ptr,  # [N] the residual stream before the block
    h_ptr,  # [N] after it
    w_ptr,  # [N] the norm's scale
    nb_ptr,  # [N] its shift (HAS_NB)
    y_ptr,  # [N] norm(h)
    z_ptr,  # [n_zero] fp32 sums an earlier launch consumed, zeroed by the last programs
    count_ptr,  # int32 [1] arrival counter, zero between launches
    thr_ptr,  # not THR_SCALAR: [N] fp32 thresholds
    thr_value,  # THR_SCALAR: the one threshold
    entries_ptr,  # the kept lists (KeptLists)
    meta_ptr,
    n,
    eps,
    n_zero,
    n_list,  # programs that list (n / SLICE, rounded up); the rest zero z
    FROM_SUMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    HAS_NB: tl.constexpr,
    THR_SCALAR: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row, for the statistics
    SLICE: tl.constexpr,  # rows each program writes and lists (a multiple of LIST_ROWS)
    LIST_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        await_inputs(PDL)
    pid = tl.program_id(0)
    if pid >= n_list:  # the other programs leave a consumed workspace at zero
        zo = (pid - n_list) * BLOCK + tl.arange(0, BLOCK)
        tl.store(z_ptr + zo, tl.zeros((BLOCK,), tl.float32), mask=zo < n_zero)
    else:
        ty = h_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        h = _row(src_ptr, b_ptr, res_ptr, offs, mask, HAS_BIAS, ty)
        if RMS:
            mean = 0.0
            xc = h
        else:
            mean = tl.sum(h, axis=0) / n
            xc = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n + eps)
        so = pid * SLICE + tl.arange(0, SLICE)  # this program's slice, read again (L1 / L2)
        smask = so < n
        hs = _row(src_ptr, b_ptr, res_ptr, so, smask, HAS_BIAS, ty)
        if FROM_SUMS:  # every program has read the sums: the last to arrive zeroes them
            tl.debug_barrier()  # (the acq_rel arrival orders this CTA's loads before it)
            if tl.atomic_add(count_ptr, 1, sem="acq_rel") == n_list - 1:
                tl.store(src_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=mask)
                tl.atomic_xchg(count_ptr, 0, sem="relaxed")
        tl.store(h_ptr + so, hs.to(ty), mask=smask)
        ys = (hs - mean) * rstd * tl.load(w_ptr + so, mask=smask, other=0.0).to(tl.float32)
        if HAS_NB:
            ys = ys + tl.load(nb_ptr + so, mask=smask, other=0.0).to(tl.float32)
        ys = ys.to(ty)
        tl.store(y_ptr + so, ys, mask=smask)
        xs = ys.to(tl.float32)
        if THR_SCALAR:
            keep = tl.abs(xs) > thr_value
        else:
            keep = tl.abs(xs) > tl.load(thr_ptr + so, mask=smask, other=0.0)
        xs = tl.where(keep & smask, xs, 0.0)
        write_lists(xs, pid * (SLICE // LIST_ROWS), entries_ptr, meta_ptr, n // LIST_ROWS,
                    LIST_ROWS, SLICE)  # fmt: skip


def norm_lists(src: torch.Tensor, bias, residual: torch.Tensor, h: torch.Tensor,
               y: torch.Tensor, norm: tuple, kind: str, from_sums: bool, zero, lists: tuple) -> None:  # fmt: skip
    """Launch :func:`norm_lists_kernel` for :func:`~dejavu_lab.kernels.residual_norm` (its
    arguments; ``h`` and ``y`` the outputs, ``lists`` ``(thr, kept)``). No input checks (the
    engine calls it inside a CUDA graph).

    >>> ws, x, w = torch.randn(256), torch.randn(1, 256).half(), torch.ones(256).half()
    >>> h, y, kept = torch.empty_like(x), torch.empty_like(x), KeptLists.empty(256, "cpu")
    >>> norm_lists(ws, None, x, h, y, (w, None, 1e-5), "rms", True, None, (0.5, kept))
    >>> bool((ws == 0).all()), int(kept.counts().sum()) == int((y.abs() > 0.5).sum())
    (True, True)
    """
    thr, kept = lists
    if not isinstance(kept, KeptLists) or SLICE % kept.rows:
        raise ValueError(f"lists must hold KeptLists in blocks dividing {SLICE} rows.")
    w, nb, eps = norm
    n = residual.shape[-1]
    block = next_pow2(n)
    n_list = triton.cdiv(n, SLICE)
    n_zero = zero.numel() if zero is not None else 0
    scalar = not isinstance(thr, torch.Tensor)
    counter = _workspace.buffer(residual.device, "norm_lists", 1, torch.int32)
    norm_lists_kernel[(n_list + triton.cdiv(n_zero, block),)](
        src, bias if bias is not None else src, residual, h, w, nb if nb is not None else w, y,
        zero if zero is not None else src, counter, w if scalar else thr,
        float(thr) if scalar else 0.0, kept.entries, kept.meta, n, eps, n_zero, n_list,
        FROM_SUMS=from_sums, HAS_BIAS=bias is not None, RMS=kind == "rms", HAS_NB=nb is not None,
        THR_SCALAR=scalar, BLOCK=block, SLICE=SLICE, LIST_ROWS=kept.rows,
        num_warps=min(16, max(1, block // 512)), **pdl_args(h.device),
    )  # fmt: skip
