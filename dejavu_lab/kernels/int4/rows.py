"""The kept-row W4A16 GEMV: ``h @ dequant(W)[idx]``, Deja Vu's down projection on int4 weights.

Deja Vu (§4.4, Appendix E) runs the MLP's second matrix over the neurons the predictor keeps:
``y = sum_j h_j W2ᵀ[idx_j]``, one contiguous row per kept neuron in the transposed layout.
In the int4 layout a row is ``d_out / 2`` code bytes plus its group's scale and min rows,
which the kernel reads per listed row (rows of one group share them in cache; a sorted list
keeps them together). ``rows_per_index`` lists blocks of rows: a kept head's ``d_head`` rows of
``W_Oᵀ``.

One token scatters the listed activations into a zeroed vector of every row and runs the
threshold GEMV's half2 kernel at threshold 0 (:mod:`.half2`, ``compact``): each program lists
its nonzero rows and walks them eight at a time, so a row not listed moves no bytes, and the
list costs one small scatter instead of a walk of indices inside the GEMV (measured on an H100
at Llama-3-8B shapes, ``kernels/bench_int4_rows.py``). Union batches, and ``config={"mode":
"rows"}``, run :mod:`.kernel`'s kept-row walk.
"""

from __future__ import annotations

import torch

from ...quant import Int4Weight
from .._common import (
    as_batch,
    check_device,
    check_float,
    check_index,
    check_vector,
    output,
    use_triton,
)
from .._neurons import expand_rows
from .dense import check_int4
from .half2 import HALF2_OPS, launch_half2
from .kernel import default_config, launch

__all__ = ["int4_rows_gemv", "int4_rows_gemv_ref"]


def int4_rows_gemv_ref(h: torch.Tensor, w: Int4Weight, idx: torch.Tensor, *,
                       bias: torch.Tensor | None = None, rows_per_index: int = 1) -> torch.Tensor:  # fmt: skip
    """Plain-PyTorch reference (fp32 math): ``h @ w.dequantize()[rows] + bias``, the rows of
    ``idx`` (blocks of ``rows_per_index``).

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :4], group=32, dtype=torch.float16)
    >>> int4_rows_gemv_ref(torch.tensor([2.0, 5.0]).half(), w, torch.tensor([3, 1])).tolist()
    [0.0, 5.0, 0.0, 2.0]
    """
    y = h.float() @ w.dequantize(torch.float32)[expand_rows(idx, rows_per_index)]
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype)


def int4_rows_gemv(h: torch.Tensor, w: Int4Weight, idx: torch.Tensor, *,
                   bias: torch.Tensor | None = None, rows_per_index: int = 1,
                   out: torch.Tensor | None = None, validate: bool | None = None,
                   config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``h @ dequant(w)[idx] + bias``: the layer's output from the listed input rows only.

    h: [k] or [B, k] (B <= 32, fp16/bf16) activations of the rows in ``idx`` order; w: an
    Int4Weight of ``w_t`` [n_rows, d_out] with h's dtype; idx: [k] distinct int32/int64 row
    numbers (or blocks: ``rows_per_index`` rows each, h then holds ``k rows_per_index``
    activations, block by block); bias: [d_out]. Returns [d_out] or [B, d_out]. ``validate`` checks the indices'
    range and uniqueness (a host sync; by default except during CUDA-graph capture).

    >>> from dejavu_lab.quant import quantize
    >>> _ = torch.manual_seed(0)
    >>> w = quantize(torch.randn(64, 32) / 8, group=32, dtype=torch.float16)  # 64 neurons
    >>> h, idx = torch.randn(3, dtype=torch.float16), torch.tensor([3, 10, 42])
    >>> y = int4_rows_gemv(h, w, idx)  # the Triton kernel on CPU under TRITON_INTERPRET=1
    >>> torch.allclose(y, int4_rows_gemv_ref(h, w, idx), atol=1e-2)
    True
    """
    check_float("h", h)
    dtype, device = h.dtype, h.device
    check_int4("w", w, Int4Weight, "quantize(w_t)", dtype, device)
    n_rows, d_out = w.shape
    g = rows_per_index
    if not isinstance(g, int) or g < 1 or n_rows % g:
        raise ValueError(f"rows_per_index={g!r} must be a positive int dividing w's {n_rows} rows.")
    check_index("idx", idx, n_rows // g, device, validate)
    check_device(device, bias=bias)
    check_vector("bias", bias, d_out, dtype)
    hb, squeeze = as_batch("h", h, idx.numel() * g)
    res, res2 = output(out, hb.shape[0], d_out, squeeze, dtype, device)
    if not use_triton(device) or idx.numel() == 0:
        res2.copy_(int4_rows_gemv_ref(hb, w, idx, bias=bias, rows_per_index=g))
        return res
    if hb.shape[0] == 1 and d_out % 8 == 0 and not (config or {}).get("mode") == "rows":
        # one token: the listed rows' activations scattered into zeros, then the half2 threshold
        # kernel's kept-row list at threshold 0 (a row not listed is exactly 0: never read)
        full = torch.zeros(n_rows, dtype=dtype, device=device)
        full.view(-1, g)[idx.long()] = hb.view(-1, g)
        launch_half2(full[None], w, res2, {**HALF2_OPS["int4_threshold_gemv"], **(config or {})},
                     mode="threshold", thr=0.0, bias=bias)  # fmt: skip
        return res
    cfg = default_config(hb.shape[0], *w.shape, group=w.group, op="int4_rows_gemv", device=device)
    launch(hb, w, res2, {**cfg, **(config or {})}, mode="rows",
           idx=idx.to(torch.int32), bias=bias, rows_per_index=g)  # fmt: skip
    return res
