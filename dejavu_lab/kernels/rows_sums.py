"""One token's dense GEMV over a row-major weight, as split-K tiles summed with fp32 atomics.

``y = W x`` for W [n, d] (each output's weights one contiguous row, as
:func:`~.cats_mlp.cats_mlp` stores the gate): program (j, i) loads the tile of rows
``[j BLOCK_N, (j + 1) BLOCK_N)`` and columns ``[i BLOCK_K, (i + 1) BLOCK_K)`` with the slice of
x it multiplies, and adds its ``BLOCK_N`` partial sums into a per-device fp32 workspace with
relaxed atomics. No loop: thousands of short programs, each one tile, keep more loads in
flight than a GEMV that loops over d. The sums are left in the workspace for the next launch
to read and zero (:func:`~.cats_up.cats_up` with ``gate_sums=True``), so there is no
finalize. The sums are order-dependent in fp32 (the atomics' order): not bitwise repeatable.

This is the threshold tile kernel's grid (:mod:`.threshold_tile`) with every row kept and
the weight's other orientation. On an H200 (CUDA-graph replay, random fp16 weights, batch 1)
the tile grid took CATS's dense gate from cuBLAS's 37.1 to 33.3 µs at Llama-2-13B's shape
(13824 x 5120) and from 30.5 to 28.2 at Llama-3-8B's (14336 x 4096), about 4.2 TB/s against
3.8 (``kernels/bench_fused_mlp.py --gate``, ``results/cats_gate.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _workspace
from .pdl import await_inputs, pdl_args

__all__ = ["ROWS_B1", "rows_sums", "rows_sums_kernel"]

ROWS_B1 = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 2}  # see kernels/bench_fused_mlp.py --gate


@triton.jit
def rows_sums_kernel(
    x_ptr,  # [K] the token
    w_ptr,  # [N, K] row-major (rows stride_w apart)
    ws_ptr,  # [N] fp32 sums, zero between launches
    N,
    K,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    await_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, eviction_policy="evict_last")
    w = tl.load(w_ptr + (offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]),
                mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.atomic_add(ws_ptr + offs_n, acc, mask=mask_n, sem="relaxed")


def rows_sums(x: torch.Tensor, w: torch.Tensor, *, kind: str = "rows_sums",
              config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``W x`` as fp32 sums [n] left in the per-device workspace ``kind`` (x: [d] or [1, d];
    w: [n, d] with unit column stride, x's dtype; a GPU or the CPU under the interpreter).

    The caller's next launch must read the sums and leave zeros, or the next call into that
    workspace adds onto them. No input checks (the engine calls it inside a CUDA graph);
    ``config`` overrides :data:`ROWS_B1`.

    >>> x = torch.ones(1, 8, dtype=torch.float16)
    >>> w = torch.arange(24, dtype=torch.float16).view(3, 8)
    >>> ws = rows_sums(x, w, kind="doctest")  # CPU: under TRITON_INTERPRET=1
    >>> ws.tolist()  # 0+...+7, 8+...+15, 16+...+23
    [28.0, 92.0, 156.0]
    >>> _ = ws.zero_()  # what the reading kernel does
    """
    n, d = w.shape
    cfg = {**ROWS_B1, **(config or {})}
    ws = _workspace.buffer(x.device, kind, n, torch.float32)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(d, cfg["BLOCK_K"]))
    rows_sums_kernel[grid](
        x, w, ws, n, d, w.stride(0), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], **pdl_args(x.device),
    )  # fmt: skip
    return ws[:n]
