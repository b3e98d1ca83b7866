"""CATS (Lee et al. 2024, ``lee2024cats``): dense gate, threshold fused, up/down of the kept only.

CATS keeps neuron j of token b iff ``|act(gate_j . x_b)| > thr[j]`` (a per-layer threshold
calibrated for a target sparsity) and computes up and down only for the kept neurons. Here every
program of :func:`~.fused_mlp.fused_mlp_kernel` (``CATS=True``) computes the gate of its
``BLOCK_N`` neurons densely, applies the threshold, and reads up and down rows only for the
neurons some token keeps (masked row loads: a skipped row costs no memory traffic). Launch shape
fixed by the shapes; no host sync. The kernel writes ``h`` (zero where dropped) and
:func:`~.threshold_gemv` over the nonzero entries of ``h`` reduces the down projection in a
fixed order (two launches; the one-launch atomic variant was removed, see :mod:`.fused_mlp`).
"""

from __future__ import annotations

import torch

from . import _workspace
from ._common import check_device, check_thr, output, use_triton
from .fused_mlp import check_mlp, check_mode, default_config, hidden_ref, launch
from .threshold_gemv import threshold_gemv

__all__ = ["cats_mlp", "cats_mlp_ref"]


def cats_mlp_ref(x, w_gate_up, w_down_t, thr, *, activation, b_in=None, b_down=None):
    """Plain-PyTorch CATS reference: keep neuron j of token b iff ``|act(gate_j . x_b)| > thr[j]``.

    ``w_gate_up`` [2n, d] (gate rows then up rows: SwiGLU/GeGLU) or [n, d] (fc1: ReLU/GELU MLP).

    >>> x = torch.ones(1, 2, dtype=torch.float16)
    >>> w_in = torch.tensor([[1.0, 1.0], [0.5, 0.0], [3.0, 0.0]], dtype=torch.float16)  # fc1
    >>> w_down_t = torch.ones(3, 2, dtype=torch.float16)
    >>> cats_mlp_ref(x, w_in, w_down_t, torch.ones(3), activation="relu")  # 0.5 <= 1: dropped
    tensor([[5., 5.]], dtype=torch.float16)
    """
    xb = x if x.dim() == 2 else x[None]
    n = w_down_t.shape[0]
    gated = w_gate_up.shape[0] == 2 * n
    a, u = hidden_ref(xb, w_gate_up, n, activation=activation, gated=gated, b_in=b_in)
    h = torch.where(a.abs() > thr.float(), a if u is None else a * u, 0.0)
    y = h.to(x.dtype).float() @ w_down_t.float()
    if b_down is not None:
        y = y + b_down.float()
    y = y.to(x.dtype)
    return y if x.dim() == 2 else y[0]


def cats_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down_t: torch.Tensor,
    thr: torch.Tensor,
    *,
    activation: str,
    b_in: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    deterministic: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """CATS: dense gate, threshold fused, up and down rows read only for the kept neurons.

    x: [d] or [B, d] (B <= 32); w_gate_up: [2n, d] (gate rows then up rows; SwiGLU/GeGLU) or
    [n, d] (fc1 of a ReLU/GELU MLP: ``h = act(fc1 . x + b)`` kept where ``|h| > thr``);
    w_down_t: [n, d]; thr: fp32 [n]. Neuron j counts for token b iff
    ``|act(gate_j . x_b)| > thr[j]``; its up and down rows are read iff some token keeps it.
    No host sync, launch shape fixed by the shapes (CUDA-graph capturable). Two launches
    without atomics (h, then :func:`~.threshold_gemv`): the same bits on every call
    (``deterministic`` changes nothing; kept for callers of the removed one-launch mode).

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2, 16, dtype=torch.float16)  # a union batch of 2 tokens
    >>> w = torch.randn(128, 16, dtype=torch.float16) / 4  # gate + up of n = 64 neurons
    >>> w_down_t = torch.randn(64, 16, dtype=torch.float16) / 8
    >>> thr = torch.full((64,), 0.3)  # |silu(gate)| > 0.3 survives
    >>> y = cats_mlp(x, w, w_down_t, thr, activation="silu")
    >>> torch.allclose(y, cats_mlp_ref(x, w, w_down_t, thr, activation="silu"), atol=1e-2)
    True
    """
    xb, squeeze, n, d = check_mlp(x, w_gate_up, w_down_t, activation, b_in, b_down)
    dtype, device = x.dtype, x.device
    if w_gate_up.shape[0] not in (n, 2 * n):
        raise ValueError(f"w_gate_up has {w_gate_up.shape[0]} rows; expected 2n = {2 * n} "
                         f"(gate then up) or n = {n} (fc1) for w_down_t's {n} neurons.")  # fmt: skip
    gated = w_gate_up.shape[0] == 2 * n
    check_thr(thr, n)
    check_device(device, thr=thr)
    batch = xb.shape[0]
    res, res2 = output(out, batch, d, squeeze, dtype, device)
    if not use_triton(device):
        res2.copy_(cats_mlp_ref(xb, w_gate_up, w_down_t, thr, activation=activation, b_in=b_in,
                                b_down=b_down))  # fmt: skip
        return res
    cfg = {**default_config("cats", batch, d, n, n, device=device), **(config or {})}
    check_mode(cfg)
    h = torch.empty((batch, n), dtype=dtype, device=device)
    launch(xb, w_gate_up, None, thr, b_in, h, cats=True, gated=gated, activation=activation, k=n,
           n=n, cfg=cfg)  # fmt: skip
    zeros = _workspace.buffer(device, "zero_thresholds", n, torch.float32)[:n]
    threshold_gemv(h, w_down_t, zeros, bias=b_down, out=res2, deterministic=True,
                   config=cfg.get("down"))  # fmt: skip
    return res
