"""The TEAL / WINA threshold GEMV on int4 weights: the mask computed in the kernel from x.

TEAL (Liu et al. 2024, ``liu2024teal``, §3) zeroes the entries of a layer's input whose
magnitude is below a threshold; WINA scales it per input channel by the weight's column norms
(``thr_i = t / ||W[:, i]||``). With the codes stored one row per input channel, a dropped
entry is a row of ``d_out / 2`` bytes that is never read; a group's scales and mins are read
when any of its rows is kept::

    y[b] = sum_i [|x[b, i]| > thr[i]] x[b, i] dequant(W)[i, :]  (+ bias)

For a union batch (2-32 tokens) a row is read when any token keeps it; each token's entries
are masked by its own rule (as :func:`~dejavu_lab.kernels.threshold_gemv`). No index list, no
host sync: the mask lives in registers, so the call sits in a CUDA graph.
"""

from __future__ import annotations

import torch

from ...quant import Int4Weight
from .._common import (
    as_batch,
    check_device,
    check_float,
    check_thr,
    check_vector,
    output,
    use_triton,
)
from .dense import activated, check_epilogue, check_int4, int4_gemv_ref, run
from .kernel import default_config
from .lists import KeptLists, check_lists

__all__ = ["int4_threshold_gemv", "int4_threshold_gemv_ref"]


def int4_threshold_gemv_ref(x: torch.Tensor, w: Int4Weight, thr, *,
                            bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Plain-PyTorch reference (fp32 math): ``(x * (|x| > thr)) @ w.dequantize() + bias``.

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :4], group=32, dtype=torch.float16)
    >>> x = torch.tensor([0.5, -2.0, 1.5, 3.0] + [0.0] * 28).half()
    >>> int4_threshold_gemv_ref(x, w, 1.0).tolist()  # |0.5| <= 1 is dropped
    [0.0, -2.0, 1.5, 3.0]
    """
    t = torch.as_tensor(thr, dtype=torch.float32, device=x.device)
    xm = torch.where(x.float().abs() > t, x.float(), 0.0)
    return int4_gemv_ref(xm.to(x.dtype), w, bias=bias)


def int4_threshold_gemv(x: torch.Tensor, w: Int4Weight, thr: torch.Tensor | float, *,
                        bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        config: dict | None = None, activation: str = "none",
                        gated: bool = False, lists: KeptLists | None = None) -> torch.Tensor:  # fmt: skip
    """``y[b] = sum_i [|x[b,i]| > thr[i]] x[b,i] dequant(w)[i]`` (+ bias), reading kept rows only.

    x: [d_in] or [B, d_in] (B <= 32, fp16/bf16); w: an Int4Weight of ``w_t`` [d_in, d_out]
    with x's dtype; thr: a float (TEAL: one threshold per site, passed to the kernel as a
    number, so a captured graph keeps the value it was captured with; ``-1`` keeps every entry,
    ``inf`` none) or fp32 [d_in] (WINA: ``t / ||W[:, i]||``); bias: [d_out]. Returns [d_out]
    or [B, d_out]. One token runs :mod:`.half2` (a dropped row's codes are neither read nor
    decoded; fp32 atomics; ``config={"mode": "loop"}`` for serial, bitwise-repeatable split
    sums, as batches get), no host sync. ``activation`` / ``gated``: as
    :func:`~dejavu_lab.kernels.int4.int4_gemv` (the MLP's hidden activations in the epilogue).
    ``lists``: one token's kept rows made from this x at this thr (:func:`~.lists.kept_lists`,
    or the epilogue that produced x): the half2 kernel walks them instead of listing its block's
    rows again in every column tile; elsewhere they are not needed and not read.

    >>> from dejavu_lab.quant import quantize
    >>> _ = torch.manual_seed(0)
    >>> w = quantize(torch.randn(64, 32) / 8, group=32, dtype=torch.float16)
    >>> x = torch.randn(2, 64, dtype=torch.float16)  # a union batch of 2 tokens
    >>> y = int4_threshold_gemv(x, w, 0.7)  # TEAL: keep |x| > 0.7, about half
    >>> torch.allclose(y, int4_threshold_gemv_ref(x, w, 0.7), atol=1e-2)
    True
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_int4("w", w, Int4Weight, "quantize(w_t)", dtype, device)
    d_in, d_out = w.shape
    scalar = isinstance(thr, (int, float)) and not isinstance(thr, bool)
    if scalar:
        if thr != thr:
            raise ValueError("thr is NaN; pass a number (inf drops every entry, -1 keeps all).")
    else:
        check_thr(thr, d_in)
        check_device(device, thr=thr)
    check_device(device, bias=bias)
    check_vector("bias", bias, d_out, dtype)
    n_out = check_epilogue(activation, gated, d_out)
    xb, squeeze = as_batch("x", x, d_in)
    if lists is not None:
        check_lists(lists, xb, d_in)
    res, res2 = output(out, xb.shape[0], n_out, squeeze, dtype, device)
    if not use_triton(device):
        res2.copy_(activated(int4_threshold_gemv_ref(xb, w, thr, bias=bias), activation, gated))
        return res
    cfg = default_config(
        xb.shape[0], *w.shape, group=w.group, op="int4_threshold_gemv", device=device
    )
    run(xb, w, res2, {**cfg, **(config or {})}, mode="threshold", thr=thr, bias=bias,
        activation=activation, gated=gated, lists=lists)  # fmt: skip
    return res
