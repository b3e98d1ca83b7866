"""WINA: TEAL's rule with weight-informed scores (Chen et al. 2025, §3).

Keep input entry ``i`` of a site iff ``|x_i| · ‖W[:, i]‖₂ > t``, where ``W`` is the site's
weight stacked by rows (``[Wq; Wk; Wv]`` for ``attn_in``, ``[Wgate; Wup]`` for ``mlp_in``): an
entry matters by how much it moves the output, not by its magnitude alone. The same sites,
calibration and allocations as :mod:`~dejavu_lab.sparsify.teal`; for a kernel it is a
per-column threshold ``t / ‖W[:, i]‖₂`` on ``|x_i|``. WINA also proposes an orthogonalising
transformation of the weights to tighten its error bound; we use the scores on the model's own
weights.
"""

from __future__ import annotations

from .calibration import thresholds_for
from .core import SparseContext, register, threshold_hooks
from .refit import refitted

__all__ = ["wina_hooks"]


@register("wina")
def wina_hooks(ctx: SparseContext) -> list:
    """Builder of method ``"wina"``: keep entry ``i`` iff ``|x_i| · ‖W[:, i]‖₂ > t`` per site.

    >>> import torch
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate, sparse_eval
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.randint(0, 128, (2, 32))
    >>> cal = calibrate(model, ids, cache=False, progress=False)
    >>> r = sparse_eval(model, ids, method="wina", sparsity=0.5, thresholds=cal, progress=False)
    >>> round(r.bytes_per_token_fraction, 1)  # about half of every site's columns are read
    0.5
    """
    thr = thresholds_for(ctx).site_thresholds(ctx.model, ctx.arch)
    return refitted(ctx, thr, threshold_hooks(ctx, thr))
