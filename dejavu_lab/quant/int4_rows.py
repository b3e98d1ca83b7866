"""Group-wise int4 weights in the rows layout: one row per output, so skipping an output skips its bytes.

Deja Vu's kept neurons and heads, and CATS's kept up rows, drop *outputs* of a product
(``y_j = W[j] . x`` for the kept ``j`` only): the natural layout is ``nn.Linear.weight`` itself,
``W`` of shape ``[out, in]``, one contiguous row per output (the engine's ``"rows"`` layout,
:mod:`~dejavu_lab.engine.weights`). :class:`~dejavu_lab.quant.Int4Weight` stores ``Wᵀ`` (one row
per *input* channel, for TEAL's dropped inputs); this format stores ``W``, with the same groups:

* ``packed`` — ``uint8 [out, in // 2]``: row ``j`` holds output ``j``; byte ``k`` holds input
  ``2k`` in its low nibble and ``2k + 1`` in its high nibble, codes ``q`` in 0..15;
* ``scales``, ``mins`` — ``[out, in // group]``: one (scale, min) per output and per ``group``
  consecutive inputs, ``W[j, i] = q[j, i] * scales[j, i // group] + mins[j, i // group]``.

A kept output reads ``in / 2`` contiguous code bytes and ``2 in / group`` scales and mins. The
groups are those of :func:`~dejavu_lab.quant.quantize` (along the inputs, per output), so the two
layouts of one weight hold the same codes, scales and mins, transposed:
:func:`rows_layout` and :meth:`Int4Rows.columns` convert exactly, and an engine that keeps both
reads the same numbers either way.

>>> import torch
>>> from dejavu_lab.quant import quantize
>>> w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))  # W [out, in]
>>> r = quantize_rows(w, group=32, dtype=torch.float16)
>>> r.shape, tuple(r.packed.shape), tuple(r.scales.shape)
((48, 64), (48, 32), (48, 2))
>>> torch.equal(r.dequantize(), quantize(w.T, group=32, dtype=torch.float16).dequantize().T)
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantError
from .int4 import Int4Weight, pack, quantize, unpack
from .packed import PackedInt4

__all__ = ["Int4Rows", "quantize_rows", "rows_layout"]


@dataclass(frozen=True)
class Int4Rows(PackedInt4):
    """A weight ``W`` (``[out, in]``, an ``nn.Linear.weight``) in group-wise int4, one row per
    output; see the module docstring (the checks and the layout-free properties are
    :class:`~dejavu_lab.quant.packed.PackedInt4`'s).

    >>> r = Int4Rows(pack(torch.full((2, 32), 3)), torch.ones(2, 1), torch.zeros(2, 1), 32)
    >>> r.shape, r.row_bytes, r.dequantize()[0, :2].tolist()
    ((2, 32), 16, [3.0, 3.0])
    """

    # packed: uint8 [out, in // 2]; scales, mins: [out, in // group]; group: inputs per scale
    GROUP_AXIS = 1
    GROUPED = "inputs per row"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W`` as floats (``[out, in]``), computed in fp32 and cast to ``dtype``.

        >>> quantize_rows(torch.ones(2, 32), group=32).dequantize().unique().tolist()
        [1.0]
        """
        g = self.group
        s = self.scales.float().repeat_interleave(g, 1)
        m = self.mins.float().repeat_interleave(g, 1)
        return (unpack(self.packed).float() * s + m).to(dtype or self.dtype)

    def columns(self) -> Int4Weight:
        """The same weight as an :class:`~dejavu_lab.quant.Int4Weight` of ``Wᵀ`` (exact).

        >>> r = quantize_rows(torch.randn(4, 32), group=32)
        >>> torch.equal(r.columns().dequantize(), r.dequantize().T)
        True
        """
        q = unpack(self.packed).T.contiguous()
        return Int4Weight(pack(q), self.scales.T.contiguous(), self.mins.T.contiguous(), self.group)


def rows_layout(w: Int4Weight) -> Int4Rows:
    """The rows layout of an :class:`~dejavu_lab.quant.Int4Weight` of ``w_t = Wᵀ`` (exact: the
    same codes, scales and mins, transposed).

    >>> from dejavu_lab.quant import quantize
    >>> w_t = quantize(torch.randn(64, 6), group=32)  # [in 64, out 6]
    >>> r = rows_layout(w_t)
    >>> r.shape, torch.equal(r.dequantize(), w_t.dequantize().T)
    ((6, 64), True)
    """
    if not isinstance(w, Int4Weight):
        raise QuantError(f"w must be an Int4Weight (quantize(w_t)), got {type(w).__name__}.")
    q = unpack(w.packed).T.contiguous()  # [out, in]
    return Int4Rows(pack(q), w.scales.T.contiguous(), w.mins.T.contiguous(), w.group)


def quantize_rows(w: torch.Tensor, group: int = 128, dtype: torch.dtype | None = None) -> Int4Rows:
    """Round-to-nearest int4 of ``W`` (``[out, in]``) in the rows layout: the same numbers as
    ``rows_layout(quantize(W.T, group, dtype))``.

    >>> r = quantize_rows(torch.tensor([[0.0, 1.5], [-1.0, 1.0]]).repeat(1, 16), group=32)
    >>> r.dequantize()[:, :2].tolist()
    [[0.0, 1.5], [-1.0, 1.0]]
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise QuantError("w must be a 2-D float tensor [out, in] (an nn.Linear's weight).")
    if w.shape[0] % 2 == 0:
        return rows_layout(quantize(w.T, group, dtype))
    # an odd row count: quantize packs w.T's outputs two per byte, so quantise one more row
    # (each row's groups are its own) and drop it
    r = rows_layout(quantize(torch.cat([w, w[:1]]).T, group, dtype))
    return Int4Rows(r.packed[:-1], r.scales[:-1], r.mins[:-1], r.group)
