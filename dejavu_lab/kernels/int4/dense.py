"""The dense W4A16 GEMV: ``y = x @ dequant(W) (+ bias)`` for 1-32 tokens, codes read once.

The bytes floor of a 4-bit layer is its codes (half a byte per weight) plus one scale and one
min per ``group`` weights: at ``group=128`` in fp16, 0.53 bytes per weight against fp16's 2
(3.8x fewer). :func:`int4_gemv` runs :mod:`.kernel` with every row kept; :func:`check_int4`
is shared by every int4 wrapper, of either layout.
"""

from __future__ import annotations

import torch

from ...quant import Int4Weight
from .._common import as_batch, check_device, check_float, check_vector, output, use_triton
from .._neurons import FUSED_ACTIVATIONS, act_ref
from .kernel import default_config, launch

__all__ = ["check_int4", "int4_gemv", "int4_gemv_ref"]


def check_int4(name: str, w, layout: type, builder: str, dtype: torch.dtype,
               device: torch.device) -> None:  # fmt: skip
    """``w`` must be an int4 weight of class ``layout`` (:class:`~dejavu_lab.quant.Int4Weight`
    or :class:`~dejavu_lab.quant.Int4Rows`; ``builder``, e.g. ``"quantize(w_t)"``, says how to
    build one) whose scales share x's dtype and whose tensors sit on x's device, contiguous.

    >>> from dejavu_lab.quant import Int4Rows
    >>> check_int4("w", torch.zeros(8, 32, dtype=torch.float16), Int4Rows, "quantize_rows(W)",
    ...            torch.float16, torch.device("cpu"))
    Traceback (most recent call last):
    ...
    TypeError: w must be an Int4Rows (dejavu_lab.quant.quantize_rows(W)), got Tensor.
    """
    if not isinstance(w, layout):
        raise TypeError(
            f"{name} must be an {layout.__name__} (dejavu_lab.quant.{builder}), "
            f"got {type(w).__name__}."
        )
    if w.dtype != dtype:
        raise TypeError(
            f"{name} has {w.dtype} scales but the input is {dtype}; quantise with dtype={dtype}."
        )
    check_device(device, **{f"{name}.packed": w.packed})
    if not all(t.is_contiguous() for t in (w.packed, w.scales, w.mins)):
        raise ValueError(
            f"{name}'s packed, scales and mins must be contiguous; rebuild them with .contiguous()."
        )


