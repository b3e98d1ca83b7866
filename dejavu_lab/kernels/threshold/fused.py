"""The tile GEMV joined to its neighbours for the engine's decode step (batch 1): the
thresholded product left as fp32 sums for an epilogue, with the previous launch's activation
finished on its input (:func:`threshold_sums`), and the MLP's input projection with the
activation in its finalize (:func:`threshold_gemv_act`).

Both run :mod:`.tile`'s kernels with the config :func:`~.gemv.default_config` picks, and fall
back to :func:`~.gemv.threshold_gemv` (or return None) where the tile kernel would not run.
"""

from __future__ import annotations

import torch

from .._common import check_rowmajor, use_triton
from .._neurons import FUSED_ACTIVATIONS, act_ref
from .gemv import default_config, threshold_gemv
from .tile import TILE_B1, fits, launch

__all__ = ["threshold_gemv_act", "threshold_sums"]


def threshold_sums(x: torch.Tensor, w_t: torch.Tensor, thr, *, kind: str = "sums",
                   x_act: str = "", x_gated: bool = False, x_bias=None,
                   keep_gate: bool = False) -> torch.Tensor | None:  # fmt: skip
    """One token's thresholded product ``sum_i [|x_i| > thr_i] x_i w_t[i]`` left as fp32 sums
    [d_out] in the per-device workspace ``kind``, with no finalize: the caller's next launch
    takes them and leaves zeros (:func:`~dejavu_lab.kernels.rope.epilogue.rope_sums`, :func:`~dejavu_lab.kernels.rope.epilogue.residual_norm`),
    or the next GEMV into that workspace is wrong. With ``x_act`` (an activation), x is
    itself a previous call's sums, finished in this kernel: ``x_act(x + x_bias)``, or with
    ``x_gated`` ``act(gate) * up`` of x's halves, rounded to w_t's dtype before the threshold
    — the MLP's hidden activations without their own launch (the caller then zeroes x).
    ``keep_gate`` (with ``x_act``): CATS's rule instead of the threshold on x — row r is kept
    iff ``|x_act(gate_r + bias_r)| > thr[r]`` (thr: fp32 [d_in], CATS's per-neuron thresholds).
    Runs the tile config :func:`~dejavu_lab.kernels.threshold_gemv` would pick for the shape;
    returns None where it would not run the tile kernel (a union batch, the CPU without the
    interpreter, a weight past int32 offsets, a tuned table that picks the compacting kernel):
    call that instead. No input checks (the engine calls it inside a CUDA graph).

    >>> import torch.nn.functional as F
    >>> from dejavu_lab.kernels import threshold_gemv_ref
    >>> x, w_t = torch.randn(1, 32).half(), (torch.randn(32, 16) / 4).half()
    >>> ws = threshold_sums(x, w_t, 0.5, kind="hidden")  # CPU: under TRITON_INTERPRET=1
    >>> torch.allclose(ws.half(), threshold_gemv_ref(x, w_t, 0.5)[0], atol=1e-2)
    True
    >>> w2 = (torch.randn(8, 4) / 4).half()  # a down projection of the 8 gated neurons
    >>> h = (F.silu(ws[:8]) * ws[8:]).half()[None]
    >>> y = threshold_sums(ws, w2, 0.1, x_act="silu", x_gated=True)
    >>> torch.allclose(y.half(), threshold_gemv_ref(h, w2, 0.1)[0], atol=1e-2)
    True
    >>> _ = ws.zero_(), y.zero_()  # what the epilogues do
    """
    xb = x.view(1, -1) if x.dim() == 1 else x
    if xb.shape[0] != 1 or not use_triton(x.device) or not fits(w_t):
        return None
    base = default_config(1, w_t.shape[0], w_t.shape[1], device=x.device)
    if base.get("mode", "tile") != "tile":
        return None
    return launch(xb, w_t, thr, None, None, {**TILE_B1, **base}, kind=kind, x_act=x_act,
                  x_gated=x_gated, x_bias=x_bias, keep_gate=keep_gate)  # fmt: skip


def threshold_gemv_act(x: torch.Tensor, w_t: torch.Tensor, thr, *, activation: str,
                       gated: bool, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One token's thresholded MLP input projection with the activation fused into the
    finalize: ``act(g) * u`` for ``w_t = [W_gate | W_up].T`` (gated), else ``act(x W^T + b)``.

    x: [1, d] or [d] (fp16/bf16); w_t: [d, 2n] (gated) or [d, n]; thr: a float or fp32 [d].
    Returns [1, n] (or [n]). Saves the activation's own launches (two for SwiGLU) against
    :func:`~dejavu_lab.kernels.threshold_gemv` followed by torch. Union batches and the CPU
    without the interpreter run that pair.

    >>> import torch.nn.functional as F
    >>> from dejavu_lab.kernels import threshold_gemv_ref
    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(1, 32, dtype=torch.float16)
    >>> w_t = torch.randn(32, 16, dtype=torch.float16) / 4  # gate and up of n = 8 neurons
    >>> h = threshold_gemv_act(x, w_t, 0.5, activation="silu", gated=True)
    >>> a = threshold_gemv_ref(x, w_t, 0.5).float()
    >>> torch.allclose(h.float(), F.silu(a[:, :8]) * a[:, 8:], atol=1e-2)
    True
    """
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(FUSED_ACTIVATIONS)}.")
    d_out = w_t.shape[-1]
    if gated and d_out % 2:
        raise ValueError(
            f"a gated w_t needs an even number of columns (gate then up), got {d_out}."
        )
    xb = x.view(1, -1) if x.dim() == 1 else x
    if xb.shape[0] != 1 or not use_triton(x.device) or not fits(w_t):
        a = threshold_gemv(xb, w_t, thr, bias=bias)
        h = act_ref(a[..., : d_out // 2] if gated else a, activation)
        h = h * a[..., d_out // 2 :] if gated else h
        return h.view(-1) if x.dim() == 1 else h
    check_rowmajor("w_t", w_t)
    out = torch.empty((1, d_out // 2 if gated else d_out), dtype=x.dtype, device=x.device)
    launch(xb, w_t, thr, bias, out, {**TILE_B1}, activation=activation, gated=gated)
    return out.view(-1) if x.dim() == 1 else out
