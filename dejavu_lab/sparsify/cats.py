"""CATS: contextually-aware thresholding of the gate (Lee et al. 2024, §3).

Compute the gate projection densely; keep MLP neuron ``j`` for a token iff
``|act(gate_j · x)| > t`` (SiLU for SwiGLU models; for ReLU OPT, ``|relu(fc1_j · x)|``) with a
per-layer threshold calibrated for a target share of neurons removed; the up and down
projections then read only the surviving neurons' rows and columns. Applied here by reading
``mlp.hook_pre`` and masking ``mlp.hook_post``.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from .calibration import thresholds_for
from .core import SparseContext, _apply, register

__all__ = ["cats_hooks"]


@register("cats")
def cats_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"cats"``: keep neuron ``j`` iff ``|act(gate_j x)| > t`` per layer.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate, sparsified
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.randint(0, 128, (2, 32))
    >>> cal = calibrate(model, ids, cache=False, progress=False)
    >>> record = {}
    >>> with torch.no_grad(), sparsified(model, method="cats", sparsity=0.7, thresholds=cal,
    ...                                   record=record):
    ...     _ = model(input_ids=ids)
    >>> round(record["mlp"][0].float().mean().item(), 1)  # 30% of neurons kept on average
    0.3
    """
    per_layer = thresholds_for(ctx).site_thresholds(ctx.model, ctx.arch)  # one float a layer
    act = ACT2FN[ctx.arch.activation]
    fns = []
    for (i, _site), thr in sorted(per_layer.items()):
        if i in ctx.dense:
            continue
        fns.append((f"blocks.{i}.mlp.hook_pre", _gate_reader(ctx, i, thr, act)))
        fns.append((f"blocks.{i}.mlp.hook_post", _gate_masker(ctx, i)))
    return fns


def _gate_reader(ctx, i, thr: float, act):
    def fn(g: torch.Tensor, name: str) -> None:  # g: [b, p, n], the gate before its activation
        ctx.state[f"cats{i}"] = act(g.detach().float()).abs() > thr

    return fn


def _gate_masker(ctx, i):
    def fn(a: torch.Tensor, name: str) -> torch.Tensor:  # a: [b, p, n]
        keep = ctx.state.pop(f"cats{i}")
        if ctx.record is not None:
            ctx.record["mlp"][i] = keep.cpu()
        if ctx.kept is not None:
            ctx.kept.add(i, "gate", keep)
        return _apply(a, keep)

    return fn
