"""The one W4A16 GEMV kernel behind :mod:`.dense`, :mod:`.threshold` and :mod:`.rows`.

The weight is an :class:`~dejavu_lab.quant.Int4Weight`: codes packed two per byte along the
outputs, one row per input channel, a (scale, min) per output and per ``GROUP`` input channels::

    y[b, o] = sum_i x[b, i] (q[i, o] s[g(i), o] + m[g(i), o])
            = sum_g s[g, o] sum_{i in g} x[b, i] q[i, o]  +  m[g, o] sum_{i in g} x[b, i]

Batch 1 uses the second form (one FMA per weight, the scales applied once per group and
output); a union batch (2-32 tokens) dequantises the tile (``q s + m``, rounded to x's dtype as
:meth:`~dejavu_lab.quant.Int4Weight.dequantize` rounds) and multiplies on tensor cores.

Work split as :mod:`~dejavu_lab.kernels.threshold.gemv`'s masked mode: program ``(j, s)`` owns
output columns ``[j BLOCK_D, (j + 1) BLOCK_D)`` and the input rows of split ``s``, which it
walks ``BLOCK_R`` at a time; the splits are summed in fp32 by
:func:`~dejavu_lab.kernels._reduce.split_reduce` (serial: the last program of a column tile to
arrive adds the partials in split order, bitwise repeatable; or atomics; or one split writes
the output directly).

``MODE``: 0 dense; 1 threshold (TEAL/WINA: each token's entries below ``thr`` are zeroed, and a
row no token keeps is masked off the code load, so its bytes never move; a group's scales and
mins are read only when one of its rows is kept); 2 kept rows (row ``r`` of the walk is weight
row ``idx[r // RPI] RPI + r % RPI``, x holds the listed rows' activations in list order: Deja Vu's down projection).

Codes are read as words of ``NPE`` nibbles (int32: 8 outputs per load element, when the output
count allows), unpacked with shifts: ``UNPACK=0`` shifts a [rows, words, NPE] tile (batch 1
keeps it 3-D and sums over the rows, a step never crossing a group; the tensor-core and
kept-row paths reshape it to [rows, outputs]); ``UNPACK=1`` loads each word once per output it
holds (the repeats hit L1) and shifts by the output's nibble, a [rows, outputs] tile at once
(gemlite's way, along our other axis) — two ways to the same codes, timed by
``kernels/bench_int4.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace, tuning
from .._common import batch_block, dot_acc, next_pow2, sm_count, upcast_dot
from .._reduce import chunk as chunk_of
from .._reduce import split_reduce
from .half2 import HALF2_OPS, launch_half2
from .tile import launch_tile

__all__ = ["default_config", "int4_gemv_kernel", "launch", "nibbles_per_word"]


@triton.jit
def _codes(p_ptr, rows, use, offs_d, D, stride_p, NPE: tl.constexpr, UNPACK: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """The codes [BLOCK_R, BLOCK_D] (int32, 0..15) of ``rows`` x ``offs_d``; rows not in
    ``use`` are not loaded (zeros)."""
    base = p_ptr + rows.to(tl.int64)[:, None] * stride_p
    if UNPACK == 0:
        # the tile's BLOCK_D // NPE words, in order (D is a multiple of NPE)
        offs_w = tl.program_id(0) * (BLOCK_D // NPE) + tl.arange(0, BLOCK_D // NPE)
        mask_w = offs_w * NPE < D
        words = tl.load(base + offs_w[None, :], mask=use[:, None] & mask_w[None, :], other=0,
                        eviction_policy="evict_first")  # fmt: skip
        shifts = tl.arange(0, NPE) * 4
        q = (words.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_R, BLOCK_D))
    else:
        words = tl.load(base + (offs_d // NPE)[None, :], mask=use[:, None] & (offs_d < D)[None, :],
                        other=0, eviction_policy="evict_first")  # fmt: skip
        q = (words.to(tl.int32) >> ((offs_d % NPE) * 4)[None, :]) & 0xF
    return q


@triton.jit
def int4_gemv_kernel(
    x_ptr,  # [B, K] inputs (MODE 2: [B, n] activations of the listed rows)
    p_ptr,  # [K, D // NPE] codes, NPE nibbles per element (uint8 / int16 / int32 view)
    s_ptr,  # [K // GROUP, D] scales
    m_ptr,  # [K // GROUP, D] mins
    thr_ptr,  # MODE 1: [K] fp32 thresholds (THR_SCALAR: unused)
    thr_value,  # MODE 1 with THR_SCALAR: the one threshold
    idx_ptr,  # MODE 2: [n // RPI] weight row blocks, int32
    b_ptr,  # [D] bias (HAS_BIAS)
    out_ptr,  # [B, D] output
    ws_ptr,  # fp32 partials [n_split, B, D] (serial) or sums [B, D] (atomic)
    count_ptr,  # int32 arrival counters [>= n_col], zero between launches
    B,
    N,  # rows walked: K (MODE 0, 1) or n (MODE 2)
    D,
    stride_xb,
    stride_p,
    stride_ob,
    rows_per_split,
    n_split,
    MODE: tl.constexpr,  # 0 dense, 1 threshold, 2 kept rows
    RPI: tl.constexpr,  # MODE 2: rows per index (1: neurons; d_head: heads of W_O^T)
    THR_SCALAR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    REDUCE: tl.constexpr,  # 0 one split writes out, 1 serial partials, 2 atomics
    GROUP: tl.constexpr,  # input channels per (scale, min)
    NPE: tl.constexpr,  # nibbles per code element (2, 4 or 8)
    UNPACK: tl.constexpr,  # 0 shift-and-reshape, 1 per-output word loads
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_R: tl.constexpr,  # rows per step (a power of two: it divides GROUP or GROUP divides it)
    BLOCK_D: tl.constexpr,  # output columns per program (a multiple of NPE)
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    CHUNK: tl.constexpr,  # partials read per step by the serial reduction
):
    SUB: tl.constexpr = BLOCK_R if BLOCK_R < GROUP else GROUP  # rows of one group in a step
    NG: tl.constexpr = BLOCK_R // SUB  # groups per step
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    offs_k = tl.arange(0, BLOCK_R)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(N, r_lo + rows_per_split)
    # batch 1, aligned rows, shift unpacking: the codes stay a [rows, words, NPE] tile and the
    # sums a [words, NPE] tile (no reshape of the big tile; BLOCK_R <= GROUP, see launch)
    W3: tl.constexpr = BLOCK_B == 1 and MODE != 2 and UNPACK == 0
    offs_w = pid_d * (BLOCK_D // NPE) + tl.arange(0, BLOCK_D // NPE)
    offs_n = tl.arange(0, NPE)
    if W3:
        acc3 = tl.zeros((BLOCK_D // NPE, NPE), tl.float32)
    if BLOCK_B == 1:
        acc = tl.zeros((BLOCK_D,), tl.float32)
    else:
        acc = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        offs_r = r0 + offs_k
        mask_r = offs_r < r_hi
        if MODE == 2:
            rows = tl.load(idx_ptr + offs_r // RPI, mask=mask_r, other=0) * RPI + offs_r % RPI
        else:
            rows = offs_r
        # x: the step's inputs, zero where dropped; use: the rows whose codes are read
        if BLOCK_B == 1:
            x = tl.load(x_ptr + offs_r, mask=mask_r, other=0.0)
            if MODE == 1:
                if THR_SCALAR:
                    keep = tl.abs(x) > thr_value
                else:
                    keep = tl.abs(x) > tl.load(thr_ptr + rows, mask=mask_r, other=float("inf"))
                use = keep & mask_r
                x = tl.where(use, x, tl.zeros_like(x))
            else:
                use = mask_r
        else:
            x = tl.load(x_ptr + offs_b[:, None] * stride_xb + offs_r[None, :],
                        mask=mask_b[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
            if MODE == 1:
                if THR_SCALAR:
                    keep = tl.abs(x) > thr_value
                else:
                    t = tl.load(thr_ptr + rows, mask=mask_r, other=float("inf"))
                    keep = tl.abs(x) > t[None, :]
                keep = keep & mask_b[:, None] & mask_r[None, :]
                x = tl.where(keep, x, tl.zeros_like(x))
                use = tl.max(keep.to(tl.int32), axis=0) > 0  # the union over the tokens
            else:
                use = mask_r
        if W3:
            mask_w = offs_w * NPE < D
            words = tl.load(p_ptr + rows.to(tl.int64)[:, None] * stride_p + offs_w[None, :],
                            mask=use[:, None] & mask_w[None, :], other=0,
                            eviction_policy="evict_first")  # fmt: skip
            q3 = (words.to(tl.int32)[:, :, None] >> (offs_n * 4)[None, None, :]) & 0xF
            xf = x.to(tl.float32)
            xq = tl.sum(xf[:, None, None] * q3.to(tl.float32), axis=0)  # [words, NPE]
            g_use = tl.max(use.to(tl.int32), axis=0) > 0
            sm_offs = (r0 // GROUP) * D + offs_w[:, None] * NPE + offs_n[None, :]
            s = tl.load(s_ptr + sm_offs, mask=g_use & mask_w[:, None], other=0.0)
            m = tl.load(m_ptr + sm_offs, mask=g_use & mask_w[:, None], other=0.0)
            acc3 += s.to(tl.float32) * xq + m.to(tl.float32) * tl.sum(xf, axis=0)
        elif MODE == 2:  # listed rows come from any groups: a (scale, min) row per weight row
            q = _codes(p_ptr, rows, use, offs_d, D, stride_p, NPE, UNPACK, BLOCK_R, BLOCK_D)
            sm_ptrs = (rows // GROUP).to(tl.int64)[:, None] * D + offs_d[None, :]
            sm_mask = use[:, None] & mask_d[None, :]
            s = tl.load(s_ptr + sm_ptrs, mask=sm_mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + sm_ptrs, mask=sm_mask, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s + m
            if BLOCK_B == 1:
                acc += tl.sum(x.to(tl.float32)[:, None] * w, axis=0)
            else:
                acc = dot_acc(x, w.to(x.dtype), acc, UPCAST)
        else:  # the step's rows cover NG whole groups (or lie inside one): aligned scales
            q = _codes(p_ptr, rows, use, offs_d, D, stride_p, NPE, UNPACK, BLOCK_R, BLOCK_D)
            g = (r0 + tl.arange(0, NG) * SUB) // GROUP
            g_use = tl.max(tl.reshape(use.to(tl.int32), (NG, SUB)), axis=1) > 0
            sm_ptrs = g.to(tl.int64)[:, None] * D + offs_d[None, :]
            sm_mask = g_use[:, None] & mask_d[None, :]
            s = tl.load(s_ptr + sm_ptrs, mask=sm_mask, other=0.0).to(tl.float32)  # [NG, BLOCK_D]
            m = tl.load(m_ptr + sm_ptrs, mask=sm_mask, other=0.0).to(tl.float32)
            if BLOCK_B == 1:
                xf = x.to(tl.float32)
                if NG == 1:
                    xq = tl.sum(xf[:, None] * q.to(tl.float32), axis=0)
                    acc += tl.sum(s, axis=0) * xq + tl.sum(m, axis=0) * tl.sum(xf, axis=0)
                else:
                    xq = tl.sum(tl.reshape(xf[:, None] * q.to(tl.float32), (NG, SUB, BLOCK_D)),
                                axis=1)  # fmt: skip
                    xs = tl.sum(tl.reshape(xf, (NG, SUB)), axis=1)
                    acc += tl.sum(s * xq + m * xs[:, None], axis=0)
            else:
                if NG == 1:
                    w = q.to(tl.float32) * s + m
                else:
                    w3 = tl.reshape(q.to(tl.float32), (NG, SUB, BLOCK_D))
                    w = tl.reshape(w3 * s[:, None, :] + m[:, None, :], (BLOCK_R, BLOCK_D))
                acc = dot_acc(x, w.to(x.dtype), acc, UPCAST)
    if W3:
        y = tl.reshape(acc3, (1, BLOCK_D))
    elif BLOCK_B == 1:
        y = acc[None, :]
    else:
        y = acc
    split_reduce(y, ws_ptr, count_ptr, b_ptr, out_ptr, offs_b, offs_d, mask_b, mask_d, B, D,
                 stride_ob, pid_d, pid_s, n_split, REDUCE, HAS_BIAS, CHUNK, False)  # fmt: skip


MODES = {"dense": 0, "threshold": 1, "rows": 2}
TILE_OPS = ("int4_gemv", "int4_threshold_gemv")  # batch 1 runs these on :mod:`.tile`
REDUCE = {"direct": 0, "serial": 1, "atomic": 2}
# the heuristic configs (not yet tuned on a GPU: ``kernels/bench_int4.py --sweep`` times the
# candidates and records them); batch 1: FMA tiles of 128-byte code rows, a few programs per
# multiprocessor; union batches: tensor-core tiles
CONFIG_B1 = {"BLOCK_R": 64, "BLOCK_D": 256, "num_warps": 4, "num_stages": 2,
             "programs_per_sm": 4, "reduce": "serial", "unpack": 0}  # fmt: skip
CONFIG_BATCH = {"BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3,
                "programs_per_sm": 2, "reduce": "serial", "unpack": 0}  # fmt: skip
# per op, what keeps the tile in registers (ptxas for sm_90, Triton 3.7: the threshold tile of
# 64 rows takes 193-224 registers against 124 at 32; the kept-row tile of 64 x 256 with its
# per-row scales spilled, 16 x 256 with the per-output word loads takes 138)
OP_CONFIG = {"int4_threshold_gemv": {"BLOCK_R": 32}, "int4_rows_gemv": {"BLOCK_R": 16, "unpack": 1}}


def default_config(batch: int, d_in: int = 0, d_out: int = 0, *, group: int = 128,
                   op: str = "int4_gemv", device: torch.device | None = None) -> dict:  # fmt: skip
    """The launch configuration for ``batch`` tokens (a copy: callers may change it): at batch 1
    of the dense and threshold GEMVs the half2 kernel of :mod:`.half2` (``mode="half2"``;
    ``"tile"`` asks for :mod:`.tile`, ``"loop"`` for this module's kernel); otherwise the one
    ``kernels/bench_int4.py --tune`` recorded for this GPU, op (``int4_gemv``,
    ``int4_threshold_gemv``), group and nearest shape (:mod:`~dejavu_lab.kernels.tuning`,
    table ``tuned/tuning_int4_gemv.json``), else the heuristic.

    >>> default_config(1, 4096, 14336)["mode"], default_config(16)["BLOCK_D"]
    ('half2', 128)
    """
    tile = batch == 1 and op in TILE_OPS and d_out % 8 == 0
    if device is not None and d_in and d_out:
        tuned = tuning.lookup(f"{op}_g{group}", d_in, d_out, None, batch, device)
        # batch 1: the loop configs the table holds lost to the one-token kernels at every
        # shape and kept fraction timed, so only a tuned tile or half2 config replaces them
        if tuned is not None and (not tile or tuned.get("mode") in ("tile", "half2")):
            return tuned
    if tile:  # half2 decoding beat the tile at every shape timed (:mod:`.half2`)
        return dict(HALF2_OPS[op])
    return {**(CONFIG_B1 if batch == 1 else CONFIG_BATCH), **OP_CONFIG.get(op, {})}


def nibbles_per_word(d_out: int) -> int:
    """Codes per loaded element: 8 (int32 words) when the outputs allow, else 4 or 2.

    >>> nibbles_per_word(4096), nibbles_per_word(4100), nibbles_per_word(6)
    (8, 4, 2)
    """
    return 8 if d_out % 8 == 0 else 4 if d_out % 4 == 0 else 2


def launch(xb: torch.Tensor, w, res2: torch.Tensor, cfg: dict, *, mode: str, thr=None,
           idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           rows_per_index: int = 1, activation: str = "none", gated: bool = False,
           lists=None) -> None:  # fmt: skip
    """Run :func:`int4_gemv_kernel` on checked inputs (``cfg["mode"]`` ``"tile"`` or ``"half2"``
    with one token of a dense or threshold GEMV: :func:`~.tile.launch_tile` or
    :func:`~.half2.launch_half2` instead): ``xb`` [B, K]
    (``mode="rows"``: [B, n]),
    ``w`` an Int4Weight on xb's device and dtype, ``res2`` the [B, D] output; ``thr`` a float or
    fp32 [K] (threshold); ``idx`` int32 [n] (rows: blocks of
    ``rows_per_index`` rows). ``cfg``: ``BLOCK_R``, ``BLOCK_D``,
    ``num_warps``, ``num_stages``, ``programs_per_sm`` (or ``programs``, or ``split``: the
    number of row splits), ``reduce`` (serial, atomic) and ``unpack`` (0, 1). ``lists``: the
    token's kept rows (:class:`~.lists.KeptLists`), walked by the half2 kernel (the other
    kernels list nothing and do not need them).

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :8], group=32, dtype=torch.float16)  # w_t [32, 8]
    >>> x, out = torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> launch(x, w, out, default_config(1), mode="dense")  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    one = mode != "rows" and xb.shape[0] == 1 and w.shape[1] % 8 == 0
    if one and cfg.get("mode") in ("tile", "half2"):  # one token: :mod:`.tile`, :mod:`.half2`
        if cfg["mode"] == "half2":
            launch_half2(xb, w, res2, cfg, mode=mode, thr=thr, bias=bias, activation=activation,
                         gated=gated, lists=lists)  # fmt: skip
        else:
            launch_tile(xb, w, res2, cfg, mode=mode, thr=thr, bias=bias, activation=activation,
                        gated=gated)  # fmt: skip
        return
    if activation != "none" or gated:
        raise ValueError("an activation in the epilogue needs the one-token tile or half2 path.")
    batch = xb.shape[0]
    d_out = w.shape[1]
    n = idx.numel() * rows_per_index if mode == "rows" else w.shape[0]
    device = xb.device
    npe = nibbles_per_word(d_out)
    codes = w.packed.view({8: torch.int32, 4: torch.int16, 2: torch.uint8}[npe])
    block_b = batch_block(batch)
    block_r = int(cfg["BLOCK_R"])
    unpack = int(cfg.get("unpack", 0))
    if batch == 1 and mode != "rows" and unpack == 0:
        block_r = min(block_r, w.group)  # the [rows, words, NPE] path: a step inside one group
    block_d = min(int(cfg["BLOCK_D"]), max(16, next_pow2(d_out)))
    if block_r & (block_r - 1) or block_d & (block_d - 1) or block_d < max(npe, 8):
        raise ValueError(f"config BLOCK_R={block_r} and BLOCK_D={block_d} must be powers of two.")
    if block_b > 1 and block_r < 16:
        raise ValueError("config BLOCK_R must be >= 16 for batches above 1 (tensor-core path).")
    n_col = triton.cdiv(d_out, block_d)
    if cfg.get("split"):
        want = int(cfg["split"])
    else:
        programs = cfg.get("programs") or round(cfg.get("programs_per_sm", 4) * sm_count(device))
        want = triton.cdiv(max(1, int(programs)), n_col)
    want = max(1, min(want, triton.cdiv(max(n, 1), block_r)))
    rows_per_split = triton.cdiv(triton.cdiv(max(n, 1), want), block_r) * block_r
    n_split = triton.cdiv(max(n, 1), rows_per_split)
    reduce = "direct" if n_split == 1 else cfg.get("reduce", "serial")
    if reduce not in REDUCE:
        raise ValueError(f"config reduce={reduce!r} is not 'serial' or 'atomic'.")
    if reduce == "serial":
        ws = _workspace.partials(device, n_split * batch * d_out)
    elif reduce == "atomic":
        ws = _workspace.sums(device, batch * d_out)
    else:
        ws = res2
    counts = _workspace.counters(device, n_col) if n_split > 1 else ws
    scalar = mode == "threshold" and not isinstance(thr, torch.Tensor)
    thr_ptr = thr if isinstance(thr, torch.Tensor) else ws
    thr_value = float(thr) if scalar else 0.0
    chunk = chunk_of(n_split, max(1, 32 * 32 * cfg["num_warps"] // (block_b * block_d)))
    int4_gemv_kernel[(n_col, n_split)](
        xb, codes, w.scales, w.mins, thr_ptr, thr_value, idx if idx is not None else ws,
        bias if bias is not None else ws, res2, ws, counts, batch, n, d_out, xb.stride(0),
        codes.stride(0), res2.stride(0), rows_per_split, n_split, MODE=MODES[mode], RPI=rows_per_index,
        THR_SCALAR=scalar, HAS_BIAS=bias is not None, REDUCE=REDUCE[reduce], GROUP=w.group,
        NPE=npe, UNPACK=unpack, BLOCK_B=block_b, BLOCK_R=block_r,
        BLOCK_D=block_d, UPCAST=upcast_dot(xb.dtype), CHUNK=chunk, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip
