"""What a method builds from calibration text before it runs, one rule for every command.

``perplexity`` and ``eval-tasks`` choose the calibration text differently (the first one keeps
it apart from the scored text); once they have it, :func:`from_calibration` reads the method's
row of :data:`dejavu_lab.vocab.METHODS`: static sets for ``static``, second moments for the
top-k family (LaRoSA, R-Sparse: their plans are built from them), histogram thresholds for the
threshold family, with TEAL's greedy search over a layer's sites for the methods whose default
allocation is ``greedy`` (``--allocation uniform`` turns it off).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..vocab import Method
from .args import static_sets_for

__all__ = ["cache_relative", "from_calibration"]


def from_calibration(args, spec: Method, model, calib: torch.Tensor, kw: dict, arch=None) -> dict:
    """Add to ``kw`` (the budgets) what ``spec`` needs from ``calib`` [n, window]; return the
    JSON's note of where it came from (a cached file, relative to the cache folder).

    >>> import argparse, torch
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.vocab import method
    >>> m = random_model("tiny-llama").model
    >>> args = argparse.Namespace(no_progress=True, allocation=None)
    >>> kw = {"sparsity": 0.5}
    >>> info = from_calibration(args, method("larosa"), m, torch.randint(0, 128, (1, 16)), kw)
    >>> type(kw["thresholds"]).__name__, kw["allocation"], info["calibration_file"][:12]
    ('Moments', 'uniform', 'calibration/')
    """
    progress = not args.no_progress
    allocation = getattr(args, "allocation", None) or spec.allocation
    if spec.needs == "static sets":
        kw["static"] = static_sets_for(model, calib, kw, args)
        return {}
    if spec.needs != "calibration":
        return {}
    if spec.family == "topk":
        from ..sparsify import calibrate_moments

        kw["thresholds"] = calibrate_moments(model, calib, arch=arch, progress=progress)
    else:
        from ..sparsify import calibrate

        # TEAL's greedy search over a layer's sites exists for the methods defaulting to it
        greedy = [spec.name] if allocation == "greedy" and spec.allocation == "greedy" else []
        kw["thresholds"] = calibrate(model, calib, greedy=greedy, arch=arch, progress=progress)
    kw["allocation"] = allocation
    return {"calibration_file": cache_relative(kw["thresholds"].path)}


def cache_relative(path) -> str | None:
    """A file under the cache directory as a path relative to it (what a JSON result records:
    the same on every machine); any other path as given.

    >>> from dejavu_lab.assets import cache_dir
    >>> cache_relative(cache_dir() / "calibration" / "x.safetensors")
    'calibration/x.safetensors'
    """
    from ..assets import cache_dir

    if path is None:
        return None
    try:
        return str(Path(path).relative_to(cache_dir()))
    except ValueError:
        return str(path)
