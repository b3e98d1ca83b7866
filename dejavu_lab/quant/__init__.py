"""4-bit weights: the group-wise int4 format the sparse kernels read, and its conversions.

:mod:`~dejavu_lab.quant.int4` holds the format (:class:`Int4Weight`) and round-to-nearest
quantisation from fp16/bf16/fp32 weights.
"""

from .int4 import GROUPS, Int4Weight, QuantError, quantize

__all__ = ["GROUPS", "Int4Weight", "QuantError", "quantize"]
