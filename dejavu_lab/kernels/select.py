"""Top-k selection in one launch: DejaVu's kept neurons from its predictors' scores.

DejaVu's lookahead predictors (§4.3) score every neuron of the next layer, and the decoder keeps
the ``k`` best. ``torch.topk`` does this in one single-block launch while a row is short for the
number of rows and in a multi-block select of about a dozen launches beyond (20,000 entries for
up to 20 rows: OPT-13B's 20,480 neurons and up); either costs tens of microseconds per layer at
OPT widths (``kernels/bench_topk.py``), on the decode step's critical path.

Here one program holds a whole row in registers and finds the k-th largest by a radix select:
the scores become integer keys with the same order (the fp32 bits, the lower 31 flipped where
the sign is set), and four passes over the row, one byte of the key each (most significant
first), count the candidates' bytes (``tl.histogram``) and fix the byte of the k-th largest.
Then the entries above that key, and the first of the entries equal to it as many as the
count leaves, are written in index order (``tl.cumsum`` gives each its slot). The kept set is the one
``torch.topk`` keeps (up to ties at the k-th value: the lowest indices win here); the order is
the index order, not the score order, which the sparse kernels' gathers prefer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2, use_triton

__all__ = ["MAX_ROW", "topk_select", "topk_select_kernel", "topk_select_ref"]

#: the longest row one program holds (OPT-175B's 49,152 neurons fit; longer rows: torch.topk)
MAX_ROW = 65536


@triton.jit
def topk_select_kernel(
    s_ptr,  # [R, N] scores (fp32, fp16 or bf16)
    val_ptr,  # [R, K] fp32: the kept scores
    idx_ptr,  # [R, K] int64 (or int32): their positions in the row, ascending
    N,
    K,
    stride_s,
    stride_v,
    stride_i,
    BLOCK: tl.constexpr,  # next_pow2(N)
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < N
    x = tl.load(s_ptr + row.to(tl.int64) * stride_s + offs, mask=valid, other=0.0).to(tl.float32)
    b = x.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed integers in the floats' order
    bins = tl.arange(0, 256)
    need = K  # how many of the candidates (keys equal to `thr` on the bytes fixed so far) to keep
    thr = tl.zeros((), tl.int32)
    for j in tl.static_range(4):
        shift = 24 - 8 * j
        byte = (key >> shift) & 0xFF
        if j == 0:
            byte = byte ^ 0x80  # the sign byte: unsigned order
            cand = valid
        else:
            cand = valid & ((key >> (shift + 8)) == (thr >> (shift + 8)))
        n_cand = tl.sum(cand.to(tl.int32), axis=0)
        hist = tl.histogram(tl.where(cand, byte, 0), 256)  # non-candidates land in bin 0 ...
        hist -= tl.where(bins == 0, BLOCK - n_cand, 0)  # ... and leave it again
        at_least = n_cand - tl.cumsum(hist, axis=0) + hist  # candidates with byte >= bin
        top = tl.max(tl.where(at_least >= need, bins, -1), axis=0)  # the k-th largest's byte
        need -= tl.sum(tl.where(bins == top, at_least - hist, 0), axis=0)  # minus those above it
        if j == 0:
            top = top ^ 0x80
        thr = thr | (top << shift)
    tie = valid & (key == thr)
    keep = (valid & (key > thr)) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + row.to(tl.int64) * stride_i + slot,
             offs.to(idx_ptr.dtype.element_ty), mask=keep)  # fmt: skip
    tl.store(val_ptr + row.to(tl.int64) * stride_v + slot, x, mask=keep)


def topk_select_ref(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same kept sets by ``torch.topk``, each row's entries in index order: (fp32 values,
    int64 indices), [..., k].

    >>> topk_select_ref(torch.tensor([0.5, -1.0, 2.0, 0.1]), 2)
    (tensor([0.5000, 2.0000]), tensor([0, 2]))
    """
    idx = torch.topk(s.float(), k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return s.float().gather(-1, idx), idx


def topk_select(s: torch.Tensor, k: int, values: torch.Tensor | None = None,
                indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``k`` largest entries of each row of ``s`` ([n] or [rows, n]): (fp32 values, indices),
    each [..., k], written into ``values`` / ``indices`` when given (fp32; int64 or int32) and in
    index order. One launch, one program per row (:func:`topk_select_kernel`); on the CPU
    without the interpreter, and for rows longer than :data:`MAX_ROW`, ``torch.topk``.

    >>> s = torch.randn(3, 20480)
    >>> v, i = topk_select(s, 3072)
    >>> bool((i == topk_select_ref(s, 3072)[1]).all()), torch.equal(s.gather(1, i), v)
    (True, True)
    """
    if not isinstance(s, torch.Tensor) or s.dim() not in (1, 2) or not s.is_floating_point():
        raise ValueError("scores must be a float tensor of shape [n] or [rows, n].")
    n = s.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"k = {k} must lie in [1, {n}] (the row's length).")
    check_device(s.device, values=values, indices=indices)
    shape = (*s.shape[:-1], k)
    if values is None:
        values = torch.empty(shape, dtype=torch.float32, device=s.device)
    if indices is None:
        indices = torch.empty(shape, dtype=torch.long, device=s.device)
    for name, t, dtypes in (("values", values, (torch.float32,)),
                            ("indices", indices, (torch.int64, torch.int32))):  # fmt: skip
        if tuple(t.shape) != shape or t.dtype not in dtypes or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a contiguous-row {dtypes[0]} tensor of shape {shape}; "
                             f"got {tuple(t.shape)} {t.dtype}.")  # fmt: skip
    if not use_triton(s.device) or n > MAX_ROW:
        v, i = topk_select_ref(s, k)
        values.copy_(v)
        indices.copy_(i)
        return values, indices
    s2, v2, i2 = (t.reshape(-1, t.shape[-1]) for t in (s, values, indices))
    if s2.stride(-1) != 1:
        s2 = s2.contiguous()
    block = max(16, next_pow2(n))
    topk_select_kernel[(s2.shape[0],)](
        s2, v2, i2, n, k, s2.stride(0), v2.stride(0), i2.stride(0), BLOCK=block,
        num_warps=max(4, min(32, block // 2048)),
    )  # fmt: skip
    return values, indices
