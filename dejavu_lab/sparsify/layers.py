"""Per-layer budgets from each layer's measured sensitivity: spreading a budget over the layers.

TEAL gives every layer the same budget and spreads it over a layer's sites by its greedy search;
R-Sparse searches per-layer budgets too. Layers are not equally robust: on Qwen2.5-Coder-0.5B
the first and the last layer move the model's output several times more than a middle layer
at the same budget. This module measures that and spends the budget where it costs least:

1. **Sensitivity** (:func:`sensitivity`): on calibration text, for each layer ``l`` and each
   budget ``s`` of a grid, run the method with layer ``l`` alone at ``s`` (every other layer
   dense) and measure how far the next-token distribution moves: the KL divergence from the
   dense model's, averaged over tokens. Layers before ``l`` are dense, so the run starts from
   ``l``'s dense input, captured once.
2. **Allocation** (:func:`allocate`): treat the layers' costs as additive, join each layer's
   points ``(0, 0), (s, KL)`` into a curve, take its lower convex hull, and fill the model
   budget with the hull segments of least KL per unit of budget first (exact for such curves).
   The layers of the models here have equal weight bytes, so the mean of the layer budgets is
   the model's share of layer bytes removed: the allocation leaves the bytes per token as they
   were, and moves them between layers.

The variants ``"teal (greedy, layers)"`` etc. of :mod:`~dejavu_lab.sparsify.frontier` run a
method with these budgets (spec key ``"layers": "sensitivity"``); the table of KL values is
cached under ``cache_dir()/layers``, keyed by the model, the method's spec and the text.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..assets import cache_dir
from ..atomic import write_json
from ..budgets import budgets
from ..collect import fingerprint, fingerprint_id
from .calibration import text_hash
from .core import sparsified
from .greedy import layer_inputs

__all__ = ["GRID", "allocate", "cached_sensitivity", "sensitivity"]

GRID = (0.25, 0.4, 0.55, 0.7, 0.8)  # layer budgets measured (TEAL's greedy path ends at 0.8)


def _head(model: nn.Module, arch: Arch) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map from the last layer's output to logits: final norm, then the unembedding."""
    norm, lm_head = arch.final_norm(model), model.get_output_embeddings()
    return lambda h: lm_head(norm(h))


def _from_layer(layers, inputs: dict, head, first: int) -> torch.Tensor:
    """Logits of a forward that starts at layer ``first`` from its captured dense input."""
    args, kwargs = inputs[first]
    h = args[0] if args else kwargs["hidden_states"]
    for i in range(first, len(layers)):
        a, kw = inputs[i]
        out = layers[i](h, *a[1:], **kw) if a else layers[i](**{**kw, "hidden_states": h})
        h = out[0] if isinstance(out, tuple) else out
    return head(h)


