"""Site shares for a refit: move sparsity onto the site the refit leaves alone, at equal bytes.

TEAL's greedy allocation (:mod:`~dejavu_lab.sparsify.greedy`) splits a layer's budget over its
four sites by how much each site's plain mask hurts the block's output. A refit
(:mod:`~dejavu_lab.sparsify.refit`) then makes three of them — attention's and the MLP's
inputs, attention's output — cheaper to sparsify, but not the MLP's inner input (``down_in``),
so the shares chosen for plain masks are no longer the best ones. :func:`tilt` raises
``down_in``'s sparsity by ``t`` in every layer and lowers the refitted sites' by the same bytes;
:func:`choose_tilt` picks ``t`` among :data:`TILTS` per budget on the calibration text alone:
each candidate's refit is fitted on all calibration windows but the first, and the candidate
with the lowest perplexity on that first window wins.

Side runs on Qwen2.5-0.5B and 1.5B (WINA, greedy shares, layers, refit; chapter 42's text, not
recorded) found the direction: moving 0.1–0.2 of ``down_in``'s sparsity the other way (onto
the refitted sites) cost 10–26 perplexity points at 50%, while this way 0.05–0.1 gained 1–2.6
points at 40% and 50% of the sparsity; 0.2 was too far on the 0.5B.
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..step_bytes import site_elements
from .evaluate import sparse_eval
from .refit import SITES as REFIT_SITES
from .refit import fit_refit
from .thresholds import Thresholds

__all__ = ["TILTS", "choose_tilt", "tilt"]

TILTS = (0.0, 0.05, 0.1)  # down_in sparsity added per layer (0: the greedy shares as they are)
CAP = 0.97  # no site's sparsity is raised above this


def tilt(thresholds: Thresholds, cal, arch: Arch, t: float) -> Thresholds:
    """``thresholds`` with ``down_in``'s sparsity raised by ``t`` in each layer that sparsifies
    it (at most to :data:`CAP`) and each refitted site's lowered by the same bytes, shared in
    equal sparsity points (a site at 0 stays dense; what it cannot give, the others do not
    make up: never more bytes than before). ``cal``: the :class:`~dejavu_lab.sparsify.
    calibration.Calibration` the thresholds came from, which turns sparsities into thresholds.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> m = random_model("tiny-llama")
    >>> cal = calibrate(m.model, torch.randint(0, 128, (1, 32)), cache=False, progress=False)
    >>> thr = cal.thresholds("teal", 0.5)
    >>> t = tilt(thr, cal, m.arch, 0.1)
    >>> round(t.sparsity[(0, "down_in")] - thr.sparsity[(0, "down_in")], 3)
    0.1
    >>> w = site_elements(m.arch)  # equal bytes: what down_in drops, the three sites keep
    >>> sites = ("attn_in", "o_in", "mlp_in", "down_in")
    >>> moved = sum(w[s] * (thr.sparsity[(0, s)] - t.sparsity[(0, s)]) for s in sites)
    >>> abs(moved) < 1e-6
    True
    """
    if not 0 <= t < 1:
        raise ValueError(f"t={t!r} must be a share of down_in's entries in [0, 1).")
    w, alloc = site_elements(arch), dict(thresholds.sparsity)  # weights per site
    for i in sorted({k[0] for k in alloc}):
        down = (i, "down_in")
        if down not in alloc:
            continue
        raised = min(CAP, alloc[down] + t) - alloc[down]
        givers = [(i, s) for s in REFIT_SITES if alloc.get((i, s), 0.0) > 0]
        if raised <= 0 or not givers:
            continue
        each = raised * w["down_in"] / sum(w[s] for _, s in givers)  # equal points, equal bytes
        given = 0.0
        for k in givers:
            new = max(0.0, alloc[k] - each)
            given += (alloc[k] - new) * w[k[1]]
            alloc[k] = new
        alloc[down] += given / w["down_in"]  # all of it, or what the givers could give
    alloc = {k: v for k, v in alloc.items() if v > 0}
    values = {k: cal.threshold(thresholds.method, *k, v) for k, v in alloc.items()}
    return Thresholds(thresholds.method, values, alloc, thresholds.fingerprint,
                      thresholds.allocation, {**thresholds.info, "tilt": t})  # fmt: skip


def choose_tilt(model: nn.Module, calib: torch.Tensor, thresholds: Thresholds, cal, *,
                tilts=TILTS, arch: Arch | None = None, dense_layers=()) -> tuple[float, dict]:  # fmt: skip
    """``(t, {t: perplexity})``: the tilt of ``thresholds`` among ``tilts`` whose refit, fitted
    on ``calib[1:]``, gives the lowest perplexity on ``calib[:1]`` (calibration text only; the
    fits are not cached: they see a part of it). Needs at least two calibration windows.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    >>> cal = calibrate(m.model, ids, cache=False, progress=False)
    >>> t, ppl = choose_tilt(m.model, ids, cal.thresholds("teal", 0.5), cal, tilts=(0.0, 0.1))
    >>> t in ppl and sorted(ppl) == [0.0, 0.1]
    True
    """
    arch = arch or get_arch(model)
    if calib.dim() != 2 or calib.shape[0] < 2:
        raise ValueError(
            f"choose_tilt scores on the first calibration window and fits on the rest: pass at "
            f"least 2 windows, got shape {tuple(calib.shape)}."
        )
    ppl = {}
    for t in tilts:
        thr = tilt(thresholds, cal, arch, t) if t else thresholds
        r = fit_refit(model, calib[1:], thr.site_thresholds(model, arch), arch=arch,
                      cache=False, progress=False)  # fmt: skip
        res = sparse_eval(model, calib[:1], method=thr.method, thresholds=thr, refit=r,
                          dense_layers=tuple(dense_layers), progress=False)  # fmt: skip
        ppl[t] = float(res.perplexity)
    return min(ppl, key=ppl.get), ppl
