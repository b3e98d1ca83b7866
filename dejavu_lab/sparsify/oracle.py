"""The oracle: the ideal sets, chosen per token from the true activations (Deja Vu §3.1).

Keeps the top-(1 − s) fraction of MLP neurons by ``|mlp.hook_post|`` and of query heads by
their output norm ``‖z_h W_O,h‖`` — the "contextual sparsity" upper bound any predictor aims at.
"""

from __future__ import annotations

from ..budgets import head_gram, head_output_norms, topk_mask
from .core import SparseContext, register, unit_mask_hooks

__all__ = ["oracle_hooks"]


@register("oracle")
def oracle_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"oracle"``: top-k neurons by ``|activation|``, heads by output norm.

    >>> import torch
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import sparsified
    >>> model = random_model("tiny-llama").model
    >>> record = {}
    >>> with sparsified(model, method="oracle", mlp_sparsity=0.5, record=record):
    ...     _ = model(input_ids=torch.tensor([[1, 2, 3]]))
    >>> record["mlp"][0].sum(-1)  # 96 of 192 neurons kept for each token
    tensor([[96, 96, 96]])
    """
    grams = {
        i: head_gram(ctx.model, ctx.arch, i) for i in range(ctx.arch.n_layers) if ctx.heads[i] > 0
    }

    def mlp_keep(i, a, k):
        return topk_mask(a.detach().abs(), k)

    def head_keep(i, z, k):
        return topk_mask(head_output_norms(z.detach(), grams[i].to(z.device)), k)

    return unit_mask_hooks(ctx, mlp_keep, head_keep)
