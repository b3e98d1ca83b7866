"""TEAL's greedy allocation over a layer's sites, run on a top-k method's own transform.

:mod:`~dejavu_lab.sparsify.greedy` spends a layer's budget where TEAL's thresholds hurt least;
a rotated or low-rank site loses differently (the rotation compacts attn_in and mlp_in, not
down_in), so the shares that suit TEAL need not suit it. :func:`search_path` runs the same
search — from all sites dense, raise the site whose next step adds the least output error per
weight byte removed, on ``greedy_tokens`` tokens of calibration text, with the step sizes of a
:class:`~dejavu_lab.sparsify.calibration.CalibrationConfig` (its defaults) — but each candidate applies the
method's own site transform at the candidate's share. The path has TEAL's layout
(``[n_layers, steps, 1 + 4]``: layer sparsity, then the shares of attn_in, o_in, mlp_in,
down_in) and is read the same way (:func:`~dejavu_lab.sparsify.topk.site_shares`,
``allocation="search"``). It is kept on the moments (``moments.cache``) and, when they came
from a cache file, in a file beside it (keyed by the method's options and the greedy
settings, with the fingerprint; written atomically).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..hooks import hooks
from ..step_bytes import site_elements
from ..vocab import SITES
from .calibration import CalibrationConfig
from .greedy import _CAP, _run_layer, layer_inputs
from .thresholds import CalibrationError, _load, _save

__all__ = ["SEARCH_FORMAT", "search_path"]

SEARCH_FORMAT = "dejavu-lab-search/1"


@torch.no_grad()
def search_path(
    model: nn.Module,
    moments,
    site_plan,
    transform,
    key,
    *,
    config: CalibrationConfig | None = None,
    arch: Arch | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """The greedy path float32 [n_layers, steps, 1 + 4] of a top-k method.

    ``site_plan(layer, site, share)``: the method's :class:`~dejavu_lab.sparsify.topk.SitePlan`;
    ``transform(plan, site, x, cache)``: ``(x', keep)``, the site's input as the method leaves
    it; ``key``: the method and options (the path is cached on ``moments`` under it). The text
    is the first calibration window the moments kept.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import larosa
    >>> from dejavu_lab.sparsify.moments import calibrate_moments
    >>> m = random_model("tiny-llama")
    >>> mo = calibrate_moments(m.model, torch.randint(0, 128, (1, 32)), cache=False,
    ...                        progress=False)
    >>> p = larosa.plan(m.model, mo, 0.5, allocation="search")
    >>> path = mo.cache[("path", "larosa", tuple(sorted(p.options.items())))]
    >>> path.shape[0], bool(path[:, -1, 0].min() >= 0.8)  # every layer reaches greedy_max
    (2, True)
    """
    arch = arch or get_arch(model)
    config = config or CalibrationConfig()
    method, opts = key
    ck = ("path", method, tuple(sorted({**opts, "allocation": "search"}.items())))
    if ck in moments.cache:
        return moments.cache[ck]
    file = _file(moments, ck, config)
    if file is not None and file.exists():
        try:
            tensors, meta = _load(file, SEARCH_FORMAT, "search path")
            if json.loads(meta["fingerprint"]) == moments.fingerprint:
                moments.cache[ck] = tensors["path"]
                return tensors["path"]
        except (CalibrationError, KeyError, ValueError):
            pass  # damaged: search again and overwrite
    ids = moments.ids[:1, : config.greedy_tokens]
    inputs = layer_inputs(model, ids, arch)
    paths = []
    for i in tqdm(range(arch.n_layers), desc=f"{method} search", disable=not progress):
        paths.append(_layer(model, arch, config, i, inputs.pop(i), site_plan, transform))
    steps = max(len(p) for p in paths)
    out = torch.zeros(arch.n_layers, steps, 1 + len(SITES))
    for i, p in enumerate(paths):
        rows = torch.tensor(p, dtype=torch.float32)
        out[i, : len(p)] = rows
        out[i, len(p) :] = rows[-1]
    moments.cache[ck] = out
    if file is not None:
        meta = {"format": SEARCH_FORMAT, "fingerprint": json.dumps(moments.fingerprint)}
        _save({"path": out}, {**meta, "key": repr(ck)}, file)
    return out


def _file(moments, ck, config: CalibrationConfig) -> Path | None:
    """Beside the moments' cache file: one path per method, options and greedy settings."""
    if moments.path is None:
        return None
    h = hashlib.sha256(f"{ck!r}{config.greedy_key()}".encode()).hexdigest()[:10]
    return moments.path.with_name(f"{moments.path.stem}.search-{h}.safetensors")


def _layer(model, arch, cfg, i, captured, site_plan, transform) -> list[list[float]]:
    sites = list(SITES)
    elements = site_elements(arch)
    w = [elements[s] for s in sites]
    total = sum(w)
    step = [min(cfg.greedy_step * total / wp, cfg.greedy_max_site_step) for wp in w]
    layer = arch.layer(model, i)
    args, kwargs = captured
    current: dict[str, object] = {}  # site -> SitePlan of the candidate being run (or absent)
    caches: dict = {s: {} for s in sites}

    def hook(site):
        def fn(x: torch.Tensor, name: str):
            sp = current.get(site)
            return None if sp is None else transform(sp, site, x, caches[site])[0]

        return fn

    target = _run_layer(layer, args, kwargs, 1)
    start = int(round(target.shape[1] * (1 - cfg.greedy_last)))
    target = target[:, start:]
    s = [0.0] * len(sites)
    rows = [[0.0, *s]]
    err_now = 0.0
    with hooks(model, [(f"blocks.{i}.{SITES[x]}", hook(x)) for x in sites], arch):
        while sum(a * b for a, b in zip(s, w, strict=True)) / total < cfg.greedy_max - 1e-9:
            cands = [j for j in range(len(sites)) if s[j] < _CAP - 1e-9]
            if not cands:
                break
            best = None
            for j in cands:
                new = min(s[j] + step[j], _CAP)
                for k, site in enumerate(sites):
                    share = new if k == j else s[k]
                    if share > 0:
                        current[site] = site_plan(i, site, share)
                        caches[site].clear()  # a new plan: its tensors are moved again
                    else:
                        current.pop(site, None)
                out = _run_layer(layer, args, kwargs, 1)[:, start:]
                err = float((out - target).float().norm(dim=-1).mean())
                gain = (err - err_now) / ((new - s[j]) * w[j])
                if best is None or gain < best[0]:
                    best = (gain, j, new, err)
            _, j, new, err_now = best
            s[j] = new
            rows.append([sum(a * b for a, b in zip(s, w, strict=True)) / total, *s])
    return rows
