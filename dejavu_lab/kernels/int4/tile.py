"""The batch-1 int4 GEMV on TEAL's grid: one masked tile per program, summed with fp32 atomics.

:mod:`.kernel` walks each program's share of the rows in a loop; this kernel has no loop, as
:mod:`~dejavu_lab.kernels.threshold.tile` for fp16: program ``(j, i)`` owns output columns
``[j BLOCK_D, (j + 1) BLOCK_D)`` and the ``BLOCK_R`` input rows ``i`` (inside one group, so one
scale and one min per output), loads its slice of x, masks the rows whose entries are dropped
off the code load (TEAL / WINA; dense keeps every row), and adds

    ``s[g, o] sum_r x[r] q[r, o]  +  m[g, o] sum_r x[r]``

into a per-device fp32 workspace with relaxed atomics. A second small launch
(:func:`~dejavu_lab.kernels.threshold.tile.threshold_finalize_kernel`) rounds the sums to the
output dtype, adds the bias and zeroes the workspace for the next call. Thousands of short
programs keep more loads in flight than the loop's split programs.

Measured on an H200 (CUDA-graph replay, weights rotated past the L2, group 128, fp16; the
experiment sweeping tiles and four ways to turn codes into floats is in the closing note of
this kernel's change): at 4096->14336, 14336->4096 and 5120->13824 the 32 x 256 tile with two
warps ran 23.4 / 23.9 / 27.0 µs dense against the loop kernel's 29.2 / 30.6 / 37.7, and at 50%
kept 23.4 / 23.5 / 27.4 µs against 39.7 / 38.4 / 47.8. The sums are order-dependent in fp32
(one rounding at the end), so a caller that needs bitwise-repeatable results passes
``config={"mode": "loop"}`` to get :mod:`.kernel`'s serial split sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from ..pdl import pdl_args
from ..threshold.tile import threshold_finalize_kernel

__all__ = ["TILE", "finish", "int4_tile_kernel", "launch_tile"]

# the batch-1 tile (H200 sweep of 8 tilings x 3 shapes x 3 kept fractions, module docstring)
TILE = {"mode": "tile", "BLOCK_R": 32, "BLOCK_D": 256, "num_warps": 2}


@triton.jit
def int4_tile_kernel(
    x_ptr,  # [K] the input token
    p_ptr,  # [K, D // 8] codes, int32 words of 8 nibbles (output 8j + k in bits 4k..4k+3)
    s_ptr,  # [K // GROUP, D] scales
    m_ptr,  # [K // GROUP, D] mins
    thr_ptr,  # MODE 1: [K] fp32 thresholds (THR_SCALAR: unused)
    thr_value,  # MODE 1 with THR_SCALAR: the one threshold
    ws_ptr,  # [D] fp32 sums, zero between launches
    D,
    stride_p,
    MODE: tl.constexpr,  # 0 dense, 1 threshold
    THR_SCALAR: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: no column mask
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,  # divides GROUP
    BLOCK_D: tl.constexpr,  # a multiple of 8
):
    NW: tl.constexpr = BLOCK_D // 8
    offs_w = tl.program_id(0) * NW + tl.arange(0, NW)
    offs_n = tl.arange(0, 8)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    x = tl.load(x_ptr + offs_r, eviction_policy="evict_last")
    if MODE == 1:
        if THR_SCALAR:
            keep = tl.abs(x) > thr_value
        else:
            keep = tl.abs(x) > tl.load(thr_ptr + offs_r, eviction_policy="evict_last")
        x = tl.where(keep, x, tl.zeros_like(x))
    w_ptrs = p_ptr + offs_r.to(tl.int64)[:, None] * stride_p + offs_w[None, :]
    mask_w = offs_w * 8 < D
    if MODE == 1 and EVEN_D:
        words = tl.load(w_ptrs, mask=keep[:, None], other=0, eviction_policy="evict_first")
    elif MODE == 1:
        words = tl.load(w_ptrs, mask=keep[:, None] & mask_w[None, :], other=0,
                        eviction_policy="evict_first")  # fmt: skip
    elif EVEN_D:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        words = tl.load(w_ptrs, mask=mask_w[None, :], other=0, eviction_policy="evict_first")
    xf = x.to(tl.float32)
    q3 = (words[:, :, None] >> (offs_n * 4)[None, None, :]) & 0xF  # [rows, words, nibbles]
    xq = tl.sum(xf[:, None, None] * q3.to(tl.float32), axis=0)
    g = (tl.program_id(1) * BLOCK_R) // GROUP
    sm = g * D + offs_w[:, None] * 8 + offs_n[None, :]
    s = tl.load(s_ptr + sm, mask=mask_w[:, None], other=0.0).to(tl.float32)
    m = tl.load(m_ptr + sm, mask=mask_w[:, None], other=0.0).to(tl.float32)
    y = tl.reshape(s * xq + m * tl.sum(xf, axis=0), (BLOCK_D,))
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.atomic_add(ws_ptr + offs_d, y, mask=offs_d < D, sem="relaxed")


def launch_tile(xb: torch.Tensor, w, res2: torch.Tensor, cfg: dict, *, mode: str, thr=None,
                bias: torch.Tensor | None = None, activation: str = "none",
                gated: bool = False) -> None:  # fmt: skip
    """Run :func:`int4_tile_kernel` and the finishing launch on checked inputs: ``xb`` [1, K],
    ``w`` an Int4Weight on xb's device and dtype with ``d_out % 8 == 0``, ``res2`` the [1, D]
    output ([1, D / 2] when ``gated``: see :func:`finish`); ``mode`` dense or threshold (``thr``
    a float or fp32 [K]). ``cfg``: ``BLOCK_R`` (a power of two dividing the group),
    ``BLOCK_D`` (a power of two >= 8), ``num_warps``.

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :8], group=32, dtype=torch.float16)  # w_t [32, 8]
    >>> x, out = torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> launch_tile(x, w, out, TILE, mode="dense")  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    d_in, d_out = w.shape
    block_r = min(int(cfg["BLOCK_R"]), w.group)
    block_d = min(int(cfg["BLOCK_D"]), triton.next_power_of_2(d_out))
    if block_r & (block_r - 1) or block_d & (block_d - 1) or block_d < 8 or w.group % block_r:
        raise ValueError(f"config BLOCK_R={block_r} (dividing the group {w.group}) and "
                         f"BLOCK_D={block_d} (>= 8) must be powers of two.")  # fmt: skip
    if xb.shape[0] != 1 or d_out % 8:
        raise ValueError("the tile kernel runs one token with d_out a multiple of 8.")
    device = xb.device
    codes = w.packed.view(torch.int32)
    ws = _workspace.sums(device, d_out)
    scalar = mode == "threshold" and not isinstance(thr, torch.Tensor)
    int4_tile_kernel[(triton.cdiv(d_out, block_d), d_in // block_r)](
        xb, codes, w.scales, w.mins, thr if isinstance(thr, torch.Tensor) else ws,
        float(thr) if scalar else 0.0, ws, d_out, codes.stride(0),
        MODE=1 if mode == "threshold" else 0, THR_SCALAR=scalar, EVEN_D=d_out % block_d == 0,
        GROUP=w.group, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=int(cfg["num_warps"]),
        num_stages=1,
    )  # fmt: skip
    finish(ws, res2, bias, activation, gated)


def finish(ws: torch.Tensor, res2: torch.Tensor, bias: torch.Tensor | None,
           activation: str = "none", gated: bool = False) -> None:  # fmt: skip
    """The finishing launch of the one-token kernels: ``res2 = act(ws + bias)`` in the output
    dtype (``gated``: ``act(gate) * up`` of the sums' two halves, ``res2`` [1, D / 2]; the MLP's
    hidden activations without a launch of their own), and ``ws`` zeroed for the next call.

    >>> ws, out = torch.tensor([1.0, 2.0]), torch.empty(1, 2, dtype=torch.float16)
    >>> finish(ws, out, None)  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist(), ws.tolist()
    ([[1.0, 2.0]], [0.0, 0.0])
    """
    d_out = res2.shape[1]
    threshold_finalize_kernel[(triton.cdiv(d_out, 1024), 1)](
        ws, bias if bias is not None else ws, res2, d_out, res2.stride(0),
        HAS_BIAS=bias is not None, ACT=activation, GATED=gated, BLOCK=1024, num_warps=4,
        **pdl_args(ws.device),
    )  # fmt: skip
