"""DejaVu's predicted sets: low-rank predictors choose neurons and heads (Deja Vu §4.1–4.3).

The sets the predictors of :mod:`dejavu_lab.predictors` choose from the layer input
(``"same"``) or from the previous layer's input (``"lookahead"``, §4.3). Method ``"dejavu"``;
``mode="predicted"`` is its older name.
"""

from __future__ import annotations

import torch

from ..budgets import topk_mask
from .core import SparseContext, register, unit_mask_hooks

__all__ = ["dejavu_hooks"]


def _store(inputs: dict, kind: str):
    def fn(t: torch.Tensor, name: str) -> None:
        inputs[f"{kind}{name.split('.')[1]}"] = t.detach()

    return fn


def _predictor_input(predictors, inputs: dict, layer: int, kind: str) -> torch.Tensor:
    """The tensor a predictor of ``layer`` reads (§4.3): same-layer or lookahead."""
    if predictors.mode == "lookahead":
        return inputs[f"pre{max(layer - 1, 0)}"]
    return inputs[f"pre{layer}"] if kind == "heads" else inputs[f"mid{layer}"]


@register("dejavu")
def dejavu_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"dejavu"``: top-k of the predictors' scores per token.

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> from dejavu_lab.sparsify import sparsified
    >>> model = random_model("tiny-llama").model
    >>> pred = Predictors(fingerprint(model), PredictorConfig(mode="same")).eval()  # untrained
    >>> record = {}
    >>> with sparsified(model, method="dejavu", predictors=pred, sparsity=0.5, record=record):
    ...     _ = model(input_ids=torch.tensor([[1, 2, 3]]))
    >>> record["heads"][1].sum(-1)  # 2 of 4 heads for each token
    tensor([[2, 2, 2]])
    """
    pred, inputs = ctx.predictors, ctx.state
    fns: list = []
    need_pre = any(s > 0 for s in ctx.heads) or (
        pred.mode == "lookahead" and any(s > 0 for s in ctx.mlp)
    )
    need_mid = pred.mode == "same" and any(s > 0 for s in ctx.mlp)
    if need_pre:
        fns.append(("blocks.*.hook_resid_pre", _store(inputs, "pre")))
    if need_mid:
        fns.append(("blocks.*.hook_resid_mid", _store(inputs, "mid")))

    def mlp_keep(i, a, k):
        return topk_mask(pred.mlp_scores(i, _predictor_input(pred, inputs, i, "mlp")), k)

    def head_keep(i, z, k):
        return topk_mask(pred.head_scores(i, _predictor_input(pred, inputs, i, "heads")), k)

    masks = unit_mask_hooks(ctx, mlp_keep, head_keep)
    return fns + masks if masks else []
