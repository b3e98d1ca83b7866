"""The read floor of a kernel's bytes: one streaming read of as many bytes, nothing else.

A GEMV that moves ``n`` bytes cannot beat a kernel that only reads ``n`` bytes, launched and
timed the same way. The copy ceiling (:func:`~dejavu_lab.bench.timing.copy_ceiling`) is
measured on 2 GiB; a decode-step GEMV moves 3-60 MB, where a launch's ramp and tail are a
visible share of its time. :func:`stream_read` reads a flat int32 buffer with 128-bit loads,
32 KiB per program, and writes one word per program (so the loads cannot be dropped): timed
beside a GEMV on a buffer of the GEMV's own bytes, it says what fraction of the copy ceiling
that many bytes can reach at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "read_kernel", "stream_read"]

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
