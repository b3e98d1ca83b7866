"""One token's dense GEMV over a row-major weight, as split-K tiles summed with fp32 atomics.

``y = W x`` for W [n, d] (each output's weights one contiguous row, as
:func:`~dejavu_lab.kernels.cats.mlp.cats_mlp` stores the gate): program (j, i) loads the tile of rows
``[j BLOCK_N, (j + 1) BLOCK_N)`` and columns ``[i BLOCK_K, (i + 1) BLOCK_K)`` with the slice of
x it multiplies, and adds its ``BLOCK_N`` partial sums into a per-device fp32 workspace with
relaxed atomics. No loop: thousands of short programs, each one tile, keep more loads in
flight than a GEMV that loops over d. The sums are left in the workspace for the next launch
to read and zero (:func:`~dejavu_lab.kernels.cats.up.cats_up` with ``gate_sums=True``, or the residual
epilogue after the down GEMV that finished them: :func:`~dejavu_lab.kernels.cats.mlp.cats_sums`), so there is no
finalize. The sums are order-dependent in fp32 (the atomics' order): not bitwise repeatable.

This is the threshold tile kernel's grid (:mod:`~dejavu_lab.kernels.threshold.tile`) with every row kept and
the weight's other orientation. On an H200 (CUDA-graph replay, random fp16 weights rotated past
the L2, batch 1; ``kernels/bench_cats_gate.py``, ``results/cats_gate.json``) it streamed CATS's
dense gate at about the copy ceiling, 32.9 / 27.7 / 21.6 µs at Llama-2-13B's, Llama-3-8B's and
Llama-2-7B's shapes (13824 x 5120, 14336 x 4096, 11008 x 4096) against cuBLAS's 35.0 / 30.4 /
26.0 µs (fp32 output; 0.95 / 0.91 / 0.82 of the ceiling), and took the whole CATS MLP at 50%
kept from 75.8 / 66.9 / 57.7 to 73.4 / 62.2 / 51.8 µs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._neurons import act
from ..pdl import await_inputs, pdl_args

__all__ = ["ROWS_B1", "rows_sums", "rows_sums_kernel"]

ROWS_B1 = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 2}  # kernels/bench_cats_gate.py


@triton.jit
def rows_sums_kernel(
    x_ptr,  # [K] the token
    w_ptr,  # [N, K] row-major (rows stride_w apart)
    ws_ptr,  # [N] fp32 sums, zero between launches
    g_ptr,  # [N] fp32 gate sums (KEEP_GATE): row j is read iff |act(g_j + gb_j)| > thr_j
    gb_ptr,  # [N] the gate's bias (KEEP_GATE and HAS_GBIAS)
    thr_ptr,  # [N] fp32 thresholds (KEEP_GATE)
    N,
    K,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KEEP_GATE: tl.constexpr = False,
    ACT: tl.constexpr = "silu",
    HAS_GBIAS: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    rows = mask_n
    if KEEP_GATE:  # CATS's rule on the gate's sums (read only: the down GEMV reads them too)
        g = tl.load(g_ptr + offs_n, mask=mask_n, other=0.0)
        if HAS_GBIAS:
            g += tl.load(gb_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        t = tl.load(thr_ptr + offs_n, mask=mask_n, other=float("inf"))
        rows = (tl.abs(act(g, ACT)) > t) & mask_n
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0, eviction_policy="evict_last")
    w = tl.load(w_ptr + (offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]),
                mask=rows[:, None] & mask_k[None, :], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.atomic_add(ws_ptr + offs_n, acc, mask=rows, sem="relaxed")


def rows_sums(x: torch.Tensor, w: torch.Tensor, *, kind: str = "rows_sums",
              out: torch.Tensor | None = None, keep: tuple | None = None,
              config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``W x`` as fp32 sums [n] left in the per-device workspace ``kind`` (or added into
    ``out``, fp32 [n] and zero before) — x: [d] or [1, d]; w: [n, d] with unit column stride,
    x's dtype; a GPU or the CPU under the interpreter.

    ``keep=(gate_sums, thr, activation, gate_bias)``: CATS's rule — row j is read (and its sum
    added) only where ``|activation(gate_sums[j] + gate_bias[j])| > thr[j]`` (gate_bias may be
    None); the others' loads are masked off, so a dropped row costs no memory traffic.

    The caller's next launch must read the sums and leave zeros, or the next call into that
    workspace adds onto them. No input checks (the engine calls it inside a CUDA graph);
    ``config`` overrides :data:`ROWS_B1`.

    >>> x = torch.ones(1, 8, dtype=torch.float16)
    >>> w = torch.arange(24, dtype=torch.float16).view(3, 8)
    >>> ws = rows_sums(x, w, kind="doctest")  # CPU: under TRITON_INTERPRET=1
    >>> ws.tolist()  # 0+...+7, 8+...+15, 16+...+23
    [28.0, 92.0, 156.0]
    >>> up = torch.zeros(3)
    >>> _ = rows_sums(x, w, out=up, keep=(torch.tensor([-9.0, 1.0, 3.0]), torch.ones(3), "relu", None))
    >>> up.tolist()  # relu(-9) and relu(1) are not above 1: rows 0 and 1 are not read
    [0.0, 0.0, 156.0]
    >>> _ = ws.zero_()  # what the reading kernel does
    """
    n, d = w.shape
    cfg = {**ROWS_B1, **(config or {})}
    ws = out if out is not None else _workspace.buffer(x.device, kind, n, torch.float32)[:n]
    g, thr, act, gb = keep if keep is not None else (ws, ws, "silu", None)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(d, cfg["BLOCK_K"]))
    rows_sums_kernel[grid](
        x, w, ws, g, gb if gb is not None else ws, thr, n, d, w.stride(0), BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], KEEP_GATE=keep is not None, ACT=act, HAS_GBIAS=gb is not None,
        num_warps=cfg["num_warps"], **pdl_args(x.device),
    )  # fmt: skip
    return ws
