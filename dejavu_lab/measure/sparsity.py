"""Contextual sparsity exists (Deja Vu §3.1, Fig. 2–3): per token, few neurons and heads matter.

For each token and layer we ask how much of the block is *active*:

- MLP neurons, from ``mlp.hook_post`` (the activation feeding W2 / down_proj). A ReLU model (OPT)
  has exact zeros: active = non-zero (criterion ``"zeros"``, the paper's measure). A gated model
  (SwiGLU: SmolLM2, Llama) has none, so active = the fewest neurons holding a share ``mass`` of
  the token's sum of absolute activations (criterion ``"mass"``, magnitude sparsity in the CATS/TEAL
  sense), or a fixed top ``keep`` fraction (criterion ``"topk"``).
- Attention heads, from the per-head output norm ‖W_O^h z^h‖ (``attn.hook_result``): active =
  the fewest heads holding ``mass`` of the sum of head-output norms (the paper ranks heads by
  output norm, §4.2).

Sparsity is the share *not* active, ``1 − |S| / total``, as in the paper.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from ..arch import Arch, get_arch
from ._run import check_fraction, stream, token_frame

__all__ = [
    "CRITERIA",
    "activation_sparsity",
    "active_mask",
    "contextual_sparsity",
    "criterion_label",
    "default_criterion",
    "needed_count",
]

CRITERIA = ("zeros", "mass", "topk")


def default_criterion(arch: Arch) -> str:
    """``"zeros"`` for plain ReLU MLPs (OPT), ``"mass"`` for everything else (SwiGLU, GELU).

    >>> from dejavu_lab.models import PRESETS
    >>> default_criterion(get_arch(PRESETS["opt-125m"].config()))
    'zeros'
    >>> default_criterion(get_arch(PRESETS["llama-2-7b"].config()))
    'mass'
    """
    return "zeros" if (not arch.gated and arch.activation == "relu") else "mass"


def criterion_label(criterion: str, mass: float = 0.9, keep: float | None = None) -> str:
    """How "active" was decided, in words, for tables and figure captions.

    >>> criterion_label("zeros")
    'active = non-zero (ReLU exact zeros)'
    >>> criterion_label("mass", mass=0.8)
    'active = fewest units holding 80% of |activation| mass'
    """
    if criterion == "zeros":
        return "active = non-zero (ReLU exact zeros)"
    if criterion == "mass":
        return f"active = fewest units holding {mass:.0%} of |activation| mass"
    return f"active = top {keep:.0%} by |activation|"


def needed_count(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Fewest entries (largest first) holding ``mass`` of the sum of ``scores`` [..., n] ≥ 0.

    Returns a LongTensor [...]; 0 where all scores are zero.

    >>> needed_count(torch.tensor([[4.0, 3.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), 0.7)
    tensor([2, 0])
    """
    check_fraction("mass", mass, closed=True)
    s = scores.float().sort(dim=-1, descending=True).values
    total = s.sum(-1, keepdim=True)
    # entries strictly before the one that crosses the threshold, plus that one
    k = (s.cumsum(-1) < mass * total * (1 - 1e-6)).sum(-1) + 1
    k = k.clamp(max=scores.shape[-1])
    return torch.where(total.squeeze(-1) > 0, k, torch.zeros_like(k))


