"""The batch-1 down projection over kept rows as one tile per program, summed with fp32 atomics.

:mod:`~dejavu_lab.kernels.mlp.down` splits the kept rows into a few long programs per column
tile and reduces their partials in order. At DejaVu's OPT points that ran at 0.5-0.65 of the
bytes floor on an H100 (``kernels/tuned/tuning_sparse_mlp_down_h100.json``): each program
waits on its first index and weight loads, and the last arrival sums every partial. Here
program (j, i) owns output columns ``[j BLOCK_D, (j + 1) BLOCK_D)`` and kept positions
``[i BLOCK_R, (i + 1) BLOCK_R)``: it loads those positions' row numbers and activations, then
its weight tile, and adds the fp32 column sums into a per-device workspace with relaxed
atomics, the grid of the TEAL tile kernel (:mod:`~dejavu_lab.kernels.threshold.tile`) over an
index list instead of a mask. Thousands of short programs keep many loads in flight. The
threshold tile kernel's finalize converts the sums (plus the bias) to the output dtype and
zeroes the workspace for the next call.

The sums are order-dependent in fp32 (one rounding at the end): ``config={"mode": "split"}``
gives the deterministic kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from ..pdl import await_inputs, pdl_args
from ..threshold.tile import add_tile, threshold_finalize_kernel

__all__ = ["TILE", "kept_rows", "launch_tile", "sparse_mlp_down_tile_kernel"]

# within 2% of the best tile at every DejaVu point of the H100 sweep (OPT-13B to OPT-66B and
# Llama-3-8B, kernels/tuned/tuning_sparse_mlp_down_h100.json), as TEAL's tile kernel's default
TILE = {"mode": "tile", "BLOCK_R": 128, "BLOCK_D": 64, "num_warps": 2}
WORKSPACE = "down_tile"  # its own sums: a threshold GEMV's may be alive at the same time


@triton.jit
def kept_rows(idx_ptr, offs_r, mask_r, G: tl.constexpr):
    """Weight rows of the kept positions ``offs_r`` (blocks of G rows per index), int64."""
    if G == 1:
        rows = tl.load(idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    else:
        blk = tl.load(idx_ptr + offs_r // G, mask=mask_r, other=0).to(tl.int64)
        rows = blk * G + offs_r % G
    return rows


@triton.jit
def sparse_mlp_down_tile_kernel(
    h_ptr,  # [K] activations of the kept rows, in idx order
    w_ptr,  # [n_rows, D] W2 transposed, row-major
    idx_ptr,  # [K // G] kept row blocks
    ws_ptr,  # [D] fp32 sums, zero between launches
    K,
    D,
    stride_w,
    G: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: no column mask
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < K
    rows = kept_rows(idx_ptr, offs_r, mask_r, G)
    hv = tl.load(h_ptr + offs_r, mask=mask_r, other=0.0)
    add_tile(w_ptr + (rows[:, None] * stride_w + offs_d[None, :]), mask_r, hv, ws_ptr, offs_d, D,
             EVEN_D)  # fmt: skip


def launch_tile(h: torch.Tensor, weight_t: torch.Tensor, idx: torch.Tensor, bias, out: torch.Tensor,
                g: int, cfg: dict) -> torch.Tensor:  # fmt: skip
    """Run the tile kernel and the finalize on checked inputs: h [k g] (or [1, k g], rows
    contiguous), out [d] or [1, d] (its row stride is kept); ``cfg``: ``BLOCK_R``, ``BLOCK_D``, ``num_warps``
    (``fin_block``: the finalize's block, default 1024). Returns out.

    >>> from dejavu_lab.kernels import sparse_mlp_down_ref
    >>> _ = torch.manual_seed(0)
    >>> h, w2t = torch.randn(3, dtype=torch.float16), torch.randn(64, 16, dtype=torch.float16)
    >>> idx, out = torch.tensor([3, 10, 42]), torch.empty(16, dtype=torch.float16)
    >>> _ = launch_tile(h, w2t, idx, None, out, 1, TILE)  # CPU: under TRITON_INTERPRET=1
    >>> torch.allclose(out, sparse_mlp_down_ref(h, w2t, idx), atol=1e-2)
    True
    """
    k = h.shape[-1]
    d = weight_t.shape[1]
    block_r, block_d = cfg["BLOCK_R"], cfg["BLOCK_D"]
    ws = _workspace.buffer(h.device, WORKSPACE, d, torch.float32)
    grid = (triton.cdiv(d, block_d), triton.cdiv(k, block_r))
    sparse_mlp_down_tile_kernel[grid](
        h, weight_t, idx, ws, k, d, weight_t.stride(0), G=g, EVEN_D=d % block_d == 0,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=cfg["num_warps"], num_stages=1,
        **pdl_args(h.device),
    )  # fmt: skip
    fin = int(cfg.get("fin_block", 1024))
    threshold_finalize_kernel[(triton.cdiv(d, fin), 1)](
        ws, bias if bias is not None else ws, out, d, out.stride(0) if out.dim() == 2 else d, HAS_BIAS=bias is not None,
        ACT="none", GATED=False, BLOCK=fin, num_warps=4, **pdl_args(ws.device),
    )  # fmt: skip
    return out
