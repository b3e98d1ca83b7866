"""Budgets and the unit scores every sparsity method shares (Deja Vu §3.1, §4).

A budget is a sparsity — the fraction of units REMOVED (the paper's "85% MLP sparsity" keeps
15% of the neurons) — given as one number or one per layer, each in [0, 1). This module turns
budgets into counts (:func:`n_keep`) and masks (:func:`topk_mask`), and scores attention heads
by their output norm ``‖z_h W_O,h‖`` without materialising per-head outputs (:func:`head_gram`,
:func:`head_output_norms`).

It sits below :mod:`dejavu_lab.sparsify`, :mod:`dejavu_lab.predictors`,
:mod:`dejavu_lab.collect` and the engine, and imports none of them, so the arrows run one way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .arch import Arch

__all__ = ["budgets", "head_gram", "head_output_norms", "n_keep", "topk_mask"]


def budgets(value, n_layers: int, what: str = "sparsity") -> list[float]:
    """Validate a sparsity (fraction removed): a number or one per layer, each in [0, 1).

    >>> budgets(0.5, 3)
    [0.5, 0.5, 0.5]
    >>> budgets(1.0, 3)
    Traceback (most recent call last):
    ...
    ValueError: sparsity must be in [0, 1) (the fraction removed; 0 = dense), got 1.0.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(
            f"{what} must be a number in [0, 1) or a list of {n_layers} of them, got {value!r}."
        )
    if isinstance(value, Sequence) or hasattr(value, "__len__"):
        values = list(value)
        if len(values) != n_layers:
            raise ValueError(
                f"{what} has {len(values)} entries but the model has {n_layers} layers; "
                f"pass one number or one per layer."
            )
    else:
        values = [value] * n_layers
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be numbers in [0, 1), got {v!r}.") from None
        if isinstance(v, bool) or not math.isfinite(f) or not 0.0 <= f < 1.0:
            where = "" if len(set(map(str, values))) == 1 else f" at layer {i}"
            raise ValueError(
                f"{what} must be in [0, 1) (the fraction removed; 0 = dense), got {v!r}{where}."
            )
        out.append(f)
    return out


def n_keep(sparsity: float, n: int) -> int:
    """How many of ``n`` units a sparsity keeps: ``n - round(s * n)``, at least one.

    >>> n_keep(0.85, 3072)  # the paper's 85% MLP sparsity on OPT-125m's 3072 neurons
    461
    >>> n_keep(0.99, 4)
    1
    """
    return max(1, n - round(sparsity * n))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` largest ``scores`` along the last dim (same shape).

    >>> topk_mask(torch.tensor([[0.1, 0.7, 0.3, 0.9]]), 2)
    tensor([[False,  True, False,  True]])
    """
    n = scores.shape[-1]
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    idx = scores.topk(k, dim=-1, sorted=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


# head output norms ‖z_h W_O,h‖ without materialising [b, p, h, d]


def head_gram(model: nn.Module, arch: Arch, layer: int) -> torch.Tensor:
    """G_h = W_O,hᵀ W_O,h for each head: [h, dh, dh] (float32).

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> head_gram(model, arch, layer=0).shape  # 4 heads of 16 dims
    torch.Size([4, 16, 16])
    """
    w = arch.part(model, layer, "o").weight.detach().float()  # [d, h*dh]
    w = w.view(w.shape[0], arch.n_heads, arch.d_head)
    return torch.einsum("dhi,dhj->hij", w, w)


def head_output_norms(z: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per-head output norms ‖z_h W_O,h‖ from z [..., h, dh] and the Gram [h, dh, dh]: [..., h].

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-opt")
    >>> z = torch.randn(3, arch.n_heads, arch.d_head)  # [tokens, h, dh]
    >>> w_o = arch.part(model, 0, "o").weight.detach().view(-1, arch.n_heads, arch.d_head)
    >>> direct = torch.einsum("thi,dhi->thd", z, w_o).norm(dim=-1)  # each head's output, [t, h]
    >>> torch.allclose(head_output_norms(z, head_gram(model, arch, 0)), direct, atol=1e-5)
    True
    """
    zf = z.float()
    sq = torch.einsum("...hi,hij,...hj->...h", zf, gram, zf)
    return sq.clamp_min(0).sqrt()
