"""Top-k selection in one launch: DejaVu's kept neurons from its predictors' scores.

DejaVu's lookahead predictors (§4.3) score every neuron of the next layer, and the decoder keeps
the ``k`` best. ``torch.topk`` does this in one single-block launch while a row is short for the
number of rows and in a multi-block select of about a dozen launches beyond (20,000 entries for
up to 20 rows: OPT-13B's 20,480 neurons and up); either costs tens of microseconds per layer at
OPT widths (``kernels/bench_topk.py``), on the decode step's critical path.

Here one program holds a whole row's keys in registers (integers with the scores' order: the
fp32 bits, the lower 31 flipped where the sign is set, offset to unsigned) and finds the k-th
largest by bisection: 32 counts, one per bit from the top, each keeping the bit when at least k
keys reach the prefix with it set. No atomics: a byte-wide radix select with ``tl.histogram``
(an earlier form of this kernel) piled the row's few distinct sign-and-exponent bytes onto one
or two bins of shared-memory atomics, 113 µs a call at 20,480 entries on an H100; reading the
row from L1 at each of the 32 counts instead of holding it took 54 µs. Then a pass over the row
in chunks writes the entries above that key, and the first of the entries equal to it as many
as the count leaves, in index order (one ``tl.cumsum`` per chunk of both counts gives each its
slot). The kept set is the one
``torch.topk`` keeps (up to ties at the k-th value: the lowest indices win here); the order is
the index order, not the score order, which the sparse kernels' gathers prefer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2, use_triton

__all__ = ["MAX_ROW", "topk_select", "topk_select_kernel", "topk_select_ref"]

#: the longest row one program holds in registers (16 warps, 64 keys a thread: OPT-30B's 28,672
#: neurons fit; longer rows spill, and go to torch.topk)
MAX_ROW = 32768
CHUNK = 4096  # entries per step: a chunk's scan packs two counts below 2^16 into one int32


@triton.jit
def _keys(s_row, offs, valid):
    """Unsigned integer keys in the scores' order (the padding: 0, below every count's prefix)."""
    b = tl.load(s_row + offs, mask=valid, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    key = (b ^ ((b >> 31) & 0x7FFFFFFF) ^ (-2147483648)).to(tl.uint32, bitcast=True)
    return tl.where(valid, key, 0)


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
    BLOCK: tl.constexpr,  # next_pow2(N): the whole row's keys, held in registers
    CHUNK: tl.constexpr,  # entries per step of the writing pass
):
    row = tl.program_id(0)
    s_row = s_ptr + row.to(tl.int64) * stride_s
    every = tl.arange(0, BLOCK)
    key = _keys(s_row, every, every < N)
    # the k-th largest key, one bit at a time from the top: keep a bit when at least K keys
    # reach the prefix with it set (32 counts over the registers, no atomics)
    thr = tl.zeros((), tl.uint32)
    for j in tl.static_range(32):
        cand = thr | tl.full((), 1 << (31 - j), tl.uint32)
        thr = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= K, cand, thr)
    need = K - tl.sum((key > thr).to(tl.int32), axis=0)  # how many entries equal to thr to keep
    offs0 = tl.arange(0, CHUNK)
    # the kept entries in index order: one scan per chunk gives both prefix counts (entries
    # above thr in the high half, ties in the low), plus the chunks before
    n_above = tl.zeros((), tl.int32)
    n_ties = tl.zeros((), tl.int32)
    for c0 in range(0, N, CHUNK):  # the row again (L1/L2), a chunk at a time
        offs = c0 + offs0
        valid = offs < N
        ck = _keys(s_row, offs, valid)
        above = valid & (ck > thr)
        tie = valid & (ck == thr)
        both = tl.cumsum(above.to(tl.int32) * 65536 + tie.to(tl.int32), axis=0)
        t = n_ties + (both & 0xFFFF)
        keep = above | (tie & (t <= need))
        slot = n_above + (both >> 16) + tl.minimum(t, need) - 1
        tl.store(idx_ptr + row.to(tl.int64) * stride_i + slot,
                 offs.to(idx_ptr.dtype.element_ty), mask=keep)  # fmt: skip
        x = tl.load(s_row + offs, mask=keep, other=0.0).to(tl.float32)
        tl.store(val_ptr + row.to(tl.int64) * stride_v + slot, x, mask=keep)
        n_above += tl.sum(above.to(tl.int32), axis=0)
        n_ties += tl.sum(tie.to(tl.int32), axis=0)


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
        CHUNK=min(CHUNK, block), num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return values, indices
