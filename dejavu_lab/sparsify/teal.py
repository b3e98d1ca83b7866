"""TEAL: magnitude thresholds on the input of every linear layer (Liu et al. 2024, §3–4).

Training-free activation sparsity: zero the entries of a linear layer's input whose magnitude
``|x_i|`` is at or below a per-layer, per-site threshold, so the layer reads only the weight
columns of the surviving entries. Sites (:data:`~dejavu_lab.sparsify.core.SITES`): the shared
input of q/k/v (``attn_in``), the input of o_proj (``o_in``), the shared input of gate/up or
fc1 (``mlp_in``) and the input of down_proj / fc2 (``down_in``). Thresholds come from
calibration histograms (:mod:`~dejavu_lab.sparsify.calibration`); their allocation over the sites
of a layer is uniform or TEAL's greedy search (:mod:`~dejavu_lab.sparsify.greedy`).
"""

from __future__ import annotations

from .calibration import thresholds_for
from .core import SparseContext, register, threshold_hooks
from .refit import refitted

__all__ = ["teal_hooks"]


@register("teal")
def teal_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"teal"``: keep input entry ``i`` iff ``|x_i| > t`` per site.

    >>> import torch
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import Kept, calibrate, sparsified
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.randint(0, 128, (2, 32))
    >>> cal = calibrate(model, ids, cache=False, progress=False)
    >>> kept = Kept()
    >>> with torch.no_grad(), sparsified(model, method="teal", sparsity=0.5, thresholds=cal,
    ...                                   kept=kept):
    ...     _ = model(input_ids=ids)
    >>> round(kept.fractions()[(0, "attn_in")], 2)  # layer 0 sees the calibration's inputs
    0.5
    """
    thr = thresholds_for(ctx).site_thresholds(ctx.model, ctx.arch)
    return refitted(ctx, thr, threshold_hooks(ctx, thr))
