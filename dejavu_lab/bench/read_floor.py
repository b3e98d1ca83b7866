"""The read floor of a kernel's bytes: one streaming read of as many bytes, nothing else.

A GEMV that moves ``n`` bytes cannot beat a kernel that only reads ``n`` bytes, launched and
timed the same way. The copy ceiling (:func:`~dejavu_lab.bench.timing.copy_ceiling`) is
measured on 2 GiB; a decode-step GEMV moves 3-60 MB, where a launch's ramp and tail are a
visible share of its time. :func:`stream_read` reads a flat int32 buffer with 128-bit loads,
32 KiB per program, and writes one word per program (so the loads cannot be dropped): timed
beside a GEMV on a buffer of the GEMV's own bytes, it says what fraction of the copy ceiling
that many bytes can reach at all.

A threshold GEMV reads only its kept rows, scattered over the matrix: :func:`kept_rows_read`
reads the code rows of an int4 matrix whose activation passes the threshold, the same rows the
GEMV reads, each program a 64-row by 256-byte block, every kept row's load in flight at once,
and nothing else. Its time is the floor of the threshold GEMV at that kept set, and it is not
``kept`` times the plain read: a launch's ramp and tail, and the latency of the first loads,
stay whatever the kept fraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "kept_rows_kernel", "kept_rows_read", "read_kernel", "stream_read"]

BLOCK = 8192  # int32 words (32 KiB) per program


@triton.jit
def read_kernel(src_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """Program ``p`` xor-reduces words ``p BLOCK`` to ``(p + 1) BLOCK`` into ``out[p]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < N, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(v, axis=0))


def stream_read(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Read every word of the flat int32 ``src``; ``out`` int32 with at least
    ``ceil(src.numel() / BLOCK)`` entries receives one xor per program.

    >>> src = torch.arange(10, dtype=torch.int32)  # CPU: under TRITON_INTERPRET=1
    >>> stream_read(src, torch.empty(1, dtype=torch.int32)).item() == 0 ^ 1 ^ 2 ^ 3 ^ 4 ^ 5 ^ 6 ^ 7 ^ 8 ^ 9
    True
    """
    if src.dtype != torch.int32 or src.dim() != 1:
        raise ValueError("stream_read reads a flat int32 tensor (view the buffer as int32).")
    grid = triton.cdiv(src.numel(), BLOCK)
    if out.numel() < grid:
        raise ValueError(f"out holds {out.numel()} words; the read needs {grid}.")
    read_kernel[(grid,)](src, out, src.numel(), BLOCK=BLOCK, num_warps=8)
    return out[:grid]


@triton.jit
def kept_rows_kernel(src_ptr, x_ptr, out_ptr, thr, STRIDE: tl.constexpr, ROWS: tl.constexpr,
                     NW: tl.constexpr):  # fmt: skip
    """Program ``(d, r)``: the words ``d NW`` to ``(d + 1) NW`` of rows ``r ROWS`` to
    ``(r + 1) ROWS`` of ``src`` [K, STRIDE] whose ``|x|`` exceeds ``thr``, xor-reduced into
    one word of ``out``."""
    offs_r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    keep = tl.abs(tl.load(x_ptr + offs_r).to(tl.float32)) > thr
    offs_w = tl.program_id(0) * NW + tl.arange(0, NW)
    v = tl.load(src_ptr + offs_r[:, None].to(tl.int64) * STRIDE + offs_w[None, :],
                mask=keep[:, None], other=0, eviction_policy="evict_first")  # fmt: skip
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
             tl.xor_sum(tl.xor_sum(v, axis=1), axis=0))  # fmt: skip


def kept_rows_read(src: torch.Tensor, x: torch.Tensor, thr: float, out: torch.Tensor, *,
                   rows: int | None = None, words: int | None = None) -> torch.Tensor:  # fmt: skip
    """Read the rows of the int32 matrix ``src`` [K, W] (an int4 weight's code words) where
    ``|x|`` ([K] or [1, K]) exceeds ``thr``; ``out`` int32 with at least
    ``(K / rows) (W / words)`` entries receives one xor per program. ``rows`` must divide K and
    ``words`` W (powers of two; by default 64, or the largest power of two dividing a smaller
    shape).

    >>> src = torch.arange(8 * 4, dtype=torch.int32).view(8, 4)  # CPU: TRITON_INTERPRET=1
    >>> x = torch.tensor([2.0, 0, 0, 0, 0, 0, 0, 3.0])  # rows 0 and 7 kept
    >>> got = kept_rows_read(src, x, 1.0, torch.empty(1, dtype=torch.int32), rows=8, words=4)
    >>> got.item() == 0 ^ 1 ^ 2 ^ 3 ^ 28 ^ 29 ^ 30 ^ 31
    True
    """
    if src.dtype != torch.int32 or src.dim() != 2:
        raise ValueError("kept_rows_read reads an int32 matrix [K, W] (an int4 weight's codes).")
    k, w = src.shape
    rows = rows or min(64, k & -k)
    words = words or min(64, w & -w)
    if x.numel() != k:
        raise ValueError(f"x has {x.numel()} entries; the matrix has {k} rows.")
    if k % rows or w % words or rows & (rows - 1) or words & (words - 1):
        raise ValueError(
            f"rows={rows} and words={words} must be powers of two dividing [{k}, {w}]."
        )
    grid = (w // words, k // rows)
    if out.numel() < grid[0] * grid[1]:
        raise ValueError(f"out holds {out.numel()} words; the read needs {grid[0] * grid[1]}.")
    kept_rows_kernel[grid](src, x.reshape(-1), out, float(thr), STRIDE=src.stride(0), ROWS=rows,
                           NW=words, num_warps=4)  # fmt: skip
    return out[: grid[0] * grid[1]]
