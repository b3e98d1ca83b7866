"""TEAL's block-wise greedy allocation of sparsity over a layer's sites (Liu et al. 2024, §4.2).

Uniform TEAL gives every linear input of a layer the same sparsity; the greedy search spends
the layer's budget where it hurts least. For one layer, from its dense input on calibration
text (``greedy_tokens`` tokens of the first window), starting from all sites dense:

1. for each site, try raising its sparsity by one step, using the site's calibrated threshold
   at the new share (:mod:`dejavu_lab.sparsify.calibration`), and run the layer;
2. measure the layer output's error against the dense output — the L2 norm over the hidden
   size, averaged over the last ``greedy_last`` share of positions, as TEAL does;
3. keep the step with the least error added per weight byte removed, record the new point
   ``(layer sparsity, site shares)`` and repeat until the layer sparsity reaches
   ``greedy_max``.

The layer sparsity is bytes-weighted: ``Σ_sites share · elements / layer elements`` with the
elements of :func:`~dejavu_lab.step_bytes.site_elements`. TEAL steps every matrix by
an amount inversely proportional to its size, so each step removes the same bytes and the
least error wins; we do the same (``greedy_step`` of the layer's bytes per step) but cap one
site's step at ``greedy_max_site_step`` so the small attention sites are not moved in coarse
jumps, and compare error per byte. The candidates of a step run as one batch. Our sites are
the four shared inputs (q/k/v share one, as gate/up do), where TEAL thresholds q, k, v, gate
and up separately; one shared mask is what lets a kernel read each input column once.

:meth:`Calibration.site_sparsities` reads a layer budget off this path (interpolating between
steps); every layer gets the same budget, as in TEAL.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..hooks import hooks
from ..step_bytes import site_elements
from ..vocab import METHODS, site_width
from .core import SITES, column_norms

__all__ = ["greedy_path", "layer_inputs"]

_CAP = 0.99  # the largest share one site may remove (budgets are < 1)


@torch.no_grad()
def layer_inputs(model: nn.Module, ids: torch.Tensor, arch: Arch | None = None) -> dict:
    """Each decoder layer's call arguments ``(args, kwargs)`` in a dense forward of ``ids``.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> inputs = layer_inputs(m.model, torch.tensor([[1, 2, 3]]))
    >>> args, kwargs = inputs[1]
    >>> (args[0] if args else kwargs["hidden_states"]).shape  # layer 1's input [b, p, d]
    torch.Size([1, 3, 64])
    """
    arch = arch or get_arch(model)
    captured: dict[int, tuple] = {}

    def grab(i):
        def pre(mod, args, kwargs):
            captured[i] = (args, dict(kwargs))

        return pre

    handles = [
        arch.layer(model, i).register_forward_pre_hook(grab(i), with_kwargs=True)
        for i in range(arch.n_layers)
    ]
    try:
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def _run_layer(layer: nn.Module, args, kwargs, k: int) -> torch.Tensor:
    """The layer's output for ``k`` copies of its captured input: [k, p, d]."""
    if args:
        x = args[0]
        out = layer(x.expand(k, *x.shape[1:]), *args[1:], **kwargs)
    else:
        x = kwargs["hidden_states"]
        out = layer(**{**kwargs, "hidden_states": x.expand(k, *x.shape[1:])})
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def greedy_path(
    model: nn.Module,
    windows: torch.Tensor,
    calibration,
    method: str = "teal",
    *,
    arch: Arch | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """TEAL's greedy path for every layer: float32 [n_layers, steps, 1 + 4].

    Row ``(layer sparsity, attn_in, o_in, mlp_in, down_in)`` after each step (row 0: dense);
    shorter paths are padded with their last row. ``method``: ``"teal"`` or ``"wina"`` (whose
    thresholds divide by the column norms).

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.calibration import CalibrationConfig, calibrate
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (1, 32))
    >>> cal = calibrate(m.model, ids, CalibrationConfig(greedy_max=0.3), cache=False,
    ...                 progress=False)
    >>> path = greedy_path(m.model, ids, cal, "teal", progress=False)
    >>> path.shape[0], bool(path[:, -1, 0].min() >= 0.3)  # every layer reaches the target
    (2, True)
    """
    arch = arch or get_arch(model)
    cfg = calibration.config
    ids = windows[:1, : min(cfg.greedy_tokens, windows.shape[1])]
    inputs = layer_inputs(model, ids, arch)
    paths = []
    for i in tqdm(range(arch.n_layers), desc=f"{method} greedy", disable=not progress):
        paths.append(_layer_path(model, arch, calibration, method, i, inputs.pop(i)))
    steps = max(len(p) for p in paths)
    out = torch.zeros(arch.n_layers, steps, 1 + len(SITES))
    for i, p in enumerate(paths):
        rows = torch.tensor(p, dtype=torch.float32)
        out[i, : len(p)] = rows
        out[i, len(p) :] = rows[-1]
    return out


@torch.no_grad()
def _layer_path(model, arch, cal, method, i, captured) -> list[list[float]]:
    cfg = cal.config
    sites = list(SITES)
    elements = site_elements(arch)
    w = [elements[s] for s in sites]
    total = sum(w)
    step = [min(cfg.greedy_step * total / wp, cfg.greedy_max_site_step) for wp in w]
    weighted = METHODS[method].score == "weighted"  # WINA: t / ||W[:, i]|| per column
    norms = {s: column_norms(model, arch, i, s) for s in sites} if weighted else {}
    layer = arch.layer(model, i)
    args, kwargs = captured
    device = next(model.parameters()).device

    def thr(site: str, s: float) -> torch.Tensor:  # [d_in] (or a scalar)
        if s <= 0:
            return torch.tensor(-1.0)  # keeps everything: |x| > -1
        t = cal.threshold(method, i, site, s)
        return t / norms[site] if weighted else torch.tensor(t)

    current: dict[str, torch.Tensor] = {}  # site -> [k, 1, d_in] thresholds of the batch

    def hook(site):
        def fn(x: torch.Tensor, name: str) -> torch.Tensor:
            t = current[site].to(x.device)
            flat = x.reshape(*x.shape[:2], -1) if site == "o_in" else x
            keep = flat.abs().float() > t
            return torch.where(keep, flat, torch.zeros((), dtype=x.dtype)).reshape(x.shape)

        return fn

    fns = [(f"blocks.{i}.{SITES[s]}", hook(s)) for s in sites]
    target = _run_layer(layer, args, kwargs, 1)  # dense
    start = int(round(target.shape[1] * (1 - cfg.greedy_last)))
    target = target[:, start:]
    s = [0.0] * len(sites)
    rows = [[0.0, *s]]
    err_now = 0.0
    with hooks(model, fns, arch):
        while sum(a * b for a, b in zip(s, w, strict=True)) / total < cfg.greedy_max - 1e-9:
            cands = [j for j in range(len(sites)) if s[j] < _CAP - 1e-9]
            if not cands:
                break
            news = [min(s[j] + step[j], _CAP) for j in cands]
            for j, site in enumerate(sites):  # candidate c moves site cands[c] only
                vals = [thr(site, news[c] if cands[c] == j else s[j]) for c in range(len(cands))]
                current[site] = torch.stack([v.expand(site_width(arch, site)) for v in vals])[
                    :, None
                ]
            out = _run_layer(layer, args, kwargs, len(cands))[:, start:]
            err = (out - target).float().norm(dim=-1).mean(-1).to(device)  # [k]
            gain = [
                (float(err[c]) - err_now) / ((news[c] - s[cands[c]]) * w[cands[c]])
                for c in range(len(cands))
            ]
            best = min(range(len(cands)), key=gain.__getitem__)
            s[cands[best]] = news[best]
            err_now = float(err[best])
            rows.append([sum(a * b for a, b in zip(s, w, strict=True)) / total, *s])
    return rows
