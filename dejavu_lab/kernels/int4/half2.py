"""The batch-1 int4 GEMV that decodes codes into half2 pairs: two weights per instruction.

:mod:`.tile` turns each nibble into an fp32 float (shift, mask, convert) and multiplies it with
one FMA: about seven instructions per weight in its SASS (sm_90), so at batch 1 the GEMV is
bound by instruction issue, not by its bytes. Here one 32-bit word of codes (eight outputs of
one input row) becomes four half2 registers (:mod:`.half2_decode`: the magic-number trick of
FasterTransformer and Marlin, one shift per word) and one ``fma.rn.f16x2`` per pair adds them
times the row's activation to a half2 accumulator; the code row stride is a compile-time
constant, so each row's load sits at an immediate offset: about 2.5 instructions per weight in
the SASS of a 32-row, 4-words-per-thread program.

Each program owns ``ROWS`` input rows of one group and ``BLOCK_D`` outputs. Its activations are
divided by their largest magnitude first (so the fp16 sums cannot overflow, whatever the
activations' scale or dtype, bf16 included), the rows are walked inside each
thread (the row's activation is the same in every thread: a broadcast, no reduction across
threads), and every ``SUB`` rows the half2 sums are added to fp32 ones. Then

    ``y[o] += p s[g, o] sum_r x'[r] (q[r, o] - 8)  +  (m[g, o] + 8 s[g, o]) sum_r x[r]``

(``p`` the magnitude divided out) goes to an fp32 workspace with relaxed atomics, and the
finishing launch of :mod:`.tile` rounds it into the output (``fused=1``: no second launch, the
last program of each column tile to arrive does it, :func:`~dejavu_lab.kernels._reduce.
split_reduce`). Rows are walked eight at a time, the eight loads written before their
arithmetic (in the sm_90 SASS of a 64 x 512 program the first product waits on six code
loads, three when the rows were written one at a time; ptxas then keeps about one row ahead),
and the group's scales and mins are loaded before the walk. Threshold mode (TEAL / WINA): the program
builds a register mask of its kept rows once per 64 rows; a dropped row's code load is
predicated off (no bytes move) and its activation is zero, with no branch, so no load waits on
another; its decode still costs issue slots. ``compact=1`` instead lists the program's kept
rows first (each with its scaled activation) and walks the list eight rows at a time, so a
dropped row costs neither bytes nor instructions, at the price of a list written, a barrier
and a dependent load before the first code load; with ``lists`` (:mod:`.lists`) x's
producer made them once per token, and the program reads its block's count, scale and sum and
goes straight to the codes. (Finding the kept rows in the register mask
instead, one ``ffs`` per row, ran slower than the list at every shape and kept fraction on an
H100: more instructions per row than the list's load saves.)

The fp16 sums of ``SUB`` products make this kernel less exact than :mod:`.tile`: a relative
error of about 2e-3 against the fp32 reference where the tile kernel has 2e-5 (an H100 on
random Llama-shaped weights, ``SUB = 32``), far below int4's own error against the fp16
weights (~10% per weight). The inline PTX runs only when compiled for a GPU; under
``TRITON_INTERPRET=1`` (``ASM=False``) the same decode and centring run on a whole
[rows, words] tile at once, each product rounded to fp16 and the sums taken in fp32: the CPU
tests check the layout, the centring and the scales, and the GPU tests the half2 sums.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._neurons import act
from .._reduce import split_reduce
from ..pdl import await_inputs, pdl_args
from .half2_decode import _bits, _emulated, _flush, _half, _joined
from .half2_rows import _ahead, _block_bits, _eight, _first_eight, _walk_eight
from .tile import finish

__all__ = ["AHEAD", "HALF2", "HALF2_OPS", "READ_AHEAD", "int4_half2_kernel", "launch_half2"]

#: The pointers the kernel reads before it waits for the kernel before it (programmatic
#: dependent launch, :mod:`~dejavu_lab.kernels.pdl`): weights only, which no kernel writes.
READ_AHEAD = ("p_ptr", "s_ptr", "m_ptr")
#: Under programmatic dependent launch, read the dense walk's first eight rows before the wait
#: too (``DEJAVU_INT4_AHEAD=1``), not only the scales and mins. Off by default: on an H100
#: (Llama-3-8B shape, ``results/engine_int4_8b_pdl_*.json`` at 1f5321a) it took the int4 dense
#: step from 2.628 ms (no PDL) to 2.570 where each kernel launched as the one before exited, but
#: to 2.718 where the kernel before let it launch early (:data:`~dejavu_lab.kernels.pdl.EARLY`);
#: back to back, the dense kernel alone went from 13.5 to 15.9 µs a call
#: (``results/int4_gemv_g128_b1_pdl.json``), while the threshold kernel, which never reads
#: ahead, gained from the early launch.
AHEAD = os.environ.get("DEJAVU_INT4_AHEAD", "0") == "1"

# ROWS x BLOCK_D per program, SUB rows per fp16 sum. Chosen by kernels/bench_int4.py on an H100
# (results/int4_gemv_g128_b1.json at 54b3baa, group 128, CUDA-graph replay, cold weights): at
# 4096->14336, 14336->4096 and 5120->13824 dense 15.6 / 16.3 / 17.9 µs against the fp32 tile's
# 22.8 / 22.5 / 26.4 and gemlite's 20.7 / 20.5 / 23.3 (a plain read of the same bytes: 11.7 /
# 11.7 / 14.0); the threshold GEMV on a list of the kept rows of 64 (compact) 14.4 / 13.6 /
# 15.5 µs at 50% kept and 9.9 / 10.3 / 10.5 at 20%, against 14.1 / 14.5 / 16.5 and 10.0 / 10.6
# / 10.8 for the masked walk. The fused epilogue (fused=1) ran 4-5 µs slower than the
# finishing launch at every shape: its fence and counter wait per program.
HALF2 = {"mode": "half2", "ROWS": 64, "SUB": 32, "BLOCK_D": 512, "num_warps": 2}
HALF2_OPS = {
    "int4_gemv": HALF2,
    "int4_threshold_gemv": {**HALF2, "SUB": 16, "compact": 1},
}


@triton.jit
def _x_of(x_ptr, xb_ptr, offs, K, ACT_X: tl.constexpr, GATED_X: tl.constexpr,
          HAS_XBIAS: tl.constexpr, ty: tl.constexpr):  # fmt: skip
    """x at ``offs`` in fp32: the input token, or (``ACT_X``) a previous launch's fp32 sums
    finished here, ``act(gate + b)`` (``GATED_X``: times ``up + b``, the sums' halves [2K]),
    rounded to ``ty`` as a finishing launch would store it."""
    if ACT_X == "":
        return tl.load(x_ptr + offs).to(tl.float32)
    a = tl.load(x_ptr + offs)
    if HAS_XBIAS:
        a += tl.load(xb_ptr + offs).to(tl.float32)
    a = act(a, ACT_X)
    if GATED_X:
        u = tl.load(x_ptr + K + offs)
        if HAS_XBIAS:
            u += tl.load(xb_ptr + K + offs).to(tl.float32)
        a = a * u
    return a.to(ty).to(tl.float32)


@triton.jit
def int4_half2_kernel(
    x_ptr,  # [K] the input token (fp16 or bf16)
    p_ptr,  # [K, D // 8] codes, int32 words of 8 nibbles (output 8j + k in bits 4k..4k+3)
    s_ptr,  # [K // GROUP, D] scales
    m_ptr,  # [K // GROUP, D] mins
    thr_ptr,  # MODE 1: [K] fp32 thresholds (THR_SCALAR: unused)
    thr_value,  # MODE 1 with THR_SCALAR: the one threshold
    ws_ptr,  # [D] fp32 sums, zero between launches
    list_ptr,  # COMPACT: int32 [programs * ROWS] kept-row lists, one slice per program (ACT_X:
    # each program's finished x, as fp32 bits)
    count_ptr,  # FUSED: int32 arrival counters [>= column tiles], zero between launches
    b_ptr,  # FUSED with HAS_BIAS: [D] bias
    out_ptr,  # FUSED: [D] output
    D,
    STRIDE_P: tl.constexpr,  # words per code row (a constant: row offsets become immediates)
    MODE: tl.constexpr,  # 0 dense, 1 threshold
    THR_SCALAR: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: no column mask
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program: divides GROUP
    SUB: tl.constexpr,  # rows per fp16 sum: divides ROWS
    BLOCK_D: tl.constexpr,  # outputs per program, a multiple of 8
    ASM: tl.constexpr,  # the inline PTX (compiled for a GPU) or its emulation (interpreter)
    COMPACT: tl.constexpr,  # MODE 1: walk a list of the kept rows
    FUSED: tl.constexpr,  # the last program of a column tile writes the output (no 2nd launch)
    HAS_BIAS: tl.constexpr,
    xb_ptr=None,  # ACT_X with HAS_XBIAS: [K] (GATED_X: [2K]) the bias of x's sums
    K=0,  # ACT_X: the rows (GATED_X: the up half of x's sums starts at K)
    ACT_X: tl.constexpr = "",  # x is fp32 sums [K] (GATED_X: [gate | up]): act(x + xb) first
    GATED_X: tl.constexpr = False,
    HAS_XBIAS: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # launched with launch_pdl (pdl.pdl_args)
    AHEAD: tl.constexpr = False,  # under PDL: the dense walk's first eight rows before the wait
    meta_ptr=None,  # LISTED: int32 [K // ROWS, 4] each block's count, scale and sum (.lists)
    LISTED: tl.constexpr = False,  # MODE 1, COMPACT: list_ptr holds the token's kept lists
):
    NW: tl.constexpr = BLOCK_D // 8
    ty: tl.constexpr = s_ptr.dtype.element_ty
    pid_d = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    offs_w = pid_d * NW + tl.arange(0, NW)
    mask_w = (offs_w * 8 < D) | EVEN_D
    # the group's scales and mins first, in flight with the codes (loaded last, they were a
    # round trip of their own after the walk)
    sm = (r0 // GROUP) * D + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    s = tl.load(s_ptr + sm, mask=mask_w[:, None], other=0.0)
    m = tl.load(m_ptr + sm, mask=mask_w[:, None], other=0.0)
    pw = p_ptr + r0.to(tl.int64) * STRIDE_P + offs_w  # row r0's words; the rest at constants
    READ_FIRST: tl.constexpr = ASM and MODE == 0 and AHEAD and PDL != 0
    if READ_FIRST:  # the dense walk's first rows too: no kernel writes them
        q0, q1, q2, q3, q4, q5, q6, q7 = _ahead(pw, mask_w, STRIDE_P, EVEN_D)
    if PDL:  # only now the input, the workspace and the stash: the kernel before is done
        await_inputs(PDL)
    if LISTED:  # the block's list was made with x (.lists): its count, scale and sum
        mp = meta_ptr + tl.program_id(1) * 4
        n = tl.load(mp)
        scale = tl.load(mp + 1).to(tl.float32, bitcast=True)
        xsum = tl.load(mp + 2).to(tl.float32, bitcast=True)
    else:
        offs_x = r0 + tl.arange(0, ROWS)
        xs = _x_of(x_ptr, xb_ptr, offs_x, K, ACT_X, GATED_X, HAS_XBIAS, ty)
        if MODE == 1:
            if THR_SCALAR:
                xs = tl.where(tl.abs(xs) > thr_value, xs, 0.0)
            else:
                xs = tl.where(tl.abs(xs) > tl.load(thr_ptr + offs_x), xs, 0.0)
        amax = tl.max(tl.abs(xs), axis=0)
        scale = tl.where(amax > 0, amax, 1.0)
        inv = 1.0 / scale
        xsum = tl.sum(xs, axis=0)
    f0 = tl.zeros((NW,), tl.float32)
    f1 = tl.zeros((NW,), tl.float32)
    f2 = tl.zeros((NW,), tl.float32)
    f3 = tl.zeros((NW,), tl.float32)
    f4 = tl.zeros((NW,), tl.float32)
    f5 = tl.zeros((NW,), tl.float32)
    f6 = tl.zeros((NW,), tl.float32)
    f7 = tl.zeros((NW,), tl.float32)
    xp = x_ptr + r0  # the walks read each row's activation here, or (ACT_X) from a stash
    if ASM and ACT_X != "" and not (MODE == 1 and COMPACT == 1):  # (the list holds its own)
        xp = list_ptr + (tl.program_id(1) * tl.num_programs(0) + pid_d) * ROWS
        tl.store(xp + tl.arange(0, ROWS), xs.to(tl.int32, bitcast=True))  # fp32 bits, once
        tl.debug_barrier()
    if MODE == 1 and COMPACT == 1:  # the kept rows listed first, then walked SUB at a time
        if LISTED:
            base = list_ptr + r0
        else:
            keep = xs != 0
            n = tl.sum(keep.to(tl.int32), axis=0)
            pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            # one int32 per kept row: its fp16 activation (divided by amax) high, its offset low
            entry = (_bits((xs * inv).to(tl.float16)) << 16) | tl.arange(0, ROWS)
            base = list_ptr + (tl.program_id(1) * tl.num_programs(0) + pid_d) * ROWS
            tl.store(base + pos, entry, mask=keep)
            tl.debug_barrier()  # the list is written by every thread and read by all
        if ASM:
            for c in range(0, n, SUB):
                a0 = tl.zeros((NW,), tl.int32)
                a1 = tl.zeros((NW,), tl.int32)
                a2 = tl.zeros((NW,), tl.int32)
                a3 = tl.zeros((NW,), tl.int32)
                for k in tl.static_range(SUB // 8):
                    a0, a1, a2, a3 = _eight(base, c + 8 * k, n, r0, p_ptr, STRIDE_P, offs_w, mask_w,
                                            a0, a1, a2, a3)  # fmt: skip
                f0, f1, f2, f3, f4, f5, f6, f7 = _flush(f0, f1, f2, f3, f4, f5, f6, f7,
                                                        a0, a1, a2, a3)  # fmt: skip
            sums = _joined(f0, f1, f2, f3, f4, f5, f6, f7)
        else:  # the interpreter: the listed rows as one [rows, words] tile
            j = tl.arange(0, ROWS)
            e = tl.load(base + j, mask=j < n, other=0)
            rows = r0 + (e & 0xFFFF)
            words = tl.load(p_ptr + rows.to(tl.int64)[:, None] * STRIDE_P + offs_w[None, :],
                            mask=(j < n)[:, None] & mask_w[None, :], other=0)  # fmt: skip
            xh = _half((e >> 16) & 0xFFFF)
            sums = _emulated(words, xh)
    elif ASM:  # each thread walks the rows; half2 sums of SUB rows, then fp32
        kbits = tl.zeros((), tl.int64)
        for c in tl.static_range(ROWS // SUB):
            if MODE == 1 and (c * SUB) % 64 == 0:  # the kept rows of the 64 walked next
                kbits = _block_bits(xs, (c * SUB) // 64, ROWS)
            a0 = tl.zeros((NW,), tl.int32)  # half2 (0, 0)
            a1 = tl.zeros((NW,), tl.int32)
            a2 = tl.zeros((NW,), tl.int32)
            a3 = tl.zeros((NW,), tl.int32)
            for k in tl.static_range(SUB // 8):
                if READ_FIRST and c == 0 and k == 0:  # read ahead
                    a0, a1, a2, a3 = _first_eight(q0, q1, q2, q3, q4, q5, q6, q7, xp, inv,
                                                  ACT_X != "", a0, a1, a2, a3)  # fmt: skip
                else:
                    a0, a1, a2, a3 = _walk_eight(pw, xp, kbits, inv, mask_w, c * SUB + 8 * k,
                                                 STRIDE_P, MODE, EVEN_D, ACT_X != "", a0, a1, a2,
                                                 a3)  # fmt: skip
            f0, f1, f2, f3, f4, f5, f6, f7 = _flush(f0, f1, f2, f3, f4, f5, f6, f7, a0, a1, a2, a3)
        sums = _joined(f0, f1, f2, f3, f4, f5, f6, f7)
    else:  # the interpreter: the same decode and centring on a [ROWS, words] tile at once
        offs_r = r0 + tl.arange(0, ROWS)
        if MODE == 1:
            use = mask_w[None, :] & (xs != 0)[:, None]
        else:
            use = mask_w[None, :] & (offs_r >= 0)[:, None]
        words = tl.load(p_ptr + offs_r.to(tl.int64)[:, None] * STRIDE_P + offs_w[None, :],
                        mask=use, other=0)  # fmt: skip
        xh = (xs * inv).to(tl.float16)
        sums = _emulated(words, xh)
    sums = sums * scale
    s = s.to(tl.float32)
    m = m.to(tl.float32)
    y = tl.reshape(s * sums + (m + 8.0 * s) * xsum, (BLOCK_D,))
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    if FUSED:  # fp32 atomics, then the last arrival rounds the sums into the output
        offs_b = tl.arange(0, 1)
        split_reduce(y[None, :], ws_ptr, count_ptr, b_ptr, out_ptr, offs_b, offs_d, offs_b < 1,
                     (offs_d < D) | EVEN_D, 1, D, 0, pid_d, tl.program_id(1), tl.num_programs(1),
                     REDUCE=2, HAS_BIAS=HAS_BIAS, CHUNK=1, FENCE=ASM)  # fmt: skip
    else:
        tl.atomic_add(ws_ptr + offs_d, y, mask=(offs_d < D) | EVEN_D, sem="relaxed")


def launch_half2(xb: torch.Tensor, w, res2: torch.Tensor | None, cfg: dict, *, mode: str,
                 thr=None, bias: torch.Tensor | None = None, activation: str = "none",
                 gated: bool = False, kind: str = "sums", x_act: str = "",
                 x_gated: bool = False, x_bias=None, lists=None) -> torch.Tensor | None:  # fmt: skip
    """Run :func:`int4_half2_kernel` and the finishing launch on checked inputs: ``xb`` [1, K],
    ``w`` an Int4Weight on xb's device and dtype with ``d_out % 8 == 0``, ``res2`` the [1, D]
    output ([1, D / 2] when ``gated``: :func:`~.tile.finish`); ``mode`` dense or threshold
    (``thr`` a float or fp32 [K]). ``cfg``: ``ROWS`` (a power of two dividing the group),
    ``SUB`` (a multiple of 8 dividing ``ROWS``), ``BLOCK_D`` (a power of two >= 8),
    ``num_warps``; optional ``compact`` (threshold mode: 1 walks a list of the kept rows) and
    ``fused`` (no finishing launch). ``res2=None`` skips the finishing launch and returns the
    fp32 sums' [D] view of the workspace, for the next launch to take and zero
    (:func:`~.sums.int4_sums`); ``kind`` names that workspace. ``x_act``: xb is a previous
    launch's fp32 sums, finished as each program loads them, ``x_act(xb + x_bias)``
    (``x_gated``: ``act(gate) * up`` of its halves [1, 2K]). ``lists``: the token's kept rows
    (:class:`~.lists.KeptLists`, threshold mode, made from xb at ``thr``), walked as they are
    (``compact=1`` with ``ROWS`` the lists' block), so xb and thr are not read.

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :8], group=32, dtype=torch.float16)  # w_t [32, 8]
    >>> x, out = torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> launch_half2(x, w, out, HALF2, mode="dense")  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    d_in, d_out = w.shape
    rows = min(int(cfg["ROWS"]), w.group)
    sub = min(int(cfg["SUB"]), rows)
    block_d = min(int(cfg["BLOCK_D"]), triton.next_power_of_2(d_out))
    compact = int(cfg.get("compact", 0)) if mode == "threshold" else 0
    if lists is not None:
        if mode != "threshold" or x_act or lists.rows > w.group or w.group % lists.rows:
            raise ValueError("kept lists feed a threshold product of x itself, in blocks that "
                             f"divide the group of {w.group} rows.")  # fmt: skip
        if lists.entries.numel() != d_in:
            raise ValueError(f"the kept lists hold {lists.entries.numel()} rows; w has {d_in}.")
        rows, compact, thr = lists.rows, 1, 0.0  # (x and thr were read by the lists' maker)
        sub = min(sub, rows)
    if compact not in (0, 1):
        raise ValueError(f"config compact={compact} is not 0 (mask every row) or 1 (list the "
                         "kept rows).")  # fmt: skip
    if rows & (rows - 1) or block_d & (block_d - 1) or block_d < 8 or w.group % rows or rows % sub:
        raise ValueError(f"config ROWS={rows} (dividing the group {w.group}), SUB={sub} "
                         f"(dividing ROWS) and BLOCK_D={block_d} (>= 8) must be powers of two.")  # fmt: skip
    if sub % 8:
        raise ValueError(f"config SUB={sub} must be a multiple of 8 (rows are read eight at a "
                         "time).")  # fmt: skip
    if xb.shape[0] != 1 or d_out % 8:
        raise ValueError("the half2 kernel runs one token with d_out a multiple of 8.")
    codes = w.packed.view(torch.int32)
    ws = _workspace.buffer(xb.device, kind, d_out, torch.float32)
    scalar = mode == "threshold" and not isinstance(thr, torch.Tensor)
    grid = (triton.cdiv(d_out, block_d), d_in // rows)
    stash = compact == 1 or bool(x_act)  # kept-row lists, or the finished x of each program
    if lists is not None:
        stash, meta = lists.entries, lists.meta
    else:
        stash = _workspace.rows(xb.device, grid[0] * grid[1] * rows) if stash else ws
        meta = ws
    # the fused epilogue rounds each column tile alone: an activation (gated: of two tiles) needs
    # the finishing launch
    fused = bool(cfg.get("fused", 0)) and activation == "none" and not gated and res2 is not None
    counts = _workspace.counters(xb.device, grid[0]) if fused else ws
    int4_half2_kernel[grid](
        xb, codes, w.scales, w.mins, thr if isinstance(thr, torch.Tensor) else ws,
        float(thr) if scalar else 0.0, ws, stash, counts, bias if bias is not None else ws,
        ws if res2 is None else res2,
        d_out, codes.stride(0),  # STRIDE_P
        MODE=1 if mode == "threshold" else 0, THR_SCALAR=scalar, EVEN_D=d_out % block_d == 0,
        GROUP=w.group, ROWS=rows,
        SUB=sub, BLOCK_D=block_d, ASM=xb.device.type == "cuda", COMPACT=compact, FUSED=fused,
        HAS_BIAS=bias is not None, xb_ptr=x_bias if x_bias is not None else ws, K=d_in,
        ACT_X=x_act, GATED_X=x_gated, HAS_XBIAS=x_bias is not None,
        AHEAD=AHEAD, meta_ptr=meta, LISTED=lists is not None, num_warps=int(cfg["num_warps"]),
        num_stages=1,
        **pdl_args(xb.device),
    )  # fmt: skip
    if res2 is None:
        return ws[:d_out]
    if not fused:
        finish(ws, res2, bias, activation, gated)
    return None