def active_mask(
    scores: torch.Tensor,
    criterion: str = "mass",
    *,
    mass: float = 0.9,
    keep: float | None = None,
) -> torch.Tensor:
    """Boolean [..., n]: which units are active for each row of ``scores`` [..., n].

    ``scores`` are activations (signs are ignored) or non-negative head-output norms.

    >>> a = torch.tensor([[4.0, -3.0, 2.0, 1.0]])
    >>> active_mask(a, "mass", mass=0.7)  # 4 + 3 hold 70% of the mass 10
    tensor([[ True,  True, False, False]])
    >>> active_mask(a, "topk", keep=0.25)
    tensor([[ True, False, False, False]])
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {', '.join(CRITERIA)}, got {criterion!r}.")
    a = scores.abs()
    if criterion == "zeros":
        return a != 0
    n = a.shape[-1]
    if criterion == "topk":
        if keep is None:
            raise ValueError("criterion='topk' needs keep, the fraction of units kept, in (0, 1].")
        k = torch.full(a.shape[:-1], math.ceil(check_fraction("keep", keep, closed=True) * n))
    else:
        k = needed_count(a, mass)
    order = a.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n, device=a.device).expand_as(order))
    return rank < k.to(a.device).unsqueeze(-1)


def activation_sparsity(
    scores: torch.Tensor,
    criterion: str = "mass",
    *,
    mass: float = 0.9,
    keep: float | None = None,
) -> torch.Tensor:
    """1 − (active share) per row of ``scores`` [..., n]: FloatTensor [...].

    >>> activation_sparsity(torch.zeros(2, 8), "zeros")
    tensor([1., 1.])
    """
    if criterion == "mass":  # no mask needed: the count is enough
        return 1 - needed_count(scores.abs(), mass).float() / scores.shape[-1]
    return 1 - active_mask(scores, criterion, mass=mass, keep=keep).float().mean(-1)


def contextual_sparsity(
    model,
    windows: torch.Tensor,
    *,
    criterion: str = "auto",
    mass: float = 0.9,
    head_mass: float = 0.9,
    keep: float | None = None,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> pd.DataFrame:
    """Per layer and token: the share of MLP neurons and of heads that are *not* needed.

    ``windows``: LongTensor [n, window]. ``criterion`` for neurons: ``"auto"`` (exact zeros for
    ReLU models, else ``"mass"``), ``"zeros"``, ``"mass"`` (share ``mass`` of ``|act|``) or
    ``"topk"`` (``keep``); heads always use the ``head_mass`` share of head-output norm.

    Returns one row per (layer, block, window, pos) with columns ``layer``, ``block``
    (``"mlp"`` or ``"heads"``), ``window``, ``pos``, ``sparsity``, ``criterion`` (in words).

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")  # ReLU: exact zeros
    >>> df = contextual_sparsity(model, torch.randint(0, 128, (2, 8)))
    >>> df.groupby("block").sparsity.mean().round(1).to_dict()  # ReLU zeros about half
    {'heads': 0.0, 'mlp': 0.5}
    """
    arch = arch or get_arch(model)
    crit = default_criterion(arch) if criterion == "auto" else criterion
    labels = {
        "mlp": criterion_label(crit, mass, keep),
        "heads": criterion_label("mass", head_mass) + " (head-output norm)",
    }
    chunks: list[dict[str, np.ndarray]] = []

    def make_hooks(cursor):
        def record(t: torch.Tensor, name: str) -> None:
            layer = int(name.split(".")[1])
            if name.endswith("mlp.hook_post"):  # t: [b, p, n_neurons]
                block, sp = "mlp", activation_sparsity(t, crit, mass=mass, keep=keep)
            else:  # attn.hook_result t: [b, p, h, d] -> head norms [b, p, h]
                block, sp = "heads", activation_sparsity(t.norm(dim=-1), "mass", mass=head_mass)
            w, p = cursor.window_ids(t.shape[1])
            n = w.size
            chunks.append(
                {
                    "layer": np.full(n, layer, dtype=np.int16),
                    "block": np.full(n, block),
                    "window": w,
                    "pos": p,
                    "sparsity": sp.flatten().cpu().numpy().astype(np.float32),
                }
            )

        return {"blocks.*.mlp.hook_post": record, "blocks.*.attn.hook_result": record}

    stream(model, windows, make_hooks, arch=arch, batch_size=batch_size, progress=progress)
    df = token_frame(chunks)
    df["criterion"] = df["block"].map(labels)
    return df.sort_values(["block", "layer", "window", "pos"], ignore_index=True)
