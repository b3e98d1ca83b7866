"""What the two int4 layouts share: codes packed two per byte along each row, and one (scale, min)
per output and per ``group`` consecutive inputs.

:class:`~dejavu_lab.quant.Int4Weight` stores ``w_t = Wᵀ`` (``[in, out]``, one row per input
channel: TEAL's dropped inputs skip rows) and :class:`~dejavu_lab.quant.Int4Rows` stores ``W``
(``[out, in]``, one row per output: Deja Vu's and CATS's dropped outputs skip rows). Both hold

* ``packed`` — ``uint8 [rows, cols // 2]``: byte ``k`` of a row holds column ``2k`` in its low
  nibble and ``2k + 1`` in its high nibble, codes in 0..15;
* ``scales``, ``mins`` — the weight's shape with its input axis divided by ``group``, in the
  activations' dtype (float16, bfloat16 or float32).

:class:`PackedInt4` checks those tensors and answers what does not depend on the layout (shape,
dtype, device, bytes); a layout says which axis of the weight its groups run along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import QuantError

__all__ = ["GROUPS", "SCALE_DTYPES", "PackedInt4"]

GROUPS = (32, 64, 128)  # GGUF's blocks are 32 wide; 128 is the common GPTQ/AWQ group
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PackedInt4:
    """Packed int4 codes with group-wise scales and mins, checked on construction; the base of
    :class:`~dejavu_lab.quant.Int4Weight` and :class:`~dejavu_lab.quant.Int4Rows` (built through
    them, which set ``GROUP_AXIS``).

    >>> from dejavu_lab.quant import quantize, quantize_rows
    >>> w = torch.randn(4, 64)  # W [out 4, in 64]
    >>> cols, rows = quantize(w.T, group=32), quantize_rows(w, group=32)
    >>> cols.shape, rows.shape, cols.nbytes == rows.nbytes, (cols.row_bytes, rows.row_bytes)
    ((64, 4), (4, 64), True, (2, 32))
    """

    packed: torch.Tensor  # uint8 [rows, cols // 2], two codes per byte along each row
    scales: torch.Tensor  # the weight's shape, its GROUP_AXIS divided by group
    mins: torch.Tensor  # as scales, same dtype
    group: int  # inputs per (scale, min), one of GROUPS

    GROUP_AXIS: ClassVar[int]  # the weight's input axis, along which the groups run
    GROUPED: ClassVar[str]  # what that axis counts, as the errors name it

    def __post_init__(self):
        if not hasattr(self, "GROUP_AXIS"):
            raise TypeError("PackedInt4 has no layout; build an Int4Weight or an Int4Rows.")
        p, s, m, g = self.packed, self.scales, self.mins, self.group
        if not all(isinstance(t, torch.Tensor) for t in (p, s, m)):
            raise QuantError("packed, scales and mins must be torch tensors.")
        if g not in GROUPS:
            raise QuantError(f"group={g!r} is not supported; pick one of {GROUPS}.")
        if p.dtype != torch.uint8 or p.dim() != 2:
            raise QuantError(f"packed must be a 2-D uint8 tensor, got {p.dtype} {tuple(p.shape)}.")
        want, n = list(self.shape), self.shape[self.GROUP_AXIS]
        if n % g:
            raise QuantError(f"{n} {self.GROUPED} do not split into groups of {g}.")
        want[self.GROUP_AXIS] = n // g
        want = tuple(want)
        for name, t in (("scales", s), ("mins", m)):
            if tuple(t.shape) != want:
                raise QuantError(f"{name} has shape {tuple(t.shape)}; expected {want}.")
            if t.dtype not in SCALE_DTYPES:
                raise QuantError(f"{name} has dtype {t.dtype}; use float16, bfloat16 or float32.")
        if s.dtype != m.dtype or not (p.device == s.device == m.device):
            raise QuantError("scales and mins must share one dtype and sit on packed's device.")

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the weight it stands for: ``(in, out)`` for an Int4Weight of ``Wᵀ``,
        ``(out, in)`` for an Int4Rows of ``W``."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the scales (and of the activations a kernel pairs with them)."""
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and mins together."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))

    @property
    def row_bytes(self) -> int:
        """Code bytes of one row (an input channel of an Int4Weight, an output of an Int4Rows):
        what skipping the row saves, besides its scales and mins in the rows layout."""
        return self.packed.shape[1]

    def to(self, device):
        """The same weight, of the same layout, on ``device``."""
        return type(self)(
            self.packed.to(device), self.scales.to(device), self.mins.to(device), self.group
        )
