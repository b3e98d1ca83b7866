"""Log-spaced score histograms, the form a calibration keeps its scores in.

A score goes to one of ``bins`` log-spaced bins over ``10**log10_min … 10**log10_max`` (plus
one bin below, zero included, and one above), so a calibration keeps counts, not activations;
:func:`quantile` reads the threshold that removes a share of them and :func:`mass_below` the
share a threshold removes. ``cfg`` is anything with ``bins``, ``log10_min`` and ``log10_max``
(:class:`~dejavu_lab.sparsify.calibration.CalibrationConfig`).
"""

from __future__ import annotations

import math

import torch

from ..errors import CalibrationError

__all__ = ["bucket", "mass_below", "quantile"]


def bucket(scores: torch.Tensor, cfg) -> torch.Tensor:
    """Bin index of each score: 0 below 10**log10_min (and zero), bins + 1 above the max.

    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(bins=4, log10_min=-2.0, log10_max=2.0)  # one bin per decade
    >>> bucket(torch.tensor([0.0, 0.05, 1.5, 1e6]), cfg).tolist()
    [0, 1, 3, 5]
    """
    lg = torch.log10(scores.detach().float().flatten())
    idx = ((lg - cfg.log10_min) * (cfg.bins / (cfg.log10_max - cfg.log10_min))).floor() + 1
    return idx.nan_to_num(0.0, posinf=cfg.bins + 1, neginf=0.0).clamp(0, cfg.bins + 1).long()


def quantile(hist: torch.Tensor, s: float, cfg) -> float:
    """The score ``t`` with a share ``s`` of the histogram's mass at or below it.

    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(bins=4, log10_min=-2.0, log10_max=2.0)
    >>> hist = torch.tensor([0.0, 0.0, 2.0, 2.0, 0.0, 0.0])  # half in 0.1-1, half in 1-10
    >>> quantile(hist, 0.5, cfg)
    1.0
    """
    cdf = hist.double().cumsum(0)
    total = float(cdf[-1])
    if total <= 0:
        raise CalibrationError("an empty histogram: calibrate on at least one window.")
    target = s * total
    j = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype)))
    if j == 0:
        return 0.0
    if j >= cfg.bins + 1:
        return 10.0**cfg.log10_max
    before = float(cdf[j - 1])
    inside = float(hist[j])
    frac = 0.0 if inside <= 0 else min(max((target - before) / inside, 0.0), 1.0)
    width = (cfg.log10_max - cfg.log10_min) / cfg.bins
    return 10.0 ** (cfg.log10_min + (j - 1 + frac) * width)


def mass_below(hist: torch.Tensor, t: float, cfg) -> float:
    """Share of the histogram's mass at or below score ``t`` (the inverse of :func:`quantile`).

    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(bins=4, log10_min=-2.0, log10_max=2.0)
    >>> mass_below(torch.tensor([0.0, 0.0, 2.0, 2.0, 0.0, 0.0]), 1.0, cfg)
    0.5
    """
    total = float(hist.sum())
    if t <= 0:
        return float(hist[0]) / total
    pos = (math.log10(t) - cfg.log10_min) * cfg.bins / (cfg.log10_max - cfg.log10_min)
    if pos >= cfg.bins:
        return 1.0 - float(hist[-1]) / total
    pos = max(pos, 0.0)
    j = int(pos)
    return (float(hist[: j + 1].sum()) + (pos - j) * float(hist[j + 1])) / total