def int4_gemv_ref(x: torch.Tensor, w: Int4Weight, *, bias: torch.Tensor | None = None):
    """Plain-PyTorch reference (fp32 math): ``x @ w.dequantize() + bias`` in x's dtype.

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :8], group=32, dtype=torch.float16)  # w_t [32, 8]
    >>> int4_gemv_ref(torch.arange(32.0).half(), w).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    y = x.float() @ w.dequantize(torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_epilogue(activation: str, gated: bool, d_out: int) -> int:
    """The output width of a product followed by ``activation`` (``gated``: ``act(gate) * up``
    of its two halves), or one sentence on what is wrong.

    >>> check_epilogue("silu", True, 384), check_epilogue("none", False, 64)
    (192, 64)
    """
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} must be one of {', '.join(FUSED_ACTIVATIONS)}."
        )
    if gated and d_out % 2:
        raise ValueError(f"gated=True needs an even d_out ([gate | up]), not {d_out}.")
    return d_out // 2 if gated else d_out


def activated(y: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """``act(y)`` or (``gated``) ``act(gate) * up`` of ``y = [gate | up]``, in fp32 then y's dtype.

    >>> activated(torch.tensor([[-1.0, 2.0, 3.0, 4.0]]), "relu", True)
    tensor([[0., 8.]])
    """
    n = y.shape[-1] // 2
    a = act_ref((y[..., :n] if gated else y).float(), activation)
    return (a * y[..., n:].float() if gated else a).to(y.dtype)


def run(xb, w, res2, cfg: dict, *, mode: str, thr=None, bias=None, activation: str = "none",
        gated: bool = False, lists=None) -> None:  # fmt: skip
    """:func:`~.kernel.launch`, with the activation in the finishing launch where one token runs
    the tile or half2 kernel, else the product first and the activation in PyTorch (``lists``:
    a token's kept rows, for the half2 kernel).

    >>> from dejavu_lab.quant import quantize
    >>> w = quantize(torch.eye(32)[:, :16], group=32, dtype=torch.float16)  # w_t [32, 16]
    >>> x, out = -torch.arange(32.0).half()[None], torch.empty(1, 8, dtype=torch.float16)
    >>> run(x, w, out, default_config(1), mode="dense", activation="relu", gated=True)
    >>> out.tolist()  # relu(gate) * up, gate = -x[:8] <= 0
    [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    """
    one = xb.shape[0] == 1 and w.shape[1] % 8 == 0 and cfg.get("mode") in ("tile", "half2")
    if one or (activation == "none" and not gated):
        launch(xb, w, res2, cfg, mode=mode, thr=thr, bias=bias, activation=activation, gated=gated,
               lists=lists)  # fmt: skip
        return
    full = torch.empty(xb.shape[0], w.shape[1], dtype=res2.dtype, device=res2.device)
    launch(xb, w, full, cfg, mode=mode, thr=thr, bias=bias)
    res2.copy_(activated(full, activation, gated))


def int4_gemv(x: torch.Tensor, w: Int4Weight, *, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: dict | None = None,
              activation: str = "none", gated: bool = False) -> torch.Tensor:  # fmt: skip
    """``x @ w.dequantize() + bias``, reading each code byte once.

    x: [d_in] or [B, d_in] (B <= 32, fp16/bf16); w: an Int4Weight of ``w_t`` [d_in, d_out]
    (``nn.Linear.weight.T``) quantised with x's dtype; bias: [d_out]. Returns [d_out] or
    [B, d_out]. One token runs :mod:`.half2` (codes decoded into half2 pairs, fp16 sums of 32
    rows, fp32 atomics: order-dependent in the last bits; ``config={"mode": "tile"}`` decodes
    to fp32, ``config={"mode": "loop"}`` gives the serial, bitwise-repeatable split sums that
    batches use); no host sync
    and a launch shape fixed by the shapes, so the call sits in a CUDA graph (make the first call
    of a shape outside capture: it allocates small per-device buffers). ``config`` overrides
    the tiles (:func:`~dejavu_lab.kernels.int4.kernel.default_config`). ``activation``
    (``gated``: ``act(gate) * up`` of the output's two halves, [.., d_out / 2]) runs in the
    one-token kernels' finishing launch, so an MLP's hidden activations cost no launch of their
    own.

    >>> from dejavu_lab.quant import quantize
    >>> _ = torch.manual_seed(0)
    >>> w = quantize(torch.randn(64, 32) / 8, group=32, dtype=torch.float16)
    >>> x = torch.randn(3, 64, dtype=torch.float16)  # a union batch of 3 tokens
    >>> y = int4_gemv(x, w)  # the Triton kernel on CPU under TRITON_INTERPRET=1
    >>> y.shape, torch.allclose(y, x @ w.dequantize(), atol=1e-2)
    (torch.Size([3, 32]), True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_int4("w", w, Int4Weight, "quantize(w_t)", dtype, device)
    d_in, d_out = w.shape
    check_device(device, bias=bias)
    check_vector("bias", bias, d_out, dtype)
    n_out = check_epilogue(activation, gated, d_out)
    xb, squeeze = as_batch("x", x, d_in)
    res, res2 = output(out, xb.shape[0], n_out, squeeze, dtype, device)
    if not use_triton(device):
        res2.copy_(activated(int4_gemv_ref(xb, w, bias=bias), activation, gated))
        return res
    cfg = default_config(xb.shape[0], *w.shape, group=w.group, op="int4_gemv", device=device)
    run(xb, w, res2, {**cfg, **(config or {})}, mode="dense", bias=bias, activation=activation,
        gated=gated)  # fmt: skip
    return res
