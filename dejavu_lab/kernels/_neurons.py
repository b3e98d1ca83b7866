"""Helpers of the kept-neuron kernels, shared by the MLP, CATS and threshold families: the
activations (in Triton and in PyTorch), the kept rows times each token's x, and block indices
expanded to row indices."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import dot_acc

__all__ = ["FUSED_ACTIVATIONS", "act", "act_ref", "expand_rows", "rows_dot"]

# gelu: exact (erf) form, HF "gelu"; gelu_tanh: HF "gelu_pytorch_tanh" (Gemma's GeGLU)
FUSED_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "none")


@triton.jit
def act(h, ACT: tl.constexpr):
    """``h`` (fp32) through the activation ``ACT``, one of :data:`FUSED_ACTIVATIONS`."""
    if ACT == "relu":
        h = tl.maximum(h, 0.0)
    elif ACT == "gelu":
        h = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    elif ACT == "gelu_tanh":  # tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = h * tl.sigmoid(2.0 * z)
    elif ACT == "silu":
        h = h * tl.sigmoid(h)
    return h


@triton.jit
def rows_dot(rows, x_ptr, offs_b, mask_b, rmask, D, stride_xb,
              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_B] fp32: the rows (pointers [BLOCK_N, 1]) times each token's x."""
    offs_k = tl.arange(0, BLOCK_K)
    if BLOCK_B == 1:
        acc = tl.zeros((rows.shape[0], BLOCK_K), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + offs_k
            mk = cols < D
            xk = tl.load(x_ptr + cols, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(rows + cols[None, :], mask=rmask[:, None] & mk[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            acc += w.to(tl.float32) * xk[None, :]
        res = tl.sum(acc, axis=1)[:, None]
    else:
        res = tl.zeros((rows.shape[0], BLOCK_B), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + offs_k
            mk = cols < D
            xt = tl.load(x_ptr + offs_b[:, None] * stride_xb + cols[None, :],
                         mask=mask_b[:, None] & mk[None, :], other=0.0)  # fmt: skip
            w = tl.load(rows + cols[None, :], mask=rmask[:, None] & mk[None, :], other=0.0)
            res = dot_acc(w, tl.trans(xt), res, UPCAST)
    return res


def act_ref(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in PyTorch (one of :data:`FUSED_ACTIVATIONS`).

    >>> act_ref(torch.tensor([-1.0, 2.0]), "relu")
    tensor([0., 2.])
    """
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    return {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "none": lambda t: t}[activation](h)


def expand_rows(idx: torch.Tensor, g: int) -> torch.Tensor:
    """Block indices -> row indices (block i covers rows i*g .. i*g+g-1)."""
    if g == 1:
        return idx.long()
    return (idx.long()[:, None] * g + torch.arange(g, device=idx.device)).reshape(-1)
