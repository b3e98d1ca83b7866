"""The batch-1 kept-row GEMV over rows-layout int4 codes, decoded into half2 pairs.

:func:`~.up.int4_up_kernel` turns each nibble into an fp32 float and reduces its tile across
threads at every step: at one token it ran DejaVu's up projection and CATS's gate and up rows
at about a tenth of the copy ceiling (an H100, Llama-3-8B shapes). Here a row of
:class:`~dejavu_lab.quant.Int4Rows` (``W[j]``, one 32-bit word per eight consecutive inputs,
input ``8w + n`` in bits ``4n .. 4n + 3``) is decoded as :mod:`.half2` decodes a column word,
with the activations paired instead of the outputs: pair ``p`` of word ``w`` holds the centred
codes of inputs ``8w + p`` and ``8w + p + 4`` (``lop3`` with ``0x64006400``, then ``sub.f16x2``
of 1032, or for a high nibble ``fma.rn.f16x2`` by 1/16 and -72; all exact), and one
``fma.rn.f16x2`` by the half2 ``(x[8w + p], x[8w + p + 4])`` adds them to a half2 sum. The
word's eight products leave the PTX as one fp32 number. Each thread owns whole words, so a
program's ``BLOCK_N x BLOCK_K / 8`` words need no reduction until the end of the row:

    ``y[j] = p sum_w s[j, g(w)] dot8(w) + sum_w (m[j, g(w)] + 8 s[j, g(w)]) sum_{i in w} x[i]``

with ``x`` divided by its largest magnitude ``p`` before the fp16 products (they cannot
overflow, whatever the activations' scale or dtype). :func:`int4_pairs_kernel` does that once
per token: it writes x's half2 pairs, each word's input sum and ``1 / p`` to a workspace that
every program reads. A step of ``BLOCK_K`` inputs inside one group takes one (scale, min) per
row; a longer step gathers each word's. Gated rows (DejaVu, dense) walk their gate and up rows
together, twice the loads in flight per step; ``SPLIT`` programs along the inputs add fp32
partial sums and leave the activation to the finishing launch of :mod:`.tile`. The modes are
:func:`~.up.int4_up_kernel`'s: every row, listed rows (blocks of ``RPI``), and CATS (every gate
row, then the up rows of the neurons whose ``|act(gate)|`` passes the threshold; a program
with none skips its up pass; one program along the inputs).
Under ``TRITON_INTERPRET=1`` (``ASM=False``) each product is rounded to fp16 and summed in
fp32, so the CPU tests check the layout, the pairing, the centring and the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._neurons import act
from .half2_decode import DECODE_CONSTANTS, DECODE_REGS, _bits, centre_ptx
from .tile import finish

__all__ = ["CATS_HALF2", "UP_HALF2", "int4_pairs_kernel", "int4_up_half2_kernel", "launch_up_half2"]

# BLOCK_N rows (gated: BLOCK_N gate and BLOCK_N up rows) x BLOCK_K inputs per step, SPLIT
# programs along the inputs. Chosen by kernels/bench_int4_rows.py's sweep on an H100
# (results/int4_rows_b1_sweep.json, group 128, fp16, CUDA-graph replay, cold weights): DejaVu's up
# projection over half of Llama-3-8B's 14336 neurons in 25.3 µs against 36.0 for one program
# per row block (16 x 128 on one warp) and 28.0 for two; a step spanning two groups (gathering
# a scale per word) ran 1.7-2x slower at every tiling. CATS, whose up rows wait on the gate's
# sums in the same program, cannot split: it keeps 16 x 128 on one warp (55.4 µs for the gate
# and half the up rows of Llama-3-8B in results/int4_rows_b1.json, 62.2 at 32 rows in the sweep's).
UP_HALF2 = {"mode": "half2", "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 1, "num_stages": 3,
            "SPLIT": 4}  # fmt: skip
CATS_HALF2 = {"mode": "half2", "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 1, "num_stages": 3}


def _dot8_ptx() -> str:
    """One word's eight products: ``$0`` their fp32 sum (as b32), ``$1`` the word, ``$2-$5``
    the half2 activations of pairs 0-3 (inputs ``p`` and ``p + 4`` of the word; the pairs
    decoded as :mod:`.half2` decodes them, :func:`~.half2_decode.centre_ptx`)."""
    steps = []
    for p, src in enumerate(("$1", "$1", "u", "u")):
        add = f"mul.rn.f16x2 a, t, ${2 + p};\n" if p == 0 else f"fma.rn.f16x2 a, t, ${2 + p}, a;\n"
        steps.append(centre_ptx(p, src) + add)
    return ("{\n.reg .b32 " + DECODE_REGS + ", a;\n.reg .b16 l, h;\n.reg .f32 fl, fh;\n"
            + DECODE_CONSTANTS + "shr.u32 u, $1, 8;\n" + "".join(steps)
            + "mov.b32 {l, h}, a;\ncvt.f32.f16 fl, l;\ncvt.f32.f16 fh, h;\n"
            "add.f32 fl, fl, fh;\nmov.b32 $0, fl;\n}\n")  # fmt: skip


_DOT8 = tl.constexpr(_dot8_ptx())


@triton.jit
def _pair(a, b):
    """The half2 ``(a, b)`` of two fp16 vectors, as int32 bits."""
    return _bits(a) | (_bits(b) << 16)


@triton.jit
def _emul(words, xp, n_words):
    """The interpreter's stand-in for :data:`_DOT8` over a [rows, words] tile, in one
    expression (the interpreter pays about 0.2 ms a program for each nested jit call): the centred
    codes of inputs ``8w + p`` and ``8w + p + 4`` (nibbles ``p`` and ``p + 4``) times their fp16
    activations (the halves of pair ``p``, read at ``xp + p * n_words``), each product rounded
    to fp16, summed in fp32."""
    p = tl.arange(0, 4)
    pairs = tl.load(xp[:, None] + p[None, :] * n_words)  # [words, 4]
    lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = ((pairs >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    x = tl.join(lo, hi)  # [words, 4, 2]: input 8w + p + 4h at [w, p, h]
    shift = 4 * p[:, None] + 16 * tl.arange(0, 2)[None, :]  # nibble p + 4h
    q = (((words[:, :, None, None] >> shift[None, None, :, :]) & 0xF) - 8).to(tl.float16)
    return tl.sum(tl.sum((q * x[None, :, :, :]).to(tl.float32), axis=3), axis=2)


@triton.jit
def int4_pairs_kernel(x_ptr, xp_ptr, xw_ptr, inv_ptr, D, BLOCK_W: tl.constexpr):
    """One program, once per token: ``x`` divided by its largest magnitude, as the four half2
    pairs of each word (``xp[p, w] = (x'[8w + p], x'[8w + p + 4])``), each word's eight inputs
    summed (``xw``, unscaled fp32), and the divisor's inverse (``inv``)."""
    NW = D // 8
    offs_w = tl.arange(0, BLOCK_W)
    offs_8 = tl.arange(0, 8)
    amax = tl.zeros((BLOCK_W, 8), tl.float32)
    for w0 in range(0, NW, BLOCK_W):
        m = (w0 + offs_w < NW)[:, None]
        xt = tl.load(x_ptr + (w0 + offs_w)[:, None] * 8 + offs_8[None, :], mask=m, other=0.0)
        amax = tl.maximum(amax, tl.abs(xt.to(tl.float32)))
    peak = tl.max(tl.max(amax, axis=1), axis=0)
    inv = 1.0 / tl.where(peak > 0, peak, 1.0)
    for w0 in range(0, NW, BLOCK_W):
        mw = w0 + offs_w < NW
        xt = tl.load(x_ptr + (w0 + offs_w)[:, None] * 8 + offs_8[None, :], mask=mw[:, None],
                     other=0.0).to(tl.float32)  # fmt: skip
        tl.store(xw_ptr + w0 + offs_w, tl.sum(xt, axis=1), mask=mw)
        xh = tl.permute(tl.reshape((xt * inv).to(tl.float16), (BLOCK_W, 2, 4)), (0, 2, 1))
        lo, hi = tl.split(xh)  # [words, 4]: inputs 8w + p and 8w + p + 4
        pairs = _pair(lo, hi)
        offs_p = tl.arange(0, 4)
        tl.store(xp_ptr + offs_p[None, :] * NW + (w0 + offs_w)[:, None], pairs, mask=mw[:, None])
    tl.store(inv_ptr + tl.arange(0, 1), inv + tl.zeros((1,), tl.float32))


