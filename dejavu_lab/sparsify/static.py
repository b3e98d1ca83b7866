"""The static baseline: one set of neurons and heads per layer for every token (Deja Vu §3.1).

The paper's static-sparsity comparison keeps the same units whatever the input: the ones with
the largest average magnitude over a calibration text (:func:`static_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..budgets import budgets, head_gram, head_output_norms, n_keep, topk_mask
from ..hooks import hooks
from .core import SparseContext, _check_windows, register, unit_mask_hooks

__all__ = ["StaticSets", "static_hooks", "static_sets"]


@dataclass
class StaticSets:
    """Per-layer importance of every neuron and head, averaged over a calibration text.

    The paper's static-sparsity baseline keeps the same units for every token; ranking by these
    scores gives those units at any budget.

    >>> sets = StaticSets(mlp_score=torch.tensor([[0.1, 0.5, 0.3, 0.2]]),
    ...                   head_score=torch.tensor([[2.0, 1.0]]), mlp_sparsity=[0.5],
    ...                   head_sparsity=[0.5], n_tokens=16)
    >>> sets.mlp_keep()  # the top half by mean magnitude, for every token
    tensor([[False,  True,  True, False]])
    >>> sets.head_keep(0.0)
    tensor([[True, True]])
    """

    mlp_score: torch.Tensor  # [n_layers, d_mlp] mean |mlp.hook_post| over calibration tokens
    head_score: torch.Tensor  # [n_layers, n_heads] mean ‖z_h W_O,h‖ over calibration tokens
    mlp_sparsity: list[float]  # the budget these sets were asked for (per layer)
    head_sparsity: list[float]
    n_tokens: int  # calibration tokens

    def mlp_keep(self, sparsity=None) -> torch.Tensor:
        """Bool [n_layers, d_mlp]: the kept neurons at ``sparsity`` (default: the set's own)."""
        s = self.mlp_sparsity if sparsity is None else budgets(sparsity, len(self.mlp_score))
        return _top(self.mlp_score, s)

    def head_keep(self, sparsity=None) -> torch.Tensor:
        """Bool [n_layers, n_heads]: the kept heads at ``sparsity`` (default: the set's own)."""
        s = self.head_sparsity if sparsity is None else budgets(sparsity, len(self.head_score))
        return _top(self.head_score, s)


def _top(scores: torch.Tensor, sparsity: list[float]) -> torch.Tensor:
    """Each layer's top units of ``scores`` [n_layers, n] at checked per-layer budgets."""
    return torch.stack(
        [topk_mask(sc, n_keep(si, sc.numel())) for sc, si in zip(scores, sparsity, strict=True)]
    )


@torch.no_grad()
def static_sets(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    mlp_sparsity=0.5,
    head_sparsity=0.3,
    arch: Arch | None = None,
    progress: bool = True,
) -> StaticSets:
    """Choose static neuron/head sets by average magnitude over ``windows`` [n, window].

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> sets = static_sets(model, torch.randint(0, 128, (2, 16)), progress=False)
    >>> sets.n_tokens, sets.mlp_keep().sum(-1).tolist()  # 50% of 192 neurons kept per layer
    (32, [96, 96])
    """
    arch = arch or get_arch(model)
    ms = budgets(mlp_sparsity, arch.n_layers, "mlp_sparsity")
    hs = budgets(head_sparsity, arch.n_layers, "head_sparsity")
    windows = _check_windows(windows)
    mlp_sum = torch.zeros(arch.n_layers, arch.d_mlp, dtype=torch.float64)
    head_sum = torch.zeros(arch.n_layers, arch.n_heads, dtype=torch.float64)
    grams = [head_gram(model, arch, i) for i in range(arch.n_layers)]
    count = 0

    def on_post(t: torch.Tensor, name: str) -> None:
        i = int(name.split(".")[1])
        mlp_sum[i] += t.detach().abs().flatten(0, -2).sum(0).double().cpu()

    def on_z(t: torch.Tensor, name: str) -> None:
        i = int(name.split(".")[1])
        norms = head_output_norms(t.detach(), grams[i].to(t.device))
        head_sum[i] += norms.flatten(0, -2).sum(0).double().cpu()

    device = next(model.parameters()).device
    fns = [("blocks.*.mlp.hook_post", on_post), ("blocks.*.attn.hook_z", on_z)]
    with hooks(model, fns, arch):
        for w in tqdm(windows, desc="static sets", disable=not progress, leave=False):
            model(input_ids=w[None].to(device))
            count += w.numel()
    return StaticSets(
        mlp_score=(mlp_sum / count).float(),
        head_score=(head_sum / count).float(),
        mlp_sparsity=ms,
        head_sparsity=hs,
        n_tokens=count,
    )


@register("static")
def static_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"static"``: the same top units of ``ctx.static`` for every token.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import sparsified
    >>> model = random_model("tiny-llama").model
    >>> sets = static_sets(model, torch.randint(0, 128, (2, 16)), progress=False)
    >>> record = {}
    >>> with sparsified(model, method="static", static=sets, head_sparsity=0.0, record=record):
    ...     _ = model(input_ids=torch.tensor([[1, 2, 3]]))
    >>> bool((record["mlp"][1] == sets.mlp_keep()[1]).all())
    True
    """
    n = len(ctx.static.mlp_score)
    if n != ctx.arch.n_layers or len(ctx.static.head_score) != n:
        raise ValueError(
            f"these static sets have {n} layers but the model has {ctx.arch.n_layers}: they "
            "were computed on another model; compute them on this one with static_sets(model, ...)."
        )
    mlp_sets = _top(ctx.static.mlp_score, ctx.mlp)  # budgets sparsified has checked
    head_sets = _top(ctx.static.head_score, ctx.heads)

    def mlp_keep(i, a, k):
        return mlp_sets[i].to(a.device)

    def head_keep(i, z, k):
        return head_sets[i].to(z.device)

    return unit_mask_hooks(ctx, mlp_keep, head_keep)
