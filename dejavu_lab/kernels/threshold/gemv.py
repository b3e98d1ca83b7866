"""Input-sparse GEMV with the mask computed in the kernel: TEAL / WINA (and CATS's down step).

TEAL (Liu et al. 2024, ``liu2024teal``, §3) zeroes the entries of a linear layer's *input*
whose magnitude is below a per-column threshold, so the layer reads only the weight columns
of the surviving entries; WINA scales the threshold by the column norms (``t / ||W[:, i]||``),
which is the same rule with another ``thr``. With the weight stored transposed (``w_t = W.T``,
[d_in, d_out], one contiguous row per input column, as Deja Vu Appendix E stores W2)::

    y[b] = sum_i [|x[b, i]| > thr[i]] * x[b, i] * w_t[i, :]  (+ bias)

For a union batch (1-32 tokens) a row is read when any token keeps its column; each token's
own entries are masked by its own rule. Nothing leaves the GPU: no index list, no host sync,
a launch shape fixed by the tensor shapes, so the call sits inside a CUDA graph.

Work split: programs tile the output columns (``BLOCK_D``) and split the input rows
(``n_split``). Each program scans its row chunk, computes the union mask from ``x`` and
``thr`` and (``compact``, the default) writes the surviving row numbers into a private scratch
slice, then streams only those rows, ``BLOCK_R`` at a time: every load carries useful bytes at
any sparsity (TEAL's kernel masks the loads of a fixed row tile instead, which keeps the
memory pipeline mostly empty at 10% kept; ``compact=False`` does that, for comparison).
Batch 1 multiplies with FMAs, union batches with ``tl.dot`` (token tile padded to 16).

Reduction over the splits, fp32 throughout: ``reduce="serial"`` (default, deterministic) writes
fp32 partials and the last program of each column tile to arrive (an arrival counter, as
CUTLASS's serial split-K) sums them in split order; ``reduce="atomic"`` adds into an fp32
buffer with atomics and the last program converts it (order-dependent rounding, like TEAL's
atomic split-K). One split writes the output directly. The atomic mode is opt-in only, and
the tuned tables skip it (:mod:`~dejavu_lab.kernels.tuning`): with the tensor-core tiles
(batch > 1, ``dot``), a load of the sums followed by a store of zeros races across the last
program's threads (it failed correctness checks on the H200 with Triton 3.6), so
:func:`~dejavu_lab.kernels._reduce.take_zero` does both in one atomic, and with it the GPU
tests pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace, tuning
from .._common import (
    as_batch,
    batch_block,
    check_device,
    check_float,
    check_out,
    check_rowmajor,
    check_shape,
    check_thr,
    dot_acc,
    next_pow2,
    sm_count,
    upcast_dot,
    use_triton,
)
from .._reduce import split_reduce
from . import tile

__all__ = [
    "compact_config",
    "default_config",
    "threshold_gemv",
    "threshold_gemv_kernel",
    "threshold_gemv_ref",
]

REDUCE = {"direct": 0, "serial": 1, "atomic": 2}


@triton.jit
def threshold_gemv_kernel(
    x_ptr,  # [B, K] inputs
    w_ptr,  # [K, D] W transposed, row-major
    thr_ptr,  # [K] fp32 thresholds
    b_ptr,  # [D] bias (optional)
    out_ptr,  # [B, D] output
    ws_ptr,  # fp32 partials [n_split, B, D] (serial) or sums [B, D] (atomic)
    rows_ptr,  # int32 scratch: one slice of rows_per_split per program (COMPACT)
    count_ptr,  # int32 arrival counters [>= n_col], zero between launches
    B,
    K,
    D,
    stride_xb,
    stride_w,
    stride_ob,
    rows_per_split,
    n_split,
    REDUCE: tl.constexpr,  # 0 one split writes out, 1 serial partials, 2 atomics
    HAS_BIAS: tl.constexpr,
    COMPACT: tl.constexpr,  # compact the surviving rows first (else masked row tiles)
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_BS: tl.constexpr,  # next power of two >= B (the scan's token tile)
    BLOCK_R: tl.constexpr,  # rows per step
    BLOCK_D: tl.constexpr,  # output columns per program
    SCAN: tl.constexpr,  # rows per step of the mask scan (COMPACT)
    PREFETCH: tl.constexpr,  # COMPACT: 1 row numbers one step early; 2 (FMA) weights too
    ACC2D: tl.constexpr,  # FMA path: [BLOCK_R, BLOCK_D] accumulator, reduced once at the end
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    CHUNK: tl.constexpr,  # partials read per step by the serial reduction
):
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    offs_k = tl.arange(0, BLOCK_R)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(K, r_lo + rows_per_split)
    if COMPACT:
        # 1. the rows of [r_lo, r_hi) that some token keeps, in order, into this program's slice
        my_rows = rows_ptr + (pid_s * tl.num_programs(0) + pid_d).to(tl.int64) * rows_per_split
        offs_sc = tl.arange(0, SCAN)
        offs_bs = tl.arange(0, BLOCK_BS)
        mask_bs = offs_bs < B
        count = 0
        for s0 in range(r_lo, r_hi, SCAN):
            offs = s0 + offs_sc
            m = offs < r_hi
            t = tl.load(thr_ptr + offs, mask=m, other=float("inf"))
            xs = tl.load(x_ptr + offs_bs[:, None] * stride_xb + offs[None, :],
                         mask=mask_bs[:, None] & m[None, :], other=0.0)  # fmt: skip
            keep = tl.max((tl.abs(xs.to(tl.float32)) > t[None, :]).to(tl.int32), axis=0)
            pos = count + tl.cumsum(keep, axis=0) - 1
            tl.store(my_rows + pos, offs, mask=keep > 0)
            count += tl.sum(keep, axis=0)
        tl.debug_barrier()  # the slice is written before any thread reads it back
        lo = 0
        hi = count
    else:
        lo = r_lo
        hi = r_hi
    # 2. stream the rows: FMAs for one token, tensor cores for a union batch
    if BLOCK_B == 1 and COMPACT and PREFETCH == 2:
        # software pipeline: the next step's weights load while this step's multiply runs
        # (two weight tiles in flight per program; row numbers fetched two steps ahead)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        m_c = offs_k < hi
        rows_c = tl.load(my_rows + offs_k, mask=m_c, other=0, cache_modifier=".cg")
        w_c = tl.load((w_ptr + rows_c.to(tl.int64)[:, None] * stride_w) + offs_d[None, :],
                      mask=m_c[:, None] & mask_d[None, :], other=0.0,
                      eviction_policy="evict_first")  # fmt: skip
        x_c = tl.load(x_ptr + rows_c, mask=m_c, other=0.0)
        rows_n = tl.load(
            my_rows + BLOCK_R + offs_k, mask=(BLOCK_R + offs_k) < hi, other=0, cache_modifier=".cg"
        )
        for r0 in range(lo, hi, BLOCK_R):
            nxt = r0 + BLOCK_R + offs_k
            m_n = nxt < hi
            w_n = tl.load((w_ptr + rows_n.to(tl.int64)[:, None] * stride_w) + offs_d[None, :],
                          mask=m_n[:, None] & mask_d[None, :], other=0.0,
                          eviction_policy="evict_first")  # fmt: skip
            x_n = tl.load(x_ptr + rows_n, mask=m_n, other=0.0)
            rows_nn = tl.load(
                my_rows + nxt + BLOCK_R, mask=(nxt + BLOCK_R) < hi, other=0, cache_modifier=".cg"
            )
            acc += x_c.to(tl.float32)[:, None] * w_c.to(tl.float32)
            w_c = w_n
            x_c = x_n
            rows_n = rows_nn
        y = tl.sum(acc, axis=0)[None, :]
    elif BLOCK_B == 1:
        if ACC2D:
            acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_D,), tl.float32)
        if COMPACT and PREFETCH:
            rows_nxt = tl.load(my_rows + offs_k, mask=offs_k < hi, other=0, cache_modifier=".cg")
        for r0 in range(lo, hi, BLOCK_R):
            offs_r = r0 + offs_k
            mask_r = offs_r < hi
            if COMPACT:
                if PREFETCH:
                    rows = rows_nxt
                    rows_nxt = tl.load(my_rows + offs_r + BLOCK_R,
                                       mask=(offs_r + BLOCK_R) < hi, other=0, cache_modifier=".cg")  # fmt: skip
                else:
                    rows = tl.load(my_rows + offs_r, mask=mask_r, other=0, cache_modifier=".cg")
                xv = tl.load(x_ptr + rows, mask=mask_r, other=0.0).to(tl.float32)
                use = mask_r
            else:
                rows = offs_r
                xv = tl.load(x_ptr + rows, mask=mask_r, other=0.0).to(tl.float32)
                t = tl.load(thr_ptr + rows, mask=mask_r, other=float("inf"))
                use = mask_r & (tl.abs(xv) > t)
                xv = tl.where(use, xv, 0.0)
            w = tl.load((w_ptr + rows.to(tl.int64)[:, None] * stride_w) + offs_d[None, :],
                        mask=use[:, None] & mask_d[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            if ACC2D:
                acc += xv[:, None] * w.to(tl.float32)
            else:
                acc1 += tl.sum(xv[:, None] * w.to(tl.float32), axis=0)
        if ACC2D:
            y = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_D]
        else:
            y = acc1[None, :]
    else:
        acc = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
        if COMPACT and PREFETCH:
            rows_nxt = tl.load(my_rows + offs_k, mask=offs_k < hi, other=0, cache_modifier=".cg")
        for r0 in range(lo, hi, BLOCK_R):
            offs_r = r0 + offs_k
            mask_r = offs_r < hi
            if COMPACT:
                if PREFETCH:  # a loop-carried row list lets Triton pipeline the weight loads
                    rows = rows_nxt
                    rows_nxt = tl.load(my_rows + offs_r + BLOCK_R,
                                       mask=(offs_r + BLOCK_R) < hi, other=0, cache_modifier=".cg")  # fmt: skip
                else:
                    rows = tl.load(my_rows + offs_r, mask=mask_r, other=0, cache_modifier=".cg")
            else:
                rows = offs_r
            t = tl.load(thr_ptr + rows, mask=mask_r, other=float("inf"))
            xt = tl.load(x_ptr + offs_b[:, None] * stride_xb + rows[None, :],
                         mask=mask_b[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
            keep = tl.abs(xt.to(tl.float32)) > t[None, :]  # each token's own rule
            xt = tl.where(keep, xt, tl.zeros_like(xt))
            if COMPACT:
                use = mask_r
            else:
                use = tl.max(keep.to(tl.int32), axis=0) > 0
            w = tl.load((w_ptr + rows.to(tl.int64)[:, None] * stride_w) + offs_d[None, :],
                        mask=use[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
            acc = dot_acc(xt, w, acc, UPCAST)
        y = acc
    split_reduce(y, ws_ptr, count_ptr, b_ptr, out_ptr, offs_b, offs_d, mask_b, mask_d, B, D,
                 stride_ob, pid_d, pid_s, n_split, REDUCE, HAS_BIAS, CHUNK, False)  # fmt: skip


def threshold_gemv_ref(x, w_t, thr, *, bias=None):
    """Plain-PyTorch reference (fp32 math): ``(x * (|x| > thr)) @ w_t + bias``.

    >>> w_t = torch.eye(3, dtype=torch.float16)  # d_in = d_out = 3
    >>> x = torch.tensor([0.5, -2.0, 1.5], dtype=torch.float16)
    >>> threshold_gemv_ref(x, w_t, torch.ones(3))  # |0.5| <= 1 is dropped
    tensor([ 0.0000, -2.0000,  1.5000], dtype=torch.float16)
    """
    xf = x.float()
    t = torch.as_tensor(thr, dtype=torch.float32, device=x.device)
    y = torch.where(xf.abs() > t, xf, 0.0) @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def default_config(batch: int, d_in: int, d_out: int, kept: float | None = None, *,
                   device: torch.device | None = None) -> dict:  # fmt: skip
    """The launch configuration: a tuned one from ``kernels/tuned/tuning_*.json`` when this GPU
    and shape were tuned (:mod:`~dejavu_lab.kernels.tuning`), else a heuristic sized to fill the GPU.

    ``kept`` is the fraction of rows the caller expects to survive (a hint: the wrapper
    cannot know it without a host sync, so it passes ``None``, the config best on average
    over the tuned fractions; a caller that knows its budget may pass
    ``config=default_config(..., kept=0.3)``).

    >>> default_config(1, 11008, 4096, device=torch.device("cpu"))["mode"]
    'tile'
    >>> default_config(1, 11008, 4096, kept=0.1, device=torch.device("cpu"))["mode"]
    'compact'
    >>> cfg = default_config(16, 11008, 4096, device=torch.device("cpu"))
    >>> cfg["BLOCK_D"], cfg["reduce"], cfg["compact"]
    (128, 'serial', True)
    """
    device = device or torch.device("cpu")
    if batch == 1 and (kept is None or kept > 0.2):
        # one masked tile per program (:mod:`~dejavu_lab.kernels.threshold.tile`): the faster
        # kernel at every engine site and at 20-60% kept on the H200. Its fixed config, not the
        # tuned tables: their 1-warp tiles won the isolated sweep by a few percent but lost in
        # the decode step (TEAL 50%, H200: 2.652 against 2.580 ms at Llama-3-8B, 4.110
        # against 3.991 ms at Llama-2-13B, ``kernels/profile_engine.py`` with and without
        # ``DEJAVU_LAB_TUNING=off``)
        return dict(tile.TILE_B1)
    tuned = tuning.lookup("threshold_gemv", d_in, d_out, kept, batch, device)
    if tuned is not None:  # union batches, and few rows kept (the compacting kernel's lead)
        return tuned
    return compact_config(batch, device)


def compact_config(batch: int, device: torch.device) -> dict:
    """The compacting kernel's heuristic config: the one the H200 sweep
    (``kernels/tuned/tuning_threshold_gemv.json``) picks over every tuned kept fraction at the Llama
    shapes (batch 1: many short FMA programs; union batches: tensor-core tiles).

    >>> compact_config(1, torch.device("cpu"))["programs"] > 0
    True
    """
    sms = sm_count(device)
    if batch == 1:
        cfg = {"BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4, "programs": 4 * sms}
    else:
        cfg = {"BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3, "programs": sms}
    cfg.update(mode="compact", reduce="serial", compact=True, prefetch=1)
    return cfg


def _split(d_in: int, d_out: int, cfg: dict) -> tuple[int, int, int]:
    """(n_col, n_split, rows_per_split): enough programs to fill the GPU."""
    n_col = triton.cdiv(d_out, cfg["BLOCK_D"])
    if cfg.get("split"):
        want = int(cfg["split"])
    else:
        want = max(1, triton.cdiv(cfg["programs"], n_col))
    want = max(1, min(want, triton.cdiv(d_in, cfg["BLOCK_R"])))
    rows = triton.cdiv(triton.cdiv(d_in, want), 16) * 16
    return n_col, triton.cdiv(d_in, rows), rows


def _launch(xb, w_t, thr, bias, res2, cfg: dict) -> None:
    """Launch the kernel on checked inputs (xb [B, d_in], res2 [B, d_out] views)."""
    batch, d_in = xb.shape
    d_out = w_t.shape[1]
    device = xb.device
    if "programs_per_sm" in cfg:  # tuned tables record programs per multiprocessor
        cfg = {**cfg, "programs": max(1, round(cfg["programs_per_sm"] * sm_count(device)))}
    # batch 1 with "dot": the tensor-core path with the token padded to 16 (its weight loads
    # are pipelined through shared memory, more bytes in flight than the FMA path's registers)
    block_b = 16 if batch == 1 and cfg.get("dot") else batch_block(batch)
    if block_b > 1 and cfg["BLOCK_R"] < 16:
        raise ValueError("config BLOCK_R must be >= 16 for batches above 1 (tensor-core path).")
    cfg = {**cfg, "BLOCK_D": min(cfg["BLOCK_D"], max(16, next_pow2(d_out)))}
    n_col, n_split, rows_per_split = _split(d_in, d_out, cfg)
    reduce = "direct" if n_split == 1 else cfg.get("reduce", "serial")
    if reduce not in REDUCE:
        raise ValueError(f"config reduce={reduce!r} is not 'serial' or 'atomic'.")
    if reduce == "serial":
        ws = _workspace.partials(device, n_split * batch * d_out)
    elif reduce == "atomic":
        ws = _workspace.sums(device, batch * d_out)
    else:
        ws = res2
    compact = bool(cfg.get("compact", True))
    rows = _workspace.rows(device, n_col * n_split * rows_per_split) if compact else ws
    counts = _workspace.counters(device, n_col) if n_split > 1 else ws
    block_bs = next_pow2(batch)
    scan = cfg.get("SCAN") or max(16, min(next_pow2(rows_per_split), 4096 // block_bs))
    block_r = cfg["BLOCK_R"]
    acc2d = cfg.get("acc2d")
    if acc2d is None:
        acc2d = block_r * cfg["BLOCK_D"] <= 64 * 32 * cfg["num_warps"]
    chunk_cap = max(1, 32 * 32 * cfg["num_warps"] // (block_b * cfg["BLOCK_D"]))
    chunk = max(1, min(next_pow2(n_split), 1 << (chunk_cap.bit_length() - 1)))
    threshold_gemv_kernel[(n_col, n_split)](
        xb, w_t, thr, bias if bias is not None else w_t, res2, ws, rows, counts,
        batch, d_in, d_out, xb.stride(0), w_t.stride(0), res2.stride(0), rows_per_split, n_split,
        REDUCE=REDUCE[reduce], HAS_BIAS=bias is not None, COMPACT=compact, BLOCK_B=block_b,
        BLOCK_BS=block_bs, BLOCK_R=block_r, BLOCK_D=cfg["BLOCK_D"], SCAN=scan,
        PREFETCH=int(cfg.get("prefetch", 0)), ACC2D=bool(acc2d), UPCAST=upcast_dot(xb.dtype),
        CHUNK=chunk, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def threshold_gemv(
    x: torch.Tensor,
    w_t: torch.Tensor,
    thr: torch.Tensor | float,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    deterministic: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """``y[b] = sum_i [|x[b,i]| > thr[i]] x[b,i] w_t[i]`` (+ bias), reading only kept rows.

    x: [d_in] or [B, d_in] (B <= 32, fp16/bf16); w_t: [d_in, d_out] row-major (``W.T``
    made contiguous once at load time); thr: a float (TEAL's one threshold per site: passed to
    the kernel as a number, so a captured graph keeps the value it was captured with) or fp32
    [d_in] (WINA: ``t / ||W[:, i]||``; ``-inf`` keeps a column, ``inf`` drops it); bias:
    [d_out]. Returns [d_out] or [B, d_out]. A row is read when any token of the batch keeps
    it. No host sync and a launch shape fixed by the shapes: capturable in a CUDA graph (the
    first call of a shape allocates small per-device buffers; make it outside capture, on one
    stream). One token runs :mod:`~dejavu_lab.kernels.threshold.tile` (one masked tile per program, fp32
    atomics: order-dependent rounding; a union batch too with ``config={"mode": "tile"}``);
    union batches, ``config={"mode": "compact"}`` and
    ``deterministic=True`` run the compacting kernel, whose default serial reduction is
    bitwise repeatable (``deterministic`` also forbids its atomic mode). ``config``
    overrides the tiles (see :func:`default_config`).

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2, 64, dtype=torch.float16)  # a union batch of 2 tokens, d_in = 64
    >>> w_t = torch.randn(64, 32, dtype=torch.float16) / 8  # W.T: d_out = 32
    >>> thr = torch.full((64,), 0.7)  # TEAL: keep |x| > 0.7 (about half)
    >>> y = threshold_gemv(x, w_t, thr)  # the Triton kernel on CPU under TRITON_INTERPRET=1
    >>> y.shape, torch.allclose(y, threshold_gemv_ref(x, w_t, thr), atol=1e-2)
    (torch.Size([2, 32]), True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    scalar = isinstance(thr, (int, float)) and not isinstance(thr, bool)
    if not scalar and not isinstance(thr, torch.Tensor):
        raise TypeError(f"thr must be a float or a torch.Tensor, got {type(thr).__name__}.")
    check_device(device, w_t=w_t, bias=bias, **({} if scalar else {"thr": thr}))
    check_float("w_t", w_t, dtype)
    check_rowmajor("w_t", w_t)
    d_in, d_out = w_t.shape
    if scalar:
        if thr != thr:
            raise ValueError("thr is NaN; pass a number (inf drops every column, -1 keeps all).")
    else:
        check_thr(thr, d_in)
    if bias is not None:
        check_float("bias", bias, dtype)
        check_shape("bias", bias, (d_out,))
    xb, squeeze = as_batch("x", x, d_in)
    batch = xb.shape[0]
    shape = (d_out,) if squeeze else (batch, d_out)
    check_out(out, shape, dtype, device)
    res = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    res2 = res.view(batch, d_out)
    if not use_triton(device):
        res2.copy_(threshold_gemv_ref(xb, w_t, thr, bias=bias))
        return res
    config = config or {}
    base = default_config(batch, d_in, d_out, device=device)
    mode = config.get("mode", base.get("mode", "compact"))
    if mode not in ("tile", "compact"):
        raise ValueError(f"config mode={mode!r} is not 'tile' or 'compact'.")
    if mode == "tile" and not deterministic and tile.fits(w_t):
        tile_cfg = base if base.get("mode") == "tile" else tile.TILE_B1
        tile.launch(xb, w_t, thr, bias, res2, {**tile_cfg, **config})
        return res
    # union batches, a bitwise-repeatable sum, a weight past int32 offsets: compacting
    if base.get("mode") == "tile":
        base = compact_config(batch, device)
    cfg = {**base, **config, "mode": "compact"}
    if not isinstance(thr, torch.Tensor):
        thr = torch.full((d_in,), float(thr), device=device)
    if deterministic and cfg.get("reduce") == "atomic":
        cfg["reduce"] = "serial"
    _launch(xb, w_t, thr, bias, res2, cfg)
    return res