def _kl(dense_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over tokens of KL(dense ‖ sparse) of the next-token distributions."""
    logp = F.log_softmax(logits.float(), -1)
    return (dense_logp.exp() * (dense_logp - logp)).sum(-1).mean().item()


@torch.no_grad()
def sensitivity(
    model: nn.Module,
    windows: torch.Tensor,
    kwargs_for: Callable[[list[float]], dict],
    grid: Sequence[float] = GRID,
    *,
    arch: Arch | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """KL from the dense model's next-token distribution, float32 [n_layers, len(grid)]: entry
    ``[l, j]`` with layer ``l`` alone at budget ``grid[j]``, averaged over the tokens of
    ``windows`` [n, w]. ``kwargs_for(budgets)``: :func:`~dejavu_lab.sparsify.sparsified`'s
    keywords for one budget per layer (the method, its thresholds or plan).

    A forward from layer ``l`` reuses the dense input of ``l``; where that does not give the
    model's own logits (a model with more between its last layer and its logits), every
    measurement runs the whole model instead.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    >>> cal = calibrate(m.model, ids, cache=False, progress=False)
    >>> kw = lambda b: {"method": "teal", "thresholds": cal.thresholds("teal", b)}
    >>> kl = sensitivity(m.model, ids, kw, grid=(0.3, 0.7))
    >>> kl.shape, bool((kl[:, 1] > kl[:, 0]).all())  # more removed, further from dense
    (torch.Size([2, 2]), True)
    """
    arch = arch or get_arch(model)
    layers, head = arch.layers(model), _head(model, arch)
    device = next(model.parameters()).device
    runs = []  # per window: (captured layer inputs, dense log-probabilities, partial ok)
    for w in windows:
        ids = w[None].to(device)
        inputs = layer_inputs(model, ids, arch)
        full = model(input_ids=ids, use_cache=False).logits
        partial = _from_layer(layers, inputs, head, 0)
        same = partial.shape == full.shape and torch.allclose(
            partial.float(), full.float(), rtol=1e-3, atol=1e-3
        )
        runs.append((ids, inputs, F.log_softmax(full.float(), -1), same))
    out = torch.zeros(arch.n_layers, len(grid))
    bar = tqdm(total=arch.n_layers * len(grid), desc="layer sensitivity", disable=not progress)
    for i in range(arch.n_layers):
        for j, s in enumerate(grid):
            b = [0.0] * arch.n_layers
            b[i] = float(s)
            total = 0.0
            with sparsified(model, arch=arch, **kwargs_for(b)):
                for ids, inputs, dense_logp, same in runs:
                    if same:
                        logits = _from_layer(layers, inputs, head, i)
                    else:
                        logits = model(input_ids=ids, use_cache=False).logits
                    total += _kl(dense_logp, logits)
            out[i, j] = total / len(runs)
            bar.update()
    bar.close()
    return out


def _hull(xs: list[float], ys: list[float]) -> list[tuple[float, float]]:
    """The lower convex hull of points sorted by x (Andrew's monotone chain, lower half)."""
    hull: list[tuple[float, float]] = []
    for p in zip(xs, ys, strict=True):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            cross = (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1)
            if cross < -1e-6 * (x2 - x1) * (abs(p[1]) + abs(y1) + 1e-30):  # collinear: kept
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(kl: torch.Tensor, sparsity: float, grid: Sequence[float] = GRID) -> list[float]:
    """One budget per layer, their mean ``sparsity``, that minimises the summed KL of
    :func:`sensitivity`'s table ``kl`` [n_layers, len(grid)] (each layer's cost a convex
    piecewise-linear curve through ``(0, 0)`` and its measured points; budgets within
    ``[0, grid[-1]]``).

    >>> kl = torch.tensor([[0.1, 0.4], [0.01, 0.04], [0.02, 0.05]])  # layer 0: the costly one
    >>> [round(b, 3) for b in allocate(kl, 0.3, grid=(0.3, 0.6))]  # layer 0 stays dense
    [0.0, 0.6, 0.3]
    >>> allocate(kl, 0.0, grid=(0.3, 0.6))
    [0.0, 0.0, 0.0]
    >>> allocate(kl, 0.7, grid=(0.3, 0.6))
    Traceback (most recent call last):
    ...
    ValueError: a model budget of 0.7 needs layer budgets above 0.6, the largest measured; measure a grid reaching 0.7 or ask for less.
    """
    (s,) = budgets(sparsity, 1, "sparsity")
    n, top = kl.shape[0], float(grid[-1])
    if s > top + 1e-9:
        raise ValueError(
            f"a model budget of {s:g} needs layer budgets above {top:g}, the largest measured; "
            f"measure a grid reaching {s:g} or ask for less."
        )
    # (KL per unit of budget, where it starts, layer, width): cheapest first; at equal cost the
    # lower budgets first, so layers that cost the same get budgets one grid step apart at most
    segments = []
    for i in range(n):
        hull = _hull([0.0, *map(float, grid)], [0.0, *[max(0.0, float(v)) for v in kl[i]]])
        for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
            slope = float(f"{(y2 - y1) / (x2 - x1):.5g}")  # measured KLs carry no more digits
            segments.append((slope, x1, i, x2 - x1))
    out, need = [0.0] * n, s * n
    for _, _, i, width in sorted(segments):
        if need <= 1e-12:
            break
        take = min(width, need)
        out[i] += take
        need -= take
    return [min(b, top) for b in out]


def cached_sensitivity(
    model: nn.Module,
    windows: torch.Tensor,
    kwargs_for: Callable[[list[float]], dict],
    key: dict,
    grid: Sequence[float] = GRID,
    *,
    arch: Arch | None = None,
    cache: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    """:func:`sensitivity`, read from or written (atomically) to ``cache_dir()/layers``, keyed
    by the model's fingerprint, ``key`` (the method's spec), the text and the grid. A file
    that cannot be read is measured again and replaced.

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    >>> cal = calibrate(m.model, ids, cache=False, progress=False)
    >>> kw = lambda b: {"method": "teal", "thresholds": cal.thresholds("teal", b)}
    >>> with mock.patch.dict(os.environ, DEJAVU_LAB_CACHE=tempfile.mkdtemp()):  # not ~/.cache
    ...     a = cached_sensitivity(m.model, ids, kw, {"method": "teal"}, grid=(0.5,))
    ...     b = cached_sensitivity(m.model, ids, kw, {"method": "teal"}, grid=(0.5,))  # read back
    >>> torch.equal(a, b), tuple(a.shape)
    (True, (2, 1))
    """
    fp = fingerprint(model, arch)
    what = {"key": key, "text": text_hash(windows), "grid": [float(g) for g in grid]}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    path = cache_dir() / "layers" / f"{fingerprint_id(fp)}-{digest[:16]}.json"
    if cache and path.exists():
        try:
            saved = json.loads(path.read_text())
            kl = torch.tensor(saved["kl"], dtype=torch.float32)
            if kl.shape == (len(saved["kl"]), len(grid)) and all(map(math.isfinite, kl.flatten())):
                return kl
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measured again below
    kl = sensitivity(model, windows, kwargs_for, grid, arch=arch, progress=progress)
    if cache:
        write_json(path, {**what, "kl": kl.tolist()})
    return kl
