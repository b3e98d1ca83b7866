"""4-bit weights: the group-wise int4 format the sparse kernels read, and its conversions.

- :mod:`~dejavu_lab.quant.packed` — what both layouts share (:class:`PackedInt4`: packed codes,
  group-wise scales and mins, their checks);
- :mod:`~dejavu_lab.quant.int4` — the format (:class:`Int4Weight`) and round-to-nearest
  quantisation from fp16/bf16/fp32 weights;
- :mod:`~dejavu_lab.quant.refine` — the same format with each group's scale and min searched
  and refitted for the smallest squared error (:func:`quantize_mse`);
- :mod:`~dejavu_lab.quant.int4_rows` — the same format one row per output (:class:`Int4Rows`),
  for the kernels that skip outputs (Deja Vu's kept neurons and heads, CATS's up rows);
- :mod:`~dejavu_lab.quant.gguf_blocks` — GGUF's Q4_0 / Q4_1 / Q4_K blocks read into it exactly;
- :mod:`~dejavu_lab.quant.gguf_model` — a loaded model's decoder linears from its GGUF file;
- :mod:`~dejavu_lab.quant.swap` — a model run on its dequantised int4 weights (the quality
  path measures the format, not a kernel).
"""

from .gguf_blocks import FOUR_BIT, decode_blocks, int4_from_blocks
from .gguf_model import GGUFImport, gguf_names, import_gguf
from .int4 import GROUPS, Int4Weight, QuantError, quantize
from .int4_rows import Int4Rows, quantize_rows, rows_layout
from .refine import quantize_mse
from .swap import decoder_linears, dequantized, rtn_weights

__all__ = [
    "FOUR_BIT",
    "GGUFImport",
    "GROUPS",
    "Int4Rows",
    "Int4Weight",
    "QuantError",
    "decode_blocks",
    "decoder_linears",
    "dequantized",
    "gguf_names",
    "import_gguf",
    "int4_from_blocks",
    "quantize",
    "quantize_mse",
    "quantize_rows",
    "rows_layout",
    "rtn_weights",
]
