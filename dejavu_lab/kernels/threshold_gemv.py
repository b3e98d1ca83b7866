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
(``n_split``). Each program either (``compact``, the default) scans its row chunk, computes the
union mask from ``x`` and ``thr``, writes the surviving row numbers into a private scratch slice
and streams only those rows, ``BLOCK_R`` at a time, so every load carries useful bytes at any
sparsity; or (``compact=False``) streams contiguous row tiles with the loads masked by the rule
(TEAL's scheme; ``prefetch`` loads x and thr one or two steps ahead and, with 2, the next
tile's weights during this tile's multiply). Batch 1 multiplies with FMAs (``acc2d=False``
reduces over the rows every step: fewer registers, taller tiles), union batches with
``tl.dot`` (token tile padded to 16).

Reduction over the splits, fp32 throughout (:mod:`._reduce`): ``reduce="serial"``
(deterministic) writes fp32 partials and the last program of each column tile to arrive sums
them in split order; ``reduce="atomic"`` adds into an fp32 buffer and the last arrival converts
it (order-dependent rounding, like TEAL's atomic split-K; ``deterministic=True`` forbids it).
Atomics are refused with tensor-core tiles: on an H200 with Triton 3.6 they lost or doubled
64-column groups of the output (``tests/test_kernels_threshold.py`` reproduces it at 11008 ->
4096); on the FMA path they are exact at the real shapes (same test).

Measured on the H200 (``results/threshold_gemv.json``, CUDA-graph replay, fp16, batch 1,
11008 -> 4096, dense cuBLAS 27.5 µs): 22.2 / 14.5 / 11.2 µs at 50 / 20 / 10% kept (0.62 /
0.38 / 0.24 of the ideal dense x kept) against TEAL's published kernel at 17.7 / 15.4 / 14.8:
faster at 20 and 10%, slower at 50%. About 4-7 µs of each call is fixed cost (the mask scan
and the row list's round trip through L2 before the first weight load, the split reduction
after the last); looped masked row tiles cost about a dense read whatever the kept fraction,
and one small masked tile per program (TEAL's grid, here with fp32 atomics and an arrival
counter) was slower still (39 µs at 50%). bf16: the same at 11008 -> 4096, 10-25% slower at
4096 -> 11008.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _workspace
from ._common import (
    as_batch,
    batch_block,
    check_device,
    check_float,
    check_thr,
    check_vector,
    check_weight,
    dot_acc,
    interpret,
    next_pow2,
    output,
    sm_count,
    upcast_dot,
    use_triton,
)
from ._reduce import chunk, split_reduce

__all__ = [
    "default_config",
    "threshold_gemv",
    "threshold_gemv_kernel",
    "threshold_gemv_ref",
]

REDUCE = {"direct": 0, "serial": 1, "atomic": 2}
ATOMIC_DOT = ("config reduce='atomic' is exact only on the FMA path (batch 1 without 'dot'); "
              "tensor-core tiles reduce with 'serial'.")  # fmt: skip


@triton.jit
def _acc_init(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC2D: tl.constexpr):
    if ACC2D:
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    else:
        acc = tl.zeros((BLOCK_D,), tl.float32)
    return acc


@triton.jit
def _fma(acc, xv, w, ACC2D: tl.constexpr):
    """acc += xv[:, None] * w: kept as a [BLOCK_R, BLOCK_D] tile (reduced once at the end) or
    reduced over the rows every step (fewer registers: room for taller tiles)."""
    prod = xv.to(tl.float32)[:, None] * w.to(tl.float32)
    if ACC2D:
        acc += prod
    else:
        acc += tl.sum(prod, axis=0)
    return acc


@triton.jit
def _acc_out(acc, ACC2D: tl.constexpr):
    if ACC2D:
        acc = tl.sum(acc, axis=0)
    return acc[None, :]  # [1, BLOCK_D]


@triton.jit
def _w_tile(w_ptr, rows, use, offs_d, mask_d, stride_w):
    return tl.load((w_ptr + rows.to(tl.int64)[:, None] * stride_w) + offs_d[None, :],
                   mask=use[:, None] & mask_d[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _compact(x_ptr, thr_ptr, my_rows, r_lo, r_hi, B, stride_xb, BLOCK_BS: tl.constexpr,
             SCAN: tl.constexpr):  # fmt: skip
    """Write the rows of [r_lo, r_hi) that some token keeps, in order, to ``my_rows``; count."""
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
    return count


@triton.jit
def _b1_compact(x_ptr, w_ptr, my_rows, hi, offs_d, mask_d, stride_w, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, ACC2D: tl.constexpr):  # fmt: skip
    """One token over its compacted rows my_rows[0:hi]: every load carries useful bytes.
    PREFETCH 1: row numbers one step early; 2: the next step's weights load during this
    step's multiply (two tiles in flight), row numbers two steps early."""
    offs_k = tl.arange(0, BLOCK_R)
    acc = _acc_init(BLOCK_R, BLOCK_D, ACC2D)
    if PREFETCH == 2:
        m_c = offs_k < hi
        rows_c = tl.load(my_rows + offs_k, mask=m_c, other=0, cache_modifier=".cg")
        w_c = _w_tile(w_ptr, rows_c, m_c, offs_d, mask_d, stride_w)
        x_c = tl.load(x_ptr + rows_c, mask=m_c, other=0.0)
        rows_n = tl.load(my_rows + BLOCK_R + offs_k, mask=(BLOCK_R + offs_k) < hi, other=0,
                         cache_modifier=".cg")  # fmt: skip
        for r0 in range(0, hi, BLOCK_R):
            nxt = r0 + BLOCK_R + offs_k
            m_n = nxt < hi
            w_n = _w_tile(w_ptr, rows_n, m_n, offs_d, mask_d, stride_w)
            x_n = tl.load(x_ptr + rows_n, mask=m_n, other=0.0)
            rows_nn = tl.load(my_rows + nxt + BLOCK_R, mask=(nxt + BLOCK_R) < hi, other=0,
                              cache_modifier=".cg")  # fmt: skip
            acc = _fma(acc, x_c, w_c, ACC2D)
            w_c = w_n
            x_c = x_n
            rows_n = rows_nn
    else:
        if PREFETCH:
            rows_nxt = tl.load(my_rows + offs_k, mask=offs_k < hi, other=0, cache_modifier=".cg")
        for r0 in range(0, hi, BLOCK_R):
            offs_r = r0 + offs_k
            mask_r = offs_r < hi
            if PREFETCH:
                rows = rows_nxt
                rows_nxt = tl.load(my_rows + offs_r + BLOCK_R, mask=(offs_r + BLOCK_R) < hi,
                                   other=0, cache_modifier=".cg")  # fmt: skip
            else:
                rows = tl.load(my_rows + offs_r, mask=mask_r, other=0, cache_modifier=".cg")
            w = _w_tile(w_ptr, rows, mask_r, offs_d, mask_d, stride_w)
            acc = _fma(acc, tl.load(x_ptr + rows, mask=mask_r, other=0.0), w, ACC2D)
    return _acc_out(acc, ACC2D)


@triton.jit
def _keep(x_ptr, thr_ptr, rows, hi):
    """(x, |x| > thr) for the row tile ``rows`` (False past ``hi``)."""
    m = rows < hi
    xv = tl.load(x_ptr + rows, mask=m, other=0.0).to(tl.float32)
    t = tl.load(thr_ptr + rows, mask=m, other=float("inf"))
    return xv, tl.abs(xv) > t


@triton.jit
def _b1_masked(x_ptr, w_ptr, thr_ptr, lo, hi, offs_d, mask_d, stride_w, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, ACC2D: tl.constexpr):  # fmt: skip
    """One token over contiguous row tiles of [lo, hi), loads masked by |x| > thr (a dropped
    row costs no memory traffic). PREFETCH 1: x and thr one step early; 2: the next tile's
    weights load during this step's multiply, x and thr two steps early."""
    offs_k = tl.arange(0, BLOCK_R)
    acc = _acc_init(BLOCK_R, BLOCK_D, ACC2D)
    if PREFETCH == 2:
        x_c, use_c = _keep(x_ptr, thr_ptr, lo + offs_k, hi)
        w_c = _w_tile(w_ptr, lo + offs_k, use_c, offs_d, mask_d, stride_w)
        x_n, use_n = _keep(x_ptr, thr_ptr, lo + BLOCK_R + offs_k, hi)
        for r0 in range(lo, hi, BLOCK_R):
            w_n = _w_tile(w_ptr, r0 + BLOCK_R + offs_k, use_n, offs_d, mask_d, stride_w)
            x_nn, use_nn = _keep(x_ptr, thr_ptr, r0 + 2 * BLOCK_R + offs_k, hi)
            acc = _fma(acc, tl.where(use_c, x_c, 0.0), w_c, ACC2D)
            x_c, use_c, w_c = x_n, use_n, w_n
            x_n, use_n = x_nn, use_nn
    elif PREFETCH == 1:
        x_c, use_c = _keep(x_ptr, thr_ptr, lo + offs_k, hi)
        for r0 in range(lo, hi, BLOCK_R):
            x_n, use_n = _keep(x_ptr, thr_ptr, r0 + BLOCK_R + offs_k, hi)
            w = _w_tile(w_ptr, r0 + offs_k, use_c, offs_d, mask_d, stride_w)
            acc = _fma(acc, tl.where(use_c, x_c, 0.0), w, ACC2D)
            x_c, use_c = x_n, use_n
    else:
        for r0 in range(lo, hi, BLOCK_R):
            xv, use = _keep(x_ptr, thr_ptr, r0 + offs_k, hi)
            w = _w_tile(w_ptr, r0 + offs_k, use, offs_d, mask_d, stride_w)
            acc = _fma(acc, tl.where(use, xv, 0.0), w, ACC2D)
    return _acc_out(acc, ACC2D)


@triton.jit
def _union_dot(x_ptr, w_ptr, thr_ptr, my_rows, lo, hi, offs_b, mask_b, offs_d, mask_d, stride_xb,
               stride_w, COMPACT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """A union batch (token tile padded to >= 16) on tensor cores: [BLOCK_B, BLOCK_D] fp32."""
    offs_k = tl.arange(0, BLOCK_R)
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
    return acc


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
    PREFETCH: tl.constexpr,  # 1: next step's rows (and x) early; 2 (FMA): its weights too
    ACC2D: tl.constexpr,  # FMA path: [BLOCK_R, BLOCK_D] accumulator, reduced once at the end
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    CHUNK: tl.constexpr,  # partials read per step by the serial reduction
    FENCE: tl.constexpr,  # fence.acq_rel.gpu in every thread before the arrival (GPU only)
):
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(K, r_lo + rows_per_split)
    my_rows = rows_ptr + (pid_s * tl.num_programs(0) + pid_d).to(tl.int64) * rows_per_split
    if COMPACT:  # 1. the rows some token keeps, in order, into this program's scratch slice
        lo = 0
        hi = _compact(x_ptr, thr_ptr, my_rows, r_lo, r_hi, B, stride_xb, BLOCK_BS, SCAN)
    else:
        lo = r_lo
        hi = r_hi
    # 2. stream the rows: FMAs for one token, tensor cores for a union batch
    if BLOCK_B == 1:
        if COMPACT:
            y = _b1_compact(x_ptr, w_ptr, my_rows, hi, offs_d, mask_d, stride_w, BLOCK_R,
                            BLOCK_D, PREFETCH, ACC2D)  # fmt: skip
        else:
            y = _b1_masked(x_ptr, w_ptr, thr_ptr, lo, hi, offs_d, mask_d, stride_w, BLOCK_R,
                           BLOCK_D, PREFETCH, ACC2D)  # fmt: skip
    else:
        y = _union_dot(x_ptr, w_ptr, thr_ptr, my_rows, lo, hi, offs_b, mask_b, offs_d, mask_d,
                       stride_xb, stride_w, COMPACT, BLOCK_B, BLOCK_R, BLOCK_D, PREFETCH, UPCAST)  # fmt: skip
    split_reduce(y, ws_ptr, count_ptr, b_ptr, out_ptr, offs_b, offs_d, mask_b, mask_d, B, D,
                 stride_ob, pid_d, pid_s, n_split, REDUCE, HAS_BIAS, CHUNK, FENCE)  # fmt: skip


def threshold_gemv_ref(x, w_t, thr, *, bias=None):
    """Plain-PyTorch reference (fp32 math): ``(x * (|x| > thr)) @ w_t + bias``.

    >>> w_t = torch.eye(3, dtype=torch.float16)  # d_in = d_out = 3
    >>> x = torch.tensor([0.5, -2.0, 1.5], dtype=torch.float16)
    >>> threshold_gemv_ref(x, w_t, torch.ones(3))  # |0.5| <= 1 is dropped
    tensor([ 0.0000, -2.0000,  1.5000], dtype=torch.float16)
    """
    xf = x.float()
    y = torch.where(xf.abs() > thr.float(), xf, 0.0) @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def default_config(batch: int, d_in: int, d_out: int, kept: float | None = None, *,
                   device: torch.device | None = None) -> dict:  # fmt: skip
    """The launch configuration: a tuned one from ``results/tuning_*.json`` when this GPU
    and shape were tuned (:mod:`.tuning`), else a heuristic sized to fill the GPU.

    ``kept`` is the fraction of rows the caller expects to survive (a hint: the kernel cannot
    know it without a host sync; ``None`` picks the config best on average over the tuned
    fractions). :func:`threshold_gemv` passes its own ``kept`` argument here.

    >>> cfg = default_config(1, 11008, 4096, device=torch.device("cpu"))
    >>> cfg["reduce"], cfg["compact"]
    ('serial', True)
    """
    from . import tuning

    device = device or torch.device("cpu")
    tuned = tuning.lookup("threshold_gemv", d_in, d_out, kept, batch, device)
    if tuned is not None:
        return tuned
    # the best deterministic configs of the H200 sweep (results/tuning_threshold_gemv.json)
    if batch == 1:  # compacted rows, 128-row tiles, 4 programs per SM (128 registers each)
        cfg = {"BLOCK_R": 128, "BLOCK_D": 128, "num_warps": 4, "programs_per_sm": 4,
               "prefetch": 1, "acc2d": False}  # fmt: skip
    else:
        cfg = {"BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3,
               "programs_per_sm": 2, "prefetch": 1}  # fmt: skip
    cfg.update(reduce="serial", compact=True)
    return cfg


def _split(d_in: int, cfg: dict, n_col: int, align: int) -> tuple[int, int]:
    """(n_split, rows_per_split): about ``programs`` programs, whole ``align`` row steps."""
    if cfg.get("split"):
        want = int(cfg["split"])
    else:
        want = max(1, triton.cdiv(cfg["programs"], n_col))
    want = max(1, min(want, triton.cdiv(d_in, cfg["BLOCK_R"])))
    rows = triton.cdiv(triton.cdiv(d_in, want), align) * align
    return triton.cdiv(d_in, rows), rows


def _launch(xb, w_t, thr, bias, res2, cfg: dict) -> None:
    """Launch the kernel on checked inputs (xb [B, d_in], res2 [B, d_out] views)."""
    batch, d_in = xb.shape
    d_out = w_t.shape[1]
    device = xb.device
    if "programs_per_sm" in cfg:  # tuned tables record programs per multiprocessor
        cfg = {**cfg, "programs": max(1, round(cfg["programs_per_sm"] * sm_count(device)))}
    # batch 1 with "dot": the tensor-core path with the token padded to 16
    block_b = 16 if batch == 1 and cfg.get("dot") else batch_block(batch)
    if block_b > 1 and cfg["BLOCK_R"] < 16:
        raise ValueError("config BLOCK_R must be >= 16 for batches above 1 (tensor-core path).")
    block_d = min(cfg["BLOCK_D"], max(16, next_pow2(d_out)))
    block_r = cfg["BLOCK_R"]
    compact = bool(cfg.get("compact", True))
    n_col = triton.cdiv(d_out, block_d)
    n_split, rows_per_split = _split(d_in, cfg, n_col, 16 if compact else block_r)
    reduce = "direct" if n_split == 1 else cfg.get("reduce", "serial")
    if reduce not in REDUCE:
        raise ValueError(f"config reduce={reduce!r} is not 'serial' or 'atomic'.")
    if reduce == "atomic" and block_b > 1:
        raise ValueError(ATOMIC_DOT)
    if reduce == "serial":
        ws = _workspace.partials(device, n_split * batch * d_out)
    elif reduce == "atomic":
        ws = _workspace.sums(device, batch * d_out)
    else:
        ws = res2
    rows = _workspace.rows(device, n_col * n_split * rows_per_split) if compact else ws
    counts = _workspace.counters(device, n_col) if n_split > 1 else ws
    block_bs = next_pow2(batch)
    scan = cfg.get("SCAN") or max(16, min(next_pow2(rows_per_split), 4096 // block_bs))
    acc2d = cfg.get("acc2d")
    if acc2d is None:
        acc2d = block_r * block_d <= 64 * 32 * cfg["num_warps"]
    fence = bool(cfg.get("fence")) and reduce == "atomic" and not interpret()
    threshold_gemv_kernel[(n_col, n_split)](
        xb, w_t, thr, bias if bias is not None else w_t, res2, ws, rows, counts,
        batch, d_in, d_out, xb.stride(0), w_t.stride(0), res2.stride(0), rows_per_split, n_split,
        REDUCE=REDUCE[reduce], HAS_BIAS=bias is not None, COMPACT=compact, BLOCK_B=block_b,
        BLOCK_BS=block_bs, BLOCK_R=block_r, BLOCK_D=block_d, SCAN=scan,
        PREFETCH=int(cfg.get("prefetch", 0)) if block_b == 1 else min(1, int(cfg.get("prefetch", 0))),
        ACC2D=bool(acc2d), UPCAST=upcast_dot(xb.dtype),
        CHUNK=chunk(n_split, 32 * 32 * cfg["num_warps"] // (block_b * block_d)), FENCE=fence,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def threshold_gemv(
    x: torch.Tensor,
    w_t: torch.Tensor,
    thr: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kept: float | None = None,
    deterministic: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """``y[b] = sum_i [|x[b,i]| > thr[i]] x[b,i] w_t[i]`` (+ bias), reading only kept rows.

    x: [d_in] or [B, d_in] (B <= 32, fp16/bf16); w_t: [d_in, d_out] row-major (``W.T``
    made contiguous once at load time); thr: fp32 [d_in] (TEAL: a per-site constant; WINA:
    ``t / ||W[:, i]||``; ``-inf`` keeps a column, ``inf`` drops it); bias: [d_out]. Returns
    [d_out] or [B, d_out]. A row is read when any token of the batch keeps it. No host sync
    and a launch shape fixed by the shapes: capturable in a CUDA graph (the first call of a
    shape allocates small per-device buffers; make it outside capture, on one stream).
    ``kept``: the fraction of rows the caller expects to survive (its calibrated budget), a
    hint that picks the tuned config for it (any value computes the same function);
    ``deterministic=True`` forbids the atomic reduction (the default serial one already is);
    ``config`` overrides the tiles (see :func:`default_config`).

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
    if not isinstance(thr, torch.Tensor):
        raise TypeError(f"thr must be a torch.Tensor, got {type(thr).__name__}.")
    check_device(device, w_t=w_t, thr=thr, bias=bias)
    check_weight("w_t", w_t, dtype)
    d_in, d_out = w_t.shape
    check_thr(thr, d_in)
    check_vector("bias", bias, d_out, dtype)
    xb, squeeze = as_batch("x", x, d_in)
    res, res2 = output(out, xb.shape[0], d_out, squeeze, dtype, device)
    if not use_triton(device):
        res2.copy_(threshold_gemv_ref(xb, w_t, thr, bias=bias))
        return res
    cfg = {**default_config(xb.shape[0], d_in, d_out, kept, device=device), **(config or {})}
    if deterministic and cfg.get("reduce") == "atomic":
        cfg["reduce"] = "serial"
    _launch(xb, w_t, thr, bias, res2, cfg)
    return res
