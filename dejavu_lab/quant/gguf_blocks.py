"""GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) read into the group-wise int4 format.

A GGUF weight is stored as ``[out, in]`` row-major (ggml's ``ne = [in, out]``), quantised in
blocks along ``in`` — the reduction dimension, the one our groups run along — so every block
maps onto one group of 32 input channels of one output, with no re-quantisation:

========  ===========================================  ==========================================
type      a block (bytes)                               scale, min of a group of 32
========  ===========================================  ==========================================
Q4_0      fp16 ``d``, 16 bytes of codes (18)            ``d``, ``-8 d`` (``w = d (q - 8)``)
Q4_1      fp16 ``d``, fp16 ``m``, 16 bytes (20)          ``d``, ``m`` (``w = d q + m``)
Q4_K      fp16 ``d``, ``dmin``, 12 bytes of 6-bit        ``d · sc_j``, ``-dmin · m_j`` for sub-block
          sub-scales and sub-mins, 128 bytes (144)       ``j`` of 8 (``w = d sc_j q - dmin m_j``)
========  ===========================================  ==========================================

In Q4_0/Q4_1 a block's codes 0..15 sit in the low nibbles of its 16 bytes and 16..31 in the high
ones; in Q4_K each 32 bytes hold sub-block ``2k`` in the low nibbles and ``2k + 1`` in the high.

Exactness: the codes are the file's own. In fp32 the scales and mins are exact for all three
(``d · sc`` is an 11-bit times a 6-bit significand, 17 bits), and ``q · scale + min`` rounds as
gguf's own dequantisation does, so :meth:`Int4Weight.dequantize` in fp32 equals
``gguf.quants.dequantize`` bit for bit. In fp16 Q4_0 and Q4_1 stay exact (``d``, ``m``, ``8 d``
are fp16 numbers); Q4_K's products need up to 17 significant bits and fp16 keeps 11, so they
round (relative error ≤ 2⁻¹¹ per scale); bf16 (8 bits) rounds all three.

>>> import numpy as np
>>> block = np.zeros((2, 20), dtype=np.uint8)  # two outputs, a Q4_1 block each: d = 0.5, m = -1
>>> block[:, :4] = np.array([0.5, -1.0], dtype=np.float16).view(np.uint8)
>>> block[:, 4:] = 0x21  # codes 1 in the low nibbles (inputs 0..15), 2 in the high (16..31)
>>> w = int4_from_blocks(block, "Q4_1", 32)
>>> w.shape, w.dequantize()[[0, 16], 0].tolist()  # [in, out]: 32 inputs, two outputs
((32, 2), [-0.5, 0.0])
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import QuantError
from .int4 import Int4Weight, pack

__all__ = ["BLOCKS", "FOUR_BIT", "decode_blocks", "int4_from_blocks"]

# type -> (weights per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
FOUR_BIT = tuple(BLOCKS)


def _name(kind) -> str:
    return getattr(kind, "name", kind)  # a gguf.GGMLQuantizationType or its name


def _f16(b: torch.Tensor) -> torch.Tensor:
    """fp16 numbers stored little-endian in the last dim (2 bytes) of ``b`` -> fp32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def decode_blocks(data, kind, n_in: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``uint8 [out, in]``, scales and mins ``fp32 [out, in // 32]`` of a 4-bit tensor.

    ``data``: the tensor's bytes, ``uint8 [out, in / block · bytes per block]`` (a
    ``GGUFReader`` tensor's ``.data``) or anything that reshapes to it; ``kind``: ``"Q4_0"``,
    ``"Q4_1"``, ``"Q4_K"`` (or the ``gguf.GGMLQuantizationType``); ``n_in``: the input width.
    ``w[o, i] = codes[o, i] * scales[o, i // 32] + mins[o, i // 32]``.

    >>> from gguf.quants import quantize as gguf_quantize
    >>> from gguf import GGMLQuantizationType
    >>> data = gguf_quantize(np.linspace(-1, 1, 64, dtype=np.float32)[None], GGMLQuantizationType.Q4_0)
    >>> codes, scales, mins = decode_blocks(data, "Q4_0", 64)
    >>> codes[0, :4].tolist(), torch.equal(mins, -8 * scales)  # w = d (q - 8), d = 1/8 here
    ([0, 0, 1, 1], True)
    """
    name = _name(kind)
    if name not in BLOCKS:
        raise QuantError(
            f"{name!r} blocks are not 4-bit; pass {', '.join(FOUR_BIT)} blocks, or use "
            "dejavu_lab.quant.quantize on the dequantised values of the others."
        )
    per, size = BLOCKS[name]
    if n_in <= 0 or n_in % per:
        raise QuantError(
            f"{name} rows hold whole blocks of {per}, which {n_in} inputs do not split into; "
            "pass the tensor's input width (ggml's ne[0])."
        )
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(
        -1
    )  # a copy: GGUFReader maps read-only
    nb = n_in // per
    if raw.numel() % (nb * size):
        raise QuantError(
            f"{raw.numel()} bytes are not whole rows of {nb} {name} blocks ({nb * size} bytes "
            f"each); pass the tensor's data and its input width."
        )
    b = raw.reshape(-1, nb, size)  # [out, blocks per row, bytes per block]
    n_out = b.shape[0]
    if name == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [out, nb]
        s = b[..., 4:16].reshape(n_out, nb, 3, 4)
        lo, hi, mixed = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        # sub-blocks 0-3: 6 bits in bytes 0-3 (scales) / 4-7 (mins); sub-blocks 4-7: 4 low bits
        # in bytes 8-11 and the top 2 bits in the spare bits of bytes 0-3 / 4-7
        sc = torch.cat((lo & 63, (mixed & 15) | ((lo >> 2) & 48)), dim=-1)
        mn = torch.cat((hi & 63, (mixed >> 4) | ((hi >> 2) & 48)), dim=-1)
        scales = d[..., None] * sc.float()  # [out, nb, 8], exact in fp32
        mins = -(dmin[..., None] * mn.float())
        qs = b[..., 16:].reshape(n_out, nb, 4, 32)
        codes = torch.stack((qs & 0xF, qs >> 4), dim=3)  # [out, nb, 4, 2, 32]
    else:
        d = _f16(b[..., 0:2])
        if name == "Q4_0":
            scales, mins, qs = d, -8 * d, b[..., 2:]
        else:
            scales, mins, qs = d, _f16(b[..., 2:4]), b[..., 4:]
        codes = _nibbles(qs)
    return (
        codes.reshape(n_out, n_in),
        scales.reshape(n_out, n_in // 32),
        mins.reshape(n_out, n_in // 32),
    )


def int4_from_blocks(
    data,
    kind,
    n_in: int,
    *,
    dtype: torch.dtype = torch.float32,
    rows: torch.Tensor | None = None,
) -> Int4Weight:
    """An :class:`Int4Weight` (group 32) of a GGUF 4-bit tensor, ``w_t = Wᵀ`` of ``[in, out]``.

    ``dtype``: of the scales and mins (fp32 is exact for every type; see the module docstring).
    ``rows``: the output order, an index ``[out]`` into the file's rows (llama GGUFs store
    W_Q/W_K rows permuted for their rotary layout; :mod:`~dejavu_lab.quant.gguf_model` undoes
    it). Permuting outputs moves whole columns of ``w_t``: codes, scales and mins stay exact.

    >>> block = np.zeros((2, 18), dtype=np.uint8)  # two outputs, one Q4_0 block each
    >>> block[:, :2] = np.array([[1.0], [0.25]], dtype=np.float16).view(np.uint8)
    >>> block[:, 2:] = 0x9A  # code 10 (low nibbles), 9 (high): d·2 and d·1
    >>> w = int4_from_blocks(block, "Q4_0", 32, dtype=torch.float16, rows=torch.tensor([1, 0]))
    >>> w.dequantize(torch.float32)[[0, 16]].tolist()  # outputs swapped by rows
    [[0.5, 2.0], [0.25, 1.0]]
    """
    codes, scales, mins = decode_blocks(data, kind, n_in)
    if rows is not None:
        codes, scales, mins = codes[rows], scales[rows], mins[rows]
    if codes.shape[0] % 2:
        raise QuantError(
            f"{codes.shape[0]} outputs cannot pack two per byte; use a tensor with an even number of outputs."
        )
    return Int4Weight(
        pack(codes.T.contiguous()),
        scales.T.contiguous().to(dtype),
        mins.T.contiguous().to(dtype),
        32,
    )
