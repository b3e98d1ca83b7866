"""The kept-row W4A16 GEMV over a rows-layout int4 matrix: ``dot(x, dequant(W)[j])`` for the
listed outputs ``j`` only — Deja Vu's up projection and kept heads' QKV on 4-bit weights.

Deja Vu (§4.4) reads the rows of ``W_in`` (``fc1``, or gate and up) of the kept neurons and the
rows of ``W_QKV`` of the kept heads. In the rows layout (:class:`~dejavu_lab.quant.Int4Rows`:
``W`` ``[out, in]``, one row of ``in / 2`` code bytes per output, a (scale, min) per output and
``group`` inputs) a kept row is ``in / 2`` contiguous bytes plus ``2 in / group`` scales and
mins; a dropped one is never read::

    y[b, j] = act(sum_g s[r, g] sum_{i in g} q[r, i] x[b, i]  +  m[r, g] sum_{i in g} x[b, i]  + bias[r])

for row ``r = idx[j // G] G + j % G`` (``G = rows_per_index``: 1 for neurons, ``d_head`` for
heads); ``gated``: ``act(gate_r . x + b_r) * (up_r . x + b_{n + r})``, the up row ``n`` rows on.

The kernel (:func:`int4_up_kernel`) also serves CATS (:mod:`.cats`: ``MODE=2``, every gate row,
then the up rows of the neurons whose ``|act(gate)|`` passes the threshold — a row no token
keeps is masked off the load) and the dense product (``MODE=0``, every row: a dense step over
weights stored in this layout, :func:`~dejavu_lab.engine.weights.linear_rows`). Program ``j`` owns ``BLOCK_N`` outputs and walks
the inputs ``BLOCK_K`` at a time, codes loaded as int32 words of 8 nibbles (``in`` is a multiple
of the group, so of 8) and unpacked with shifts; batch 1 sums ``q x`` per group and applies the
scale once per group and row (one FMA per weight), union batches (2-32 tokens) dequantise the
tile to x's dtype (as :meth:`~dejavu_lab.quant.Int4Rows.dequantize` rounds) and multiply on tensor
cores. One program per output block: no split, no atomics, no host sync — bitwise repeatable and
capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import Int4Rows
from .._common import (
    as_batch,
    batch_block,
    check_device,
    check_float,
    check_index,
    check_vector,
    dot_acc,
    next_pow2,
    output,
    upcast_dot,
    use_triton,
)
from .._neurons import FUSED_ACTIVATIONS, act, act_ref, expand_rows
from .dense import check_int4
from .up_half2 import CATS_HALF2, UP_HALF2, launch_up_half2

__all__ = ["configured", "default_config", "int4_kept_up", "int4_kept_up_ref", "int4_up_kernel",
           "launch"]  # fmt: skip


@triton.jit
def _rows_dot(p_ptr, s_ptr, m_ptr, rows, use, x_ptr, offs_b, mask_b, D, stride_p, stride_s,
              stride_xb, GROUP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_B] fp32: ``dequant(W)[rows] . x_b``; rows not in ``use`` read nothing."""
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP  # inputs of one group in a step
    NG: tl.constexpr = BLOCK_K // SUB  # groups per step
    r64 = rows.to(tl.int64)
    p_rows = p_ptr + r64[:, None] * stride_p
    sm_rows = r64[:, None] * stride_s
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, NG) * SUB
    if BLOCK_B == 1:
        acc = tl.zeros((BLOCK_N, NG), tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_w = k0 + offs_w * 8 < D
        words = tl.load(p_rows + (k0 // 8 + offs_w)[None, :], mask=use[:, None] & mask_w[None, :],
                        other=0, eviction_policy="evict_first")  # fmt: skip
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # input k0 + 8 w + n
        q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
        mask_g = k0 + offs_g < D
        sm = sm_rows + ((k0 + offs_g) // GROUP)[None, :]
        sm_mask = use[:, None] & mask_g[None, :]
        s = tl.load(s_ptr + sm, mask=sm_mask, other=0.0).to(tl.float32)  # [BLOCK_N, NG]
        m = tl.load(m_ptr + sm, mask=sm_mask, other=0.0).to(tl.float32)
        cols = k0 + offs_k
        mask_k = cols < D
        if BLOCK_B == 1:
            xk = tl.load(x_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
            if NG == 1:
                xq = tl.sum(q * xk[None, :], axis=1)
                acc += s * xq[:, None] + m * tl.sum(xk, axis=0)
            else:
                xq = tl.sum(tl.reshape(q * xk[None, :], (BLOCK_N, NG, SUB)), axis=2)
                xs = tl.sum(tl.reshape(xk, (NG, SUB)), axis=1)
                acc += s * xq + m * xs[None, :]
        else:
            xt = tl.load(x_ptr + offs_b[:, None] * stride_xb + cols[None, :],
                         mask=mask_b[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
            if NG == 1:
                w = q * s + m
            else:
                w3 = tl.reshape(q, (BLOCK_N, NG, SUB)) * s[:, :, None] + m[:, :, None]
                w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
            acc = dot_acc(w.to(xt.dtype), tl.trans(xt), acc, UPCAST)
    if BLOCK_B == 1:  # one return: the compiler types every return of a function alike
        out = tl.sum(acc, axis=1)[:, None]
    else:
        out = acc
    return out


@triton.jit
def int4_up_kernel(
    x_ptr,  # [B, D] inputs
    p_ptr,  # [R, D // 8] codes as int32 words (8 inputs each), one row per output row
    s_ptr,  # [R, D // GROUP] scales
    m_ptr,  # [R, D // GROUP] mins
    idx_ptr,  # MODE 1: [K // RPI] listed rows (blocks of RPI rows), int32
    thr_ptr,  # MODE 2: [K] fp32 thresholds on |act(gate)|
    b_ptr,  # [R] bias (HAS_BIAS)
    out_ptr,  # [B, K] outputs
    B,
    K,  # outputs: listed rows (MODE 1), every row (0), neurons (2)
    D,
    UP,  # GATED: the up row of row r is r + UP
    stride_xb,
    stride_p,
    stride_s,
    stride_ob,
    MODE: tl.constexpr,  # 0 every row, 1 listed rows, 2 CATS (every gate row, kept up rows)
    RPI: tl.constexpr,  # rows per index (MODE 1)
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,  # inputs per (scale, min)
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_N: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # inputs per step (a power of two >= 16)
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
):
    offs_j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_j = offs_j < K
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    if MODE == 1:
        blk = tl.load(idx_ptr + offs_j // RPI, mask=mask_j, other=0)
        rows = blk * RPI + offs_j % RPI
    else:
        rows = offs_j
    g = _rows_dot(p_ptr, s_ptr, m_ptr, rows, mask_j, x_ptr, offs_b, mask_b, D, stride_p, stride_s,
                  stride_xb, GROUP, BLOCK_B, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
    if HAS_BIAS:
        g += tl.load(b_ptr + rows, mask=mask_j, other=0.0).to(tl.float32)[:, None]
    m2 = mask_j[:, None] & mask_b[None, :]
    a = act(g, ACT)  # [BLOCK_N, BLOCK_B]
    if MODE == 2:
        t = tl.load(thr_ptr + offs_j, mask=mask_j, other=float("inf"))
        keep = (tl.abs(a) > t[:, None]) & m2
        use = tl.max(keep.to(tl.int32), axis=1) > 0  # an up row is read if any token keeps it
    else:
        keep = m2
        use = mask_j
    h = a
    if GATED:
        u = _rows_dot(p_ptr, s_ptr, m_ptr, rows + UP, use, x_ptr, offs_b, mask_b, D, stride_p,
                      stride_s, stride_xb, GROUP, BLOCK_B, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
        if HAS_BIAS:
            u += tl.load(b_ptr + rows + UP, mask=use, other=0.0).to(tl.float32)[:, None]
        h = a * u
    if MODE == 2:
        h = tl.where(keep, h, 0.0)
    o_ptrs = out_ptr + offs_b[None, :] * stride_ob + offs_j[:, None]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=m2)


def default_config(batch: int, mode: str = "half2", op: str = "kept") -> dict:
    """The launch configuration for ``batch`` tokens (a copy): one token runs the half2 kernel
    (:mod:`.up_half2`, ``mode="half2"``; ``op="cats"``: CATS's tiles, which cannot split the
    inputs) or this module's fp32 tile (``mode="tile"``: 32 rows x 256 inputs, its tiles before
    the half2 kernel), union batches tensor-core tiles of 32 x 128.

    >>> default_config(1)["mode"], default_config(1, "tile")["BLOCK_K"], default_config(8)["BLOCK_K"]
    ('half2', 256, 128)
    >>> default_config(1)["SPLIT"], default_config(1, op="cats").get("SPLIT", 1)
    (4, 1)
    """
    if batch == 1:
        if mode == "tile":
            return {"mode": "tile", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
        return dict(CATS_HALF2 if op == "cats" else UP_HALF2)
    return {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def configured(batch: int, config: dict | None, op: str = "kept") -> dict:
    """The defaults of ``batch`` tokens, ``op`` (``"kept"``, ``"cats"``) and the one-token
    kernel ``config`` names (its ``"mode"``), overridden by ``config``.

    >>> configured(1, {"mode": "tile", "num_warps": 8})["BLOCK_N"], configured(1, None)["mode"]
    (32, 'half2')
    """
    config = config or {}
    return {**default_config(batch, config.get("mode", "half2"), op), **config}


def launch(xb: torch.Tensor, w: Int4Rows, res2: torch.Tensor, cfg: dict, *, mode: str,
           idx: torch.Tensor | None = None, thr: torch.Tensor | None = None,
           rows_per_index: int = 1, gated: bool = False, activation: str = "none",
           bias: torch.Tensor | None = None) -> None:  # fmt: skip
    """Run :func:`int4_up_kernel` (one token with ``cfg["mode"] == "half2"``: :func:`.up_half2.launch_up_half2`) on checked inputs: ``xb`` [B, in], ``w`` an Int4Rows on xb's
    device and dtype, ``res2`` the [B, K] output; ``mode`` ``"dense"`` (every row, or every
    neuron when ``gated``), ``"rows"`` (``idx`` int32 blocks of ``rows_per_index`` rows) or
    ``"cats"`` (``thr`` fp32 [K]). ``cfg``: ``BLOCK_N``, ``BLOCK_K``, ``num_warps``,
    ``num_stages``.

    >>> from dejavu_lab.quant import quantize_rows
    >>> w = quantize_rows(torch.eye(32)[:8], group=32, dtype=torch.float16)  # W [8, 32]
    >>> x, out = torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> launch(x, w, out, default_config(1), mode="dense")  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    batch, d = xb.shape
    if batch == 1 and cfg.get("mode") == "half2":
        launch_up_half2(xb, w, res2, cfg, mode=mode, idx=idx, thr=thr,
                        rows_per_index=rows_per_index, gated=gated, activation=activation,
                        bias=bias)  # fmt: skip
        return
    k = res2.shape[1]
    block_b = batch_block(batch)
    block_n, block_k = int(cfg["BLOCK_N"]), min(int(cfg["BLOCK_K"]), max(16, next_pow2(d)))
    if block_n & (block_n - 1) or block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"config BLOCK_N={block_n} and BLOCK_K={block_k} must be powers of two "
                         "(BLOCK_K >= 16).")  # fmt: skip
    if block_b > 1 and block_n < 16:
        raise ValueError("config BLOCK_N must be >= 16 for batches above 1 (tensor-core path).")
    codes = w.packed.view(torch.int32)
    up = w.shape[0] // 2 if gated else 0
    int4_up_kernel[(triton.cdiv(max(k, 1), block_n),)](
        xb, codes, w.scales, w.mins, idx if idx is not None else codes,
        thr if thr is not None else w.scales, bias if bias is not None else w.scales, res2,
        batch, k, d, up, xb.stride(0), codes.stride(0), w.scales.stride(0), res2.stride(0),
        MODE={"dense": 0, "rows": 1, "cats": 2}[mode], RPI=rows_per_index, GATED=gated,
        ACT=activation, HAS_BIAS=bias is not None, GROUP=w.group, BLOCK_B=block_b,
        BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast_dot(xb.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def int4_kept_up_ref(x: torch.Tensor, w: Int4Rows, idx: torch.Tensor | None = None, *,
                     activation: str = "none", gated: bool = False,
                     bias: torch.Tensor | None = None, rows_per_index: int = 1) -> torch.Tensor:  # fmt: skip
    """Plain-PyTorch reference (fp32 math): ``act(dequant(w)[rows] x + b)`` (or
    ``act(gate) * up``, the up rows ``n`` on) for the rows of ``idx`` (None: every row).

    >>> from dejavu_lab.quant import quantize_rows
    >>> w = quantize_rows(torch.eye(32)[:4], group=32, dtype=torch.float16)
    >>> int4_kept_up_ref(torch.arange(32.0).half(), w, torch.tensor([3, 1])).tolist()
    [3.0, 1.0]
    """
    wd = w.dequantize(torch.float32)
    n = w.shape[0] // 2 if gated else w.shape[0]
    rows = torch.arange(n, device=wd.device) if idx is None else expand_rows(idx, rows_per_index)
    b = torch.zeros(w.shape[0], device=wd.device) if bias is None else bias.float()
    h = act_ref(x.float() @ wd[rows].T + b[rows], activation)
    if gated:
        h = h * (x.float() @ wd[rows + n].T + b[rows + n])
    return h.to(x.dtype)


def int4_kept_up(x: torch.Tensor, w: Int4Rows, idx: torch.Tensor | None = None, *,
                 activation: str = "none", gated: bool = False, bias: torch.Tensor | None = None,
                 rows_per_index: int = 1, out: torch.Tensor | None = None,
                 validate: bool | None = None, config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``act(dequant(w)[rows] . x + bias)`` for the listed rows only (Deja Vu's up projection).

    x: [d] or [B, d] (B <= 32, fp16/bf16); w: an :class:`~dejavu_lab.quant.Int4Rows` of ``W``
    [R, d] with x's dtype; idx: [k] distinct int32/int64 row blocks (row ``idx[i] G + r`` for
    ``G = rows_per_index``, ``r < G``), or None for every row; ``gated``: w holds gate rows then
    up rows (R = 2n), idx lists neurons, and the output is ``act(gate . x + b) * (up . x + b)``;
    activation: one of ``relu``, ``gelu``, ``gelu_tanh``, ``silu``, ``none``; bias: [R].
    Returns [k G] or [B, k G] in idx order. ``validate`` checks the indices' range and
    uniqueness (a host sync; by default except during CUDA-graph capture).

    >>> from dejavu_lab.quant import quantize_rows
    >>> _ = torch.manual_seed(0)
    >>> w = quantize_rows(torch.randn(128, 64) / 8, group=32, dtype=torch.float16)  # 64 neurons
    >>> x, idx = torch.randn(2, 64, dtype=torch.float16), torch.tensor([5, 40, 17])
    >>> h = int4_kept_up(x, w, idx, activation="silu", gated=True)  # Triton on CPU (interpreter)
    >>> h.shape, torch.allclose(h, int4_kept_up_ref(x, w, idx, activation="silu", gated=True),
    ...                         atol=1e-2)
    (torch.Size([2, 3]), True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_int4("w", w, Int4Rows, "quantize_rows(W)", dtype, device)
    n_rows, d = w.shape
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {FUSED_ACTIVATIONS}.")
    if gated and (n_rows % 2 or rows_per_index != 1):
        raise ValueError(f"gated takes gate rows then up rows (an even count, one per index); "
                         f"w has {n_rows} rows and rows_per_index={rows_per_index}.")  # fmt: skip
    if not isinstance(rows_per_index, int) or rows_per_index < 1:
        raise ValueError(f"rows_per_index={rows_per_index!r} must be a positive int.")
    n = n_rows // 2 if gated else n_rows
    if idx is not None:
        if n % rows_per_index:
            raise ValueError(f"w's {n} rows do not split into blocks of {rows_per_index}.")
        check_index("idx", idx, n // rows_per_index, device, validate)
    check_device(device, bias=bias)
    check_vector("bias", bias, n_rows, dtype)
    xb, squeeze = as_batch("x", x, d)
    k = n if idx is None else idx.numel() * rows_per_index
    res, res2 = output(out, xb.shape[0], k, squeeze, dtype, device)
    if not use_triton(device) or k == 0:
        res2.copy_(int4_kept_up_ref(xb, w, idx, activation=activation, gated=gated, bias=bias,
                                    rows_per_index=rows_per_index))  # fmt: skip
        return res
    launch(xb, w, res2, configured(xb.shape[0], config),
           mode="dense" if idx is None else "rows",
           idx=None if idx is None else idx.to(torch.int32), rows_per_index=rows_per_index,
           gated=gated, activation=activation, bias=bias)  # fmt: skip
    return res
