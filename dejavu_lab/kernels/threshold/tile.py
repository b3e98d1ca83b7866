"""The batch-1 threshold GEMV as one masked tile per program, summed with fp32 atomics.

TEAL's grid (Liu et al. 2024, ``liu2024teal``): program (j, i) owns output columns
``[j BLOCK_D, (j + 1) BLOCK_D)`` and input rows ``[i BLOCK_R, (i + 1) BLOCK_R)`` of
``w_t = W.T``. It loads its slice of x (and of the thresholds), and then its weight tile with
the rows of dropped entries masked off: a masked row costs no memory traffic. There is no
loop and no row list, only thousands of short programs. That keeps far more loads in flight
than :mod:`~dejavu_lab.kernels.threshold.gemv`'s compacting programs, which must scan their chunk of x before
their first weight byte moves. The programs add their fp32 partial column sums into a
per-device workspace with relaxed atomics. A second, small launch converts the sums to the
output dtype (plus the bias) and zeroes the workspace for the next call.

Measured on an H200 (CUDA-graph replay, fp16, weights rotated through 4x the L2;
``results/threshold_gemv.json``), 11008->4096 at 50 / 20 / 10% kept: 15.0 / 12.9 / 12.4 µs,
against TEAL's own kernel at 17.7 / 15.4 / 14.8 (fp16 atomics into a zeroed output) and the
compacting kernel at 24.0 / 14.7 / 11.8. At the engine's sites of Llama-2-13B and Llama-3-8B
the best tiles run at 0.77-1.00 of the ideal at 50-60% kept
(``kernels/tuned/tuning_threshold_gemv_engine.json``). Few rows kept favour the compacting kernel
(10% at 13824->5120: 17.4 against 13.7 µs), where thousands of nearly empty programs cost more
than one scan: :func:`~dejavu_lab.kernels.threshold.gemv.default_config` picks it for a ``kept`` hint of 0.2 or
less.

A union batch (2-32 tokens) has the same grid in :func:`threshold_tile_batch_kernel`: a row is
read when any token keeps it, each token's entries are masked by its own rule, and the tile's
product runs on tensor cores. It runs when asked (``config={"mode": "tile"}``, or a tuned
table entry for the shape that picks it) until a GPU run shows it beating the compacting kernel,
which union batches run by default
(``kernels/bench_threshold_gemv.py`` times both).

The threshold may be one number (TEAL's rule: a Python float, passed as a kernel argument,
which saves the threshold loads) or one per input column (WINA, a float32 tensor). The sums
are order-dependent in fp32 (one rounding to fp16/bf16 at the end), so ``deterministic=True``
callers of :func:`~dejavu_lab.kernels.threshold_gemv` get the compacting kernel instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._common import batch_block, dot_acc, upcast_dot
from .._neurons import act
from .._reduce import take_zero
from ..pdl import await_inputs, pdl_args

__all__ = ["TILE_B1", "add_tile", "fits", "launch", "threshold_finalize_kernel",
           "threshold_tile_batch_kernel", "threshold_tile_kernel"]  # fmt: skip

INT32_MAX = 2**31 - 1
# the batch-1 config: within a few percent of the best tile at every engine site of
# Llama-2-13B and Llama-3-8B in the H200 sweep (``kernels/tuned/tuning_threshold_gemv_engine.json``)
TILE_B1 = {"mode": "tile", "BLOCK_R": 128, "BLOCK_D": 64, "num_warps": 2}


@triton.jit
def threshold_tile_kernel(
    x_ptr,  # [K] the input token
    w_ptr,  # [K, D] W transposed, row-major
    thr_ptr,  # [K] fp32 thresholds (THR_SCALAR: unused)
    thr_value,  # the one threshold (THR_SCALAR)
    ws_ptr,  # [D] fp32 sums, zero between launches
    xb_ptr,  # [K] (GATED_X: [2K]) the bias of x's sums (ACT_X and HAS_XBIAS)
    K,
    D,
    stride_w,
    THR_SCALAR: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: no column mask
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACT_X: tl.constexpr = "",  # x is fp32 sums [K] (GATED_X: [gate | up], 2K): act(x + xb) first
    GATED_X: tl.constexpr = False,
    HAS_XBIAS: tl.constexpr = False,
    KEEP_GATE: tl.constexpr = False,  # ACT_X: row r kept iff |act(gate_r)| > thr_r (CATS)
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < K
    gate_keep = mask_r
    if ACT_X == "":
        x = tl.load(x_ptr + offs_r, mask=mask_r, other=0.0, eviction_policy="evict_last")
    else:  # the previous GEMV's sums, finished here: act(gate) * up, rounded as stored
        a = tl.load(x_ptr + offs_r, mask=mask_r, other=0.0)
        if HAS_XBIAS:
            a += tl.load(xb_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        a = act(a, ACT_X)
        if KEEP_GATE:
            t = tl.load(thr_ptr + offs_r, mask=mask_r, other=float("inf"))
            gate_keep = (tl.abs(a) > t) & mask_r
        if GATED_X:
            u = tl.load(x_ptr + K + offs_r, mask=mask_r, other=0.0)
            if HAS_XBIAS:
                u += tl.load(xb_ptr + K + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            a = a * u
        x = a.to(w_ptr.dtype.element_ty)
    # compare in x's own dtype and widen only in the product: the H200 ran this form at
    # 15.7 µs against 20.1 for widening x first (11008->4096, 50% kept, same tiles)
    if KEEP_GATE:  # CATS: the gate decided, and h is exactly zero elsewhere
        keep = gate_keep
    elif THR_SCALAR:  # the rows past K stay masked at a negative threshold (keep-all)
        keep = (tl.abs(x) > thr_value) & mask_r
    else:
        t = tl.load(thr_ptr + offs_r, mask=mask_r, other=float("inf"), eviction_policy="evict_last")
        keep = tl.abs(x) > t
    add_tile(w_ptr + (offs_r[:, None] * stride_w + offs_d[None, :]), keep, x, ws_ptr, offs_d, D,
             EVEN_D)  # fmt: skip


@triton.jit
def add_tile(w_ptrs, keep, x, ws_ptr, offs_d, D, EVEN_D: tl.constexpr):
    """``ws[offs_d] += sum over the kept rows of x[r] W[r, offs_d]``: the tile's rows masked by
    ``keep`` (a dropped row costs no memory traffic), fp32 products summed over the rows, one
    relaxed atomic add per column (``EVEN_D``: the columns need no mask)."""
    if EVEN_D:
        w = tl.load(w_ptrs, mask=keep[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=keep[:, None] & (offs_d < D)[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None], axis=0)
    tl.atomic_add(ws_ptr + offs_d, acc, mask=offs_d < D, sem="relaxed")


@triton.jit
def threshold_tile_batch_kernel(
    x_ptr,  # [B, K] a union batch of tokens
    w_ptr,  # [K, D] W transposed, row-major
    thr_ptr,  # [K] fp32 thresholds (THR_SCALAR: unused)
    thr_value,  # the one threshold (THR_SCALAR)
    ws_ptr,  # [B, D] fp32 sums, zero between launches
    B,
    K,
    D,
    stride_xb,
    stride_w,
    THR_SCALAR: tl.constexpr,
    BLOCK_B: tl.constexpr,  # >= 16: the token tile of tl.dot
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
):
    """The union-batch form: a row is read when any token keeps it; each token's entries are
    masked by its own rule; the tile's product runs on tensor cores."""
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_b = tl.arange(0, BLOCK_B)
    mask_r = offs_r < K
    mask_b = offs_b < B
    x = tl.load(x_ptr + offs_b[:, None] * stride_xb + offs_r[None, :],
                mask=mask_b[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
    if THR_SCALAR:
        keep = (tl.abs(x) > thr_value) & mask_r[None, :] & mask_b[:, None]
    else:
        t = tl.load(thr_ptr + offs_r, mask=mask_r, other=float("inf"))
        keep = tl.abs(x) > t[None, :]
    union = tl.max(keep.to(tl.int32), axis=0) > 0
    w = tl.load(w_ptr + (offs_r[:, None] * stride_w + offs_d[None, :]),
                mask=union[:, None] & (offs_d < D)[None, :], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    xm = tl.where(keep, x, tl.zeros_like(x))
    acc = dot_acc(xm, w, tl.zeros((BLOCK_B, BLOCK_D), tl.float32), UPCAST)
    tl.atomic_add(ws_ptr + offs_b[:, None] * D + offs_d[None, :], acc,
                  mask=mask_b[:, None] & (offs_d < D)[None, :], sem="relaxed")  # fmt: skip


@triton.jit
def threshold_finalize_kernel(ws_ptr, b_ptr, out_ptr, N, stride_ob, HAS_BIAS: tl.constexpr,
                              ACT: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Row ``program_id(1)``: ``out = act(ws + bias)`` (GATED: ``act(gate) * up`` over a ws row
    [gate | up], N = half of its columns) in the output dtype, and ``ws = 0`` for the next
    launch. ws rows are contiguous ([B, N] or [B, 2N]); out rows ``stride_ob`` apart."""
    if PDL:
        await_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1)
    mask = offs < N
    ws_row = ws_ptr + row * (2 * N if GATED else N)
    y = take_zero(ws_row + offs, mask)  # read, and leave zeros for the next launch
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = act(y, ACT)
    if GATED:
        u = take_zero(ws_row + N + offs, mask)
        if HAS_BIAS:
            u += tl.load(b_ptr + N + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * u
    tl.store(out_ptr + row * stride_ob + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def fits(w_t: torch.Tensor) -> bool:
    """Whether the tile kernel's int32 offsets address all of ``w_t`` (rows x row stride).

    >>> fits(torch.empty(11008, 4096, device="meta")), fits(torch.empty(65536, 65536, device="meta"))
    (True, False)
    """
    return w_t.shape[0] * w_t.stride(0) <= INT32_MAX


def launch(xb: torch.Tensor, w_t: torch.Tensor, thr, bias, out: torch.Tensor | None, cfg: dict,
           *, activation: str = "none", gated: bool = False, kind: str = "sums",
           x_act: str = "", x_gated: bool = False, x_bias=None,
           keep_gate: bool = False) -> torch.Tensor:  # fmt: skip
    """Run the tile kernel and its finalize on checked inputs: xb [B, d_in] (rows contiguous),
    out [B, d_out] (``gated``: [B, d_out / 2], ``act(gate) * up`` of the product's halves).

    ``thr``: a float (one threshold) or an fp32 [d_in] tensor; ``cfg``: ``BLOCK_R``, ``BLOCK_D``,
    ``num_warps`` (and ``num_stages`` for a union batch; the finalize's block: ``fin_block``,
    default 1024); ``activation``: applied in the finalize (one of
    :data:`~dejavu_lab.kernels.mlp.fused.FUSED_ACTIVATIONS`). ``out=None`` skips the finalize: the fp32 sums are
    left in the workspace, whose [B * d_out] view is returned, for an epilogue to take and
    zero (:mod:`~dejavu_lab.kernels.rope.epilogue`); else returns out. ``kind`` names the workspace (two sums may
    be alive at once). ``x_act`` (batch 1): xb is a previous launch's fp32 sums, finished here
    as ``x_act(xb + x_bias)`` (``x_gated``: ``act(gate) * up`` of its halves [1, 2 d_in]).

    >>> from dejavu_lab.kernels import threshold_gemv_ref
    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(1, 32, dtype=torch.float16)
    >>> w_t = torch.randn(32, 16, dtype=torch.float16) / 4
    >>> out = torch.empty(1, 16, dtype=torch.float16)
    >>> _ = launch(x, w_t, 0.5, None, out, TILE_B1)  # CPU: the kernels under TRITON_INTERPRET=1
    >>> torch.allclose(out, threshold_gemv_ref(x, w_t, 0.5), atol=1e-2)
    True
    """
    batch = xb.shape[0]
    d_in, d_out = w_t.shape  # xb is [B, d_in], or [1, 2 d_in] of gated sums (x_gated)
    block_r, block_d = cfg["BLOCK_R"], cfg["BLOCK_D"]
    ws = _workspace.buffer(xb.device, kind, batch * d_out, torch.float32)
    scalar = not isinstance(thr, torch.Tensor)
    thr_ptr, thr_value = (ws, float(thr)) if scalar else (thr, 0.0)
    grid = (triton.cdiv(d_out, block_d), triton.cdiv(d_in, block_r))
    if batch == 1:
        threshold_tile_kernel[grid](
            xb, w_t, thr_ptr, thr_value, ws, x_bias if x_bias is not None else ws, d_in, d_out,
            w_t.stride(0), THR_SCALAR=scalar, EVEN_D=d_out % block_d == 0, BLOCK_R=block_r,
            BLOCK_D=block_d, ACT_X=x_act, GATED_X=x_gated, HAS_XBIAS=x_bias is not None,
            KEEP_GATE=keep_gate, num_warps=cfg["num_warps"], num_stages=1, **pdl_args(xb.device),
        )  # fmt: skip
    else:
        if block_r < 16 or block_d < 16:
            raise ValueError(
                "config BLOCK_R and BLOCK_D must be >= 16 for a union batch (tensor-core tiles)."
            )
        threshold_tile_batch_kernel[grid](
            xb, w_t, thr_ptr, thr_value, ws, batch, d_in, d_out, xb.stride(0), w_t.stride(0),
            THR_SCALAR=scalar, BLOCK_B=batch_block(batch), BLOCK_R=block_r, BLOCK_D=block_d,
            UPCAST=upcast_dot(xb.dtype), num_warps=cfg["num_warps"],
            num_stages=cfg.get("num_stages", 1),
        )  # fmt: skip
    if out is None:
        return ws[: batch * d_out]
    fin = int(cfg.get("fin_block", 1024))
    n = d_out // 2 if gated else d_out
    threshold_finalize_kernel[(triton.cdiv(n, fin), batch)](
        ws, bias if bias is not None else ws, out, n, out.stride(0), HAS_BIAS=bias is not None,
        ACT=activation, GATED=gated, BLOCK=fin, num_warps=4, **pdl_args(ws.device),
    )  # fmt: skip
    return out
