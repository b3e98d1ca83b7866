"""CATS's hidden activations on int4 weights: every gate row, then the kept neurons' up rows.

CATS (Lee et al. 2024, ``lee2024cats``) keeps neuron ``j`` of token ``b`` iff
``|act(gate_j . x_b)| > thr[j]`` and computes ``h = act(gate) * (up . x)`` there, zero elsewhere;
the down projection then reads only the kept rows of ``W2ᵀ``
(:func:`~dejavu_lab.kernels.int4.int4_threshold_gemv` at threshold 0). On a rows-layout
:class:`~dejavu_lab.quant.Int4Rows` of ``W_in = [gate; up]`` (``[2n, d]``) one launch of
:func:`~dejavu_lab.kernels.int4.up.int4_up_kernel` (``MODE=2``) does the middle: each program
reads its ``BLOCK_N`` gate rows, forms the keep mask in registers, and reads the up rows only
of the neurons some token keeps (a row no token keeps is masked off the load: its ``d / 2``
code bytes and its scales never move). For an fc1 MLP (ReLU/GELU, ``[n, d]``) it is
``act(fc1 x)`` where kept. No index list, no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from ...quant import Int4Rows
from .._common import (
    as_batch,
    check_device,
    check_float,
    check_thr,
    check_vector,
    output,
    use_triton,
)
from .._neurons import FUSED_ACTIVATIONS, act_ref
from .dense import check_int4
from .up import configured, launch

__all__ = ["int4_cats_up", "int4_cats_up_ref"]


def int4_cats_up_ref(x: torch.Tensor, w: Int4Rows, thr: torch.Tensor, *, activation: str,
                     bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Plain-PyTorch reference (fp32 math): ``a = act(gate . x + b)``, ``h = a * (up . x + b)``
    (gated) or ``a`` (fc1) where ``|a| > thr``, else 0, rounded to x's dtype.

    >>> from dejavu_lab.quant import quantize_rows
    >>> w = quantize_rows(torch.eye(32)[:4], group=32, dtype=torch.float16)  # gate 0, 1; up 2, 3
    >>> x = torch.tensor([0.5, 2.0, 3.0, 4.0] + [0.0] * 28).half()
    >>> int4_cats_up_ref(x, w, torch.ones(2), activation="relu")  # neuron 0: 0.5 <= 1, dropped
    tensor([0., 8.], dtype=torch.float16)
    """
    wd = w.dequantize(torch.float32)
    n = thr.shape[0]
    b = torch.zeros(w.shape[0], device=wd.device) if bias is None else bias.float()
    a = act_ref(x.float() @ wd[:n].T + b[:n], activation)
    h = a * (x.float() @ wd[n:].T + b[n:]) if w.shape[0] == 2 * n else a
    return torch.where(a.abs() > thr.float(), h, 0.0).to(x.dtype)


def int4_cats_up(x: torch.Tensor, w: Int4Rows, thr: torch.Tensor, *, activation: str,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``h[b, j] = act(gate_j . x_b) * (up_j . x_b)`` where ``|act(gate_j . x_b)| > thr[j]``, else 0.

    x: [d] or [B, d] (B <= 32, fp16/bf16); w: an :class:`~dejavu_lab.quant.Int4Rows` of ``W_in``,
    ``[2n, d]`` (gate rows then up rows) or ``[n, d]`` (fc1: ``h = act(fc1 . x)`` where kept),
    with x's dtype; thr: fp32 [n] thresholds on ``|act(gate)|``; activation: one of ``relu``,
    ``gelu``, ``gelu_tanh``, ``silu``; bias: [2n] or [n]. Returns h [n] or [B, n]. An up row is
    read iff some token keeps its neuron. ``config`` overrides the tiles
    (:func:`~dejavu_lab.kernels.int4.up.default_config`).

    >>> from dejavu_lab.quant import quantize_rows
    >>> _ = torch.manual_seed(0)
    >>> w = quantize_rows(torch.randn(128, 64) / 4, group=32, dtype=torch.float16)  # 64 neurons
    >>> x, thr = torch.randn(64, dtype=torch.float16), torch.full((64,), 0.3)
    >>> h = int4_cats_up(x, w, thr, activation="silu")  # Triton on CPU (interpreter)
    >>> torch.allclose(h, int4_cats_up_ref(x, w, thr, activation="silu"), atol=1e-2)
    True
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_int4("w", w, Int4Rows, "quantize_rows(W)", dtype, device)
    rows, d = w.shape
    if not isinstance(thr, torch.Tensor):
        raise TypeError(f"thr must be a torch.Tensor, got {type(thr).__name__}.")
    n = thr.shape[0] if thr.dim() == 1 else -1
    if rows not in (n, 2 * n):
        raise ValueError(f"w has {rows} rows; pass 2n = {2 * n} (gate then up) or n = {n} (fc1) "
                         f"rows for thr's {n} neurons.")  # fmt: skip
    check_thr(thr, n)
    check_device(device, thr=thr, bias=bias)
    if activation not in FUSED_ACTIVATIONS or activation == "none":
        raise ValueError(f"activation {activation!r} is not one of {FUSED_ACTIVATIONS[:-1]}.")
    check_vector("bias", bias, rows, dtype)
    xb, squeeze = as_batch("x", x, d)
    res, res2 = output(out, xb.shape[0], n, squeeze, dtype, device)
    if not use_triton(device) or n == 0:
        res2.copy_(int4_cats_up_ref(xb, w, thr, activation=activation, bias=bias))
        return res
    launch(xb, w, res2, configured(xb.shape[0], config, "cats"), mode="cats", thr=thr,
           gated=rows == 2 * n, activation=activation, bias=bias)  # fmt: skip
    return res
