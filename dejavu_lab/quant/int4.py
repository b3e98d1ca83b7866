"""Group-wise int4 weights, laid out so that skipping an input channel skips its bytes.

Activation sparsity drops *input channels*: a zero entry of ``x`` means the matching column of
``W`` (``y = W x``) is never read. The engine stores each weight transposed, ``w_t = Wᵀ`` of
shape ``[in, out]`` (the columns layout), so one input channel is one contiguous row. This format
keeps that property at 4 bits:

* ``packed`` — ``uint8 [in, out // 2]``: row ``i`` holds input channel ``i``; byte ``j`` holds
  output ``2j`` in its low nibble and ``2j + 1`` in its high nibble, codes ``q`` in 0..15.
* ``scales``, ``mins`` — ``[in // group, out]`` in the activations' dtype: one (scale, min) per
  output and per ``group`` consecutive input channels, so that

  ``w_t[i, o] = q[i, o] * scales[i // group, o] + mins[i // group, o]``

  (one fused multiply-add per weight). Symmetric formats fit too: GGUF's Q4_0 is
  ``d * (q - 8)``, i.e. scale ``d`` and min ``-8 d``.

A kernel that skips channel ``i`` skips ``out / 2`` bytes; the scales and mins of a group are read
when any channel of the group is kept, which at 50% kept is nearly every group, so they cost
``2 * itemsize * out`` bytes per group whatever the sparsity (``group=128`` in fp16: 1/32 of a
byte per weight, 6% of the 4-bit payload; ``group=32``: 25%).

>>> import torch
>>> w_t = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
>>> q = quantize(w_t, group=64, dtype=torch.float32)
>>> q.shape, tuple(q.packed.shape), tuple(q.scales.shape), q.nbytes
((256, 64), (256, 32), (4, 64), 10240)
>>> err = (q.dequantize() - w_t).abs() / q.scales.repeat_interleave(64, 0)
>>> bool(err.max() <= 0.5 + 1e-5)  # round to nearest: at most half a step off
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantError
from .packed import GROUPS, SCALE_DTYPES, PackedInt4

__all__ = ["GROUPS", "Int4Weight", "QuantError", "pack", "quantize", "unpack"]


def pack(q: torch.Tensor) -> torch.Tensor:
    """``uint8 [in, out // 2]`` from codes ``[in, out]`` in 0..15 (output ``2j`` in the low nibble).

    >>> pack(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    tensor([[33, 15]], dtype=torch.uint8)
    """
    if q.dim() != 2 or q.shape[1] % 2:
        raise QuantError(f"codes of shape {tuple(q.shape)} cannot pack; pass [in, even out].")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes ``uint8 [in, out]`` of ``packed`` (inverse of :func:`pack`).

    >>> unpack(torch.tensor([[33, 15]], dtype=torch.uint8))
    tensor([[ 1,  2, 15,  0]], dtype=torch.uint8)
    """
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class Int4Weight(PackedInt4):
    """A weight ``w_t`` (``[in, out]``) in group-wise int4; see the module docstring (the checks
    and the layout-free properties are :class:`~dejavu_lab.quant.packed.PackedInt4`'s).

    >>> w = Int4Weight(pack(torch.full((32, 2), 3)), torch.ones(1, 2), torch.zeros(1, 2), 32)
    >>> w.shape, w.row_bytes, w.group_bytes, w.dequantize()[0].tolist()
    ((32, 2), 1, 16, [3.0, 3.0])
    """

    # packed: uint8 [in, out // 2]; scales, mins: [in // group, out]; group: inputs per scale
    GROUP_AXIS = 0
    GROUPED = "input rows"

    @property
    def group_bytes(self) -> int:
        """Scale and min bytes of one group (read when any of its channels is kept)."""
        return 2 * self.scales.shape[1] * self.scales.element_size()

    def codes(self) -> torch.Tensor:
        """The codes ``uint8 [in, out]`` in 0..15."""
        return unpack(self.packed)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``w_t`` as floats (``[in, out]``), computed in fp32 and cast to ``dtype``.

        >>> q = quantize(torch.ones(32, 2), group=32)
        >>> q.dequantize().unique().tolist()
        [1.0]
        """
        g = self.group
        s = self.scales.float().repeat_interleave(g, 0)
        m = self.mins.float().repeat_interleave(g, 0)
        w = self.codes().float() * s + m
        return w.to(dtype or self.dtype)


def quantize(w_t: torch.Tensor, group: int = 128, dtype: torch.dtype | None = None) -> Int4Weight:
    """Round-to-nearest int4 of ``w_t`` (``[in, out]``: an ``nn.Linear``'s ``weight.T``).

    Each group of ``group`` input channels of each output gets the scale and min that map its
    range onto 0..15 (asymmetric). Scales and mins are rounded to ``dtype`` (default: ``w_t``'s
    dtype, fp32 kept as fp32) *before* the codes are chosen, so the codes are the nearest ones
    for the scales the kernels will read.

    >>> q = quantize(torch.tensor([[0.0, -1.0], [1.5, 1.0]]).repeat(16, 1), group=32)
    >>> q.dequantize()[:2].tolist()
    [[0.0, -1.0], [1.5, 1.0]]
    """
    if not isinstance(w_t, torch.Tensor) or w_t.dim() != 2 or not w_t.is_floating_point():
        raise QuantError("w_t must be a 2-D float tensor [in, out] (an nn.Linear's weight.T).")
    n_in, n_out = w_t.shape
    if group not in GROUPS:
        raise QuantError(f"group={group!r} is not supported; pick one of {GROUPS}.")
    if n_in % group:
        raise QuantError(
            f"{n_in} input rows do not split into groups of {group}; pick a group that divides "
            f"them (one of {GROUPS})."
        )
    if n_out % 2:
        raise QuantError(
            f"{n_out} outputs cannot pack two per byte; pad the weight to an even count."
        )
    dtype = dtype or (w_t.dtype if w_t.dtype in SCALE_DTYPES else torch.float32)
    if dtype not in SCALE_DTYPES:
        raise QuantError(f"dtype={dtype} for scales; use float16, bfloat16 or float32.")
    # row-major whatever w_t's strides (a transposed view): the kernels read contiguous codes
    w = w_t.float().contiguous().reshape(n_in // group, group, n_out)
    if not torch.isfinite(w).all():
        raise QuantError("w_t holds NaN or inf; quantise finite weights only.")
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    mins = lo.to(dtype).float()
    scales = ((hi - mins) / 15).to(dtype).float()
    # a constant group: any scale works, every code is 0 (w = min); avoid dividing by 0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - mins[:, None]) / safe[:, None]).clamp_(0, 15)
    q = q.reshape(n_in, n_out).to(torch.uint8)
    return Int4Weight(pack(q), scales.to(dtype), mins.to(dtype), group)
