"""The half2 decode of int4 code words: two weights per instruction, and its sums.

One 32-bit word of codes (eight nibbles) becomes four half2 registers with the magic-number
trick of FasterTransformer and Marlin: ``(word >> 4j) & 0x000F000F | 0x64006400`` is the fp16
pair ``(1024 + q, 1024 + q')`` of nibbles ``j`` and ``j + 4``; subtracting ``1032``
(``sub.f16x2``) leaves the centred codes ``q - 8`` exactly, and one ``fma.rn.f16x2`` adds them
times an activation to a half2 accumulator. The high nibble of each byte is masked in place
(``16 q``) and centred by one ``fma.rn.f16x2`` (``/ 16 - 72``), so a word needs one shift.
:mod:`.half2` pairs the outputs of a column word (one activation per row), :mod:`.up_half2`
the inputs of a row word (two activations per pair). The inline PTX runs only when compiled
for a GPU; :func:`_emulated` is the interpreter's stand-in, on a whole [rows, words] tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["DECODE_CONSTANTS", "DECODE_REGS", "centre_ptx"]


#: the registers and constants of the half2 decode (:func:`centre_ptx`), as PTX
DECODE_REGS = "t, u, lo, hi, mag, off, sixteenth, m72"
DECODE_CONSTANTS = ("mov.b32 lo, 0x000F000F;\nmov.b32 hi, 0x00F000F0;\nmov.b32 mag, 0x64006400;\n"
                    "mov.b32 off, 0x64086408;\nmov.b32 sixteenth, 0x2C002C00;\n"
                    "mov.b32 m72, 0xD480D480;\n")  # fmt: skip


def centre_ptx(j: int, src: str) -> str:
    """PTX leaving in ``t`` centred half2 code pair ``j`` of a word (``src``: the word for pairs 0
    and 1, ``u`` = the word shifted right by 8 for pairs 2 and 3): nibbles ``j`` and ``j + 4``.
    Pairs 0 and 2 (the low nibble of a byte): ``lop3`` (mask | 0x6400) gives ``1024 + q`` and
    ``sub.f16x2`` of 1032 leaves ``q - 8``. Pairs 1 and 3 (the high nibble): the mask keeps
    ``16 q`` and ``fma.rn.f16x2`` turns ``1024 + 16 q`` into ``(1024 + 16 q) / 16 - 72 = q - 8``;
    both exact (:data:`DECODE_CONSTANTS` sets the masks and constants).

    >>> centre_ptx(1, "$4").splitlines()
    ['lop3.b32 t, $4, hi, mag, 0xEA;', 'fma.rn.f16x2 t, t, sixteenth, m72;']
    """
    if j % 2 == 0:
        return f"lop3.b32 t, {src}, lo, mag, 0xEA;\nsub.f16x2 t, t, off;\n"
    return f"lop3.b32 t, {src}, hi, mag, 0xEA;\nfma.rn.f16x2 t, t, sixteenth, m72;\n"


def _pairs_ptx() -> str:
    """The four half2 steps of one word: $0-$3 the half2 sums out, $4 the word, $5 ``(x, x)``
    as half2, $6-$9 the sums in. Pair ``j`` holds the codes of outputs ``j`` and ``j + 4``
    (:func:`centre_ptx`); one shift per word."""
    steps = [centre_ptx(j, src) + f"fma.rn.f16x2 ${j}, t, $5, ${6 + j};\n"
             for j, src in enumerate(("$4", "$4", "u", "u"))]  # fmt: skip
    return ("{\n.reg .b32 " + DECODE_REGS + ";\n" + DECODE_CONSTANTS + "shr.u32 u, $4, 8;\n"
            + "".join(steps) + "}\n")  # fmt: skip


_PAIRS = tl.constexpr(_pairs_ptx())


@triton.jit
def _half(bits):
    """The fp16 value whose bits are the low 16 of ``bits`` (int32), as fp16."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _bits(h):
    """The bits of fp16 ``h`` in the low 16 of an int32."""
    return h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _row(words, x2, a0, a1, a2, a3):
    """One row's four pairs added to the half2 sums ``a0``-``a3`` (:data:`_PAIRS`)."""
    return tl.inline_asm_elementwise(
        _PAIRS, "=r,=r,=r,=r,r,r,r,r,r,r", [words, x2, a0, a1, a2, a3],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _emulated(words, xh):
    """The interpreter's stand-in for the half2 sums of a [rows, words] tile: nibble k of each
    word (output 8w + k) centred, times its row's fp16 activation, each product rounded to fp16,
    summed over the rows in fp32: [words, 8]. One expression (the interpreter pays about
    0.2 ms a program for each nested jit call)."""
    shifts = 4 * tl.arange(0, 8)
    q = (((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8).to(tl.float16)
    return tl.sum((q * xh[:, None, None]).to(tl.float32), axis=0)


@triton.jit
def _joined(f0, f1, f2, f3, f4, f5, f6, f7):
    """[NW, 8] with output 8w + k at [w, k] = ``f{k}`` (pair j's low half is output j, its high
    half output j + 4): [NW, 2, 2, 2] with output 4i + 2j + l at [w, i, j, l], reshaped."""
    sums = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)),
                   tl.join(tl.join(f1, f5), tl.join(f3, f7)))  # fmt: skip
    return tl.reshape(sums, (f0.shape[0], 8))


@triton.jit
def _flush(f0, f1, f2, f3, f4, f5, f6, f7, a0, a1, a2, a3):
    """The fp32 sums plus the half2 sums ``a0``-``a3``: pair j holds outputs 8w + j (low half,
    into ``f{j}``) and 8w + j + 4 (high half, into ``f{j + 4}``)."""
    return (f0 + _fp32(a0, False), f1 + _fp32(a1, False), f2 + _fp32(a2, False),
            f3 + _fp32(a3, False), f4 + _fp32(a0, True), f5 + _fp32(a1, True),
            f6 + _fp32(a2, True), f7 + _fp32(a3, True))  # fmt: skip


@triton.jit
def _fp32(acc, HIGH: tl.constexpr):
    """One half of a half2 sum, as fp32."""
    if HIGH:
        return _half(acc >> 16).to(tl.float32)
    return _half(acc).to(tl.float32)