@triton.jit
def _rows(p_ptr, s_ptr, m_ptr, rows, use, xp_ptr, xw_ptr, D, k_lo, k_hi, STRIDE_P: tl.constexpr,
          stride_s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          ASM: tl.constexpr):  # fmt: skip
    """Two [BLOCK_N] fp32 sums of ``dequant(W)[rows] . x`` over inputs ``k_lo`` to ``k_hi``:
    the codes times the scaled pairs (to multiply by the magnitude) and the mins times the
    word sums; rows not in ``use`` read no bytes (their value is meaningless)."""
    NW: tl.constexpr = BLOCK_K // 8
    n_words = D // 8
    offs_w = tl.arange(0, NW)
    p_rows = p_ptr + rows.to(tl.int64)[:, None] * STRIDE_P + offs_w[None, :]
    sm_rows = rows.to(tl.int64) * stride_s
    accq = tl.zeros((BLOCK_N, NW), tl.float32)
    accm = tl.zeros((BLOCK_N, NW), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = k0 // 8 + offs_w
        if BLOCK_K <= GROUP:  # one (scale, min) per row in a step
            words = tl.load(p_rows + k0 // 8, mask=use[:, None], other=0,
                            eviction_policy="evict_first")  # fmt: skip
            s = tl.load(s_ptr + sm_rows + k0 // GROUP, mask=use, other=0.0).to(tl.float32)[:, None]
            m = tl.load(m_ptr + sm_rows + k0 // GROUP, mask=use, other=0.0).to(tl.float32)[:, None]
        else:  # several groups per step: each word's (scale, min), gathered (cached)
            mask = use[:, None] & (w < n_words)[None, :]
            words = tl.load(p_rows + k0 // 8, mask=mask, other=0, eviction_policy="evict_first")
            sm = sm_rows[:, None] + ((k0 + 8 * offs_w) // GROUP)[None, :]
            s = tl.load(s_ptr + sm, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + sm, mask=mask, other=0.0).to(tl.float32)
            w = tl.where(w < n_words, w, 0)
        xw = tl.load(xw_ptr + w)
        if ASM:
            p0 = tl.load(xp_ptr + w)
            p1 = tl.load(xp_ptr + n_words + w)
            p2 = tl.load(xp_ptr + 2 * n_words + w)
            p3 = tl.load(xp_ptr + 3 * n_words + w)
            f = tl.inline_asm_elementwise(
                _DOT8, "=r,r,r,r,r,r", [words, p0[None, :], p1[None, :], p2[None, :], p3[None, :]],
                dtype=tl.int32, is_pure=True, pack=1,
            ).to(tl.float32, bitcast=True)  # fmt: skip
        else:
            f = _emul(words, xp_ptr + w, n_words)
        accq += f * s
        accm += xw[None, :] * (m + 8.0 * s)
    return tl.sum(accq, axis=1), tl.sum(accm, axis=1)


@triton.jit
def int4_up_half2_kernel(
    xp_ptr,  # [4, D // 8] int32: the half2 pairs of x (int4_pairs_kernel)
    xw_ptr,  # [D // 8] fp32: each word's inputs summed
    inv_ptr,  # [1] fp32: 1 / the largest |x|
    p_ptr,  # [R, D // 8] codes as int32 words (8 inputs each), one row per output row
    s_ptr,  # [R, D // GROUP] scales
    m_ptr,  # [R, D // GROUP] mins
    idx_ptr,  # MODE 1: [K // RPI] listed rows (blocks of RPI rows), int32
    thr_ptr,  # MODE 2: [K] fp32 thresholds on |act(gate)|
    b_ptr,  # [R] bias (HAS_BIAS)
    out_ptr,  # [K] outputs
    ws_ptr,  # SPLIT > 1: fp32 [K] sums ([2K] gated: gate, then up), zero between launches
    K,  # outputs: listed rows (MODE 1), every row (0), neurons (2)
    D,
    UP,  # GATED: the up row of row r is r + UP
    stride_s,
    STRIDE_P: tl.constexpr,  # words per code row (a constant: row offsets become immediates)
    MODE: tl.constexpr,  # 0 every row, 1 listed rows, 2 CATS (every gate row, kept up rows)
    RPI: tl.constexpr,  # rows per index (MODE 1)
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,  # inputs per (scale, min)
    BLOCK_N: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # inputs per step: a power of two (several groups, or part of one)
    SPLIT: tl.constexpr,  # programs along the inputs (not CATS): > 1 adds fp32 partial sums
    ASM: tl.constexpr,  # the inline PTX (compiled for a GPU) or its emulation (interpreter)
):
    offs_j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_j = offs_j < K
    if MODE == 1:
        blk = tl.load(idx_ptr + offs_j // RPI, mask=mask_j, other=0)
        rows = blk * RPI + offs_j % RPI
    else:
        rows = offs_j
    peak = 1.0 / tl.load(inv_ptr)
    span = D // SPLIT  # a multiple of BLOCK_K
    k_lo = tl.program_id(1) * span
    k_hi = k_lo + span
    if GATED and MODE != 2:  # gate and up rows in one walk: twice the loads in flight per step
        rows2 = tl.reshape(tl.join(rows, rows + UP), (2 * BLOCK_N,))
        use2 = tl.reshape(tl.join(mask_j, mask_j), (2 * BLOCK_N,))
        q2, m2 = _rows(p_ptr, s_ptr, m_ptr, rows2, use2, xp_ptr, xw_ptr, D, k_lo, k_hi, STRIDE_P,
                       stride_s, GROUP, 2 * BLOCK_N, BLOCK_K, ASM)  # fmt: skip
        gq, uq = tl.split(tl.reshape(q2, (BLOCK_N, 2)))
        gm, um = tl.split(tl.reshape(m2, (BLOCK_N, 2)))
    else:
        gq, gm = _rows(p_ptr, s_ptr, m_ptr, rows, mask_j, xp_ptr, xw_ptr, D, k_lo, k_hi,
                       STRIDE_P, stride_s, GROUP, BLOCK_N, BLOCK_K, ASM)  # fmt: skip
    g = gq * peak + gm
    if HAS_BIAS:
        first = (tl.program_id(1) == 0).to(tl.float32)  # the bias once, in the first split
        g += first * tl.load(b_ptr + rows, mask=mask_j, other=0.0).to(tl.float32)
    if SPLIT > 1:  # partial sums; the finishing launch applies the activation (and the gate)
        tl.atomic_add(ws_ptr + offs_j, g, mask=mask_j, sem="relaxed")
        if GATED:
            u = uq * peak + um
            if HAS_BIAS:
                u += first * tl.load(b_ptr + rows + UP, mask=mask_j, other=0.0).to(tl.float32)
            tl.atomic_add(ws_ptr + K + offs_j, u, mask=mask_j, sem="relaxed")
    else:
        a = act(g, ACT)
        if MODE == 2:
            t = tl.load(thr_ptr + offs_j, mask=mask_j, other=float("inf"))
            keep = (tl.abs(a) > t) & mask_j
        else:
            keep = mask_j
        h = a
        if GATED:
            if MODE == 2:  # CATS: the up rows of the kept neurons; a program with none skips them
                u = tl.zeros((BLOCK_N,), tl.float32)
                if tl.max(keep.to(tl.int32), axis=0) > 0:
                    uq, um = _rows(p_ptr, s_ptr, m_ptr, rows + UP, keep, xp_ptr, xw_ptr, D, k_lo,
                                   k_hi, STRIDE_P, stride_s, GROUP, BLOCK_N, BLOCK_K, ASM)  # fmt: skip
                    u = uq * peak + um
            else:
                u = uq * peak + um
            if HAS_BIAS:
                u += tl.load(b_ptr + rows + UP, mask=keep, other=0.0).to(tl.float32)
            h = a * u
        if MODE == 2:
            h = tl.where(keep, h, 0.0)
        tl.store(out_ptr + offs_j, h.to(out_ptr.dtype.element_ty), mask=mask_j)


def launch_up_half2(xb: torch.Tensor, w, res2: torch.Tensor, cfg: dict, *, mode: str,
                    idx: torch.Tensor | None = None, thr: torch.Tensor | None = None,
                    rows_per_index: int = 1, gated: bool = False, activation: str = "none",
                    bias: torch.Tensor | None = None) -> None:  # fmt: skip
    """Run :func:`int4_up_half2_kernel` on checked inputs: ``xb`` [1, in], ``w`` an Int4Rows on
    xb's device and dtype, ``res2`` the [1, K] output; ``mode`` ``"dense"``, ``"rows"`` (``idx``
    int32 blocks of ``rows_per_index`` rows) or ``"cats"`` (``thr`` fp32 [K]). ``cfg``:
    ``BLOCK_N`` (a power of two), ``BLOCK_K`` (a power of two >= 8), ``num_warps``,
    ``num_stages``; optional ``SPLIT`` (programs along the inputs, halved until they divide
    them into whole steps; CATS runs 1): fp32 partial sums, then :func:`~.tile.finish`.

    >>> from dejavu_lab.quant import quantize_rows
    >>> w = quantize_rows(torch.eye(32)[:8], group=32, dtype=torch.float16)  # W [8, 32]
    >>> x, out = torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> launch_up_half2(x, w, out, UP_HALF2, mode="dense")  # CPU: under TRITON_INTERPRET=1
    >>> out.tolist()
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    if xb.shape[0] != 1:
        raise ValueError("the half2 kept-row kernel runs one token; pass x of shape [1, d].")
    d = xb.shape[1]
    k = res2.shape[1]
    block_n = int(cfg["BLOCK_N"])
    block_k = min(int(cfg["BLOCK_K"]), max(w.group, triton.next_power_of_2(d)))
    if block_n & (block_n - 1) or block_k & (block_k - 1) or block_k < 8:
        raise ValueError(f"config BLOCK_N={block_n} and BLOCK_K={block_k} must be powers of two "
                         "(BLOCK_K >= 8).")  # fmt: skip
    codes = w.packed.view(torch.int32)
    nw = d // 8  # the pairs, the word sums and 1 / max|x|, one workspace
    ws = _workspace.buffer(xb.device, "int4_pairs", 5 * nw + 1, torch.int32)
    xp, xw, inv = ws[: 4 * nw], ws[4 * nw : 5 * nw].view(torch.float32), ws[5 * nw : 5 * nw + 1]
    inv = inv.view(torch.float32)
    int4_pairs_kernel[(1,)](xb, xp, xw, inv, d, BLOCK_W=min(512, triton.next_power_of_2(d // 8)),
                            num_warps=4)  # fmt: skip
    split = 1 if mode == "cats" else max(1, int(cfg.get("SPLIT", 1)))
    while split > 1 and d % (split * block_k):
        split //= 2
    sums = _workspace.sums(xb.device, 2 * k if gated else k)
    int4_up_half2_kernel[(triton.cdiv(max(k, 1), block_n), split)](
        xp, xw, inv, codes, w.scales, w.mins, idx if idx is not None else codes,
        thr if thr is not None else w.scales, bias if bias is not None else w.scales, res2, sums,
        k, d, w.shape[0] // 2 if gated else 0, w.scales.stride(0), codes.stride(0),
        MODE={"dense": 0, "rows": 1, "cats": 2}[mode], RPI=rows_per_index, GATED=gated,
        ACT=activation, HAS_BIAS=bias is not None, GROUP=w.group, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT=split, ASM=xb.device.type == "cuda",
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg.get("num_stages", 2)),
    )  # fmt: skip
    if split > 1:
        finish(sums, res2, None, activation, gated)
