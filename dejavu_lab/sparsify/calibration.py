"""Calibrated thresholds for TEAL, WINA and CATS, from streamed histograms.

The threshold methods zero an input entry when its *score* is at or below a per-layer,
per-site threshold ``t``. A target sparsity ``s`` (share of entries zeroed) fixes ``t`` as the
``s``-quantile of the score over calibration text:

==========  =============================  =====================================================
method      score of input entry ``i``     sites (per layer)
==========  =============================  =====================================================
``teal``    ``|x_i|``                      attn_in, o_in, mlp_in, down_in (:data:`SITES`)
``wina``    ``|x_i| · ‖W[:, i]‖₂``         the same; W = the site's weights stacked by rows
``cats``    ``|act(gate_j x)|``            gate (one per MLP neuron)
==========  =============================  =====================================================

:func:`calibrate` runs the dense model over the calibration windows once and adds every score
to a log-spaced histogram per (layer, site) (:mod:`~dejavu_lab.sparsify.histogram`; 4096 bins
over 1e-8…1e4 by default: a quantile is resolved to 0.7% in value), so no activation is kept;
the :class:`Calibration` then gives thresholds for any sparsity and allocation
(:meth:`Calibration.thresholds`). TEAL's greedy
allocation (:mod:`dejavu_lab.sparsify.greedy`) is computed on request and stored with it.

Calibrations are cached under ``cache_dir()/calibration``, keyed by the model fingerprint, a
hash of the calibration tokens (:func:`text_hash`) and the :class:`CalibrationConfig`
(:func:`default_path`). The :class:`Calibration`, its config and its file live in
:mod:`~dejavu_lab.sparsify.calibration_data` (importable from here as well);
:func:`thresholds_for` gives a threshold method's builder its thresholds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import atomic
from ..arch import Arch, get_arch
from ..collect import fingerprint, fingerprint_id, note_stale
from ..hooks import hooks
from ..vocab import METHODS
from .calibration_data import (
    KINDS,
    Calibration,
    CalibrationConfig,
    greedy_allocates,
    load_calibration,
)
from .core import SITES, _check_windows, column_norms
from .histogram import bucket
from .thresholds import CalibrationError, Thresholds, load_thresholds

__all__ = [
    "KINDS",
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "Thresholds",
    "calibrate",
    "default_path",
    "greedy_allocates",
    "load_calibration",
    "load_thresholds",
    "text_hash",
    "thresholds_for",
]  # CalibrationError, Thresholds and load_thresholds live in dejavu_lab.sparsify.thresholds;
# KINDS, Calibration, CalibrationConfig, greedy_allocates and load_calibration in
# dejavu_lab.sparsify.calibration_data

# the input-sparse methods and their scores, histogrammed at each input site
_INPUT = {m.name: m.score for m in METHODS.values() if m.input_sparse}


def text_hash(windows: torch.Tensor) -> str:
    """sha256 of calibration token ids [n, window] (shape included), the cache key's text part.

    >>> text_hash(torch.tensor([[1, 2, 3]])) == text_hash(torch.tensor([[1, 2], [3, 4]]))
    False
    """
    h = hashlib.sha256(str(tuple(windows.shape)).encode())
    h.update(windows.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def default_path(fp: dict, text_sha: str, config: CalibrationConfig) -> Path:
    """The cache file :func:`calibrate` uses (nothing is created).

    >>> from dejavu_lab.models import random_model
    >>> fp = fingerprint(random_model("tiny-llama").model)
    >>> default_path(fp, "0123456789abcdef", CalibrationConfig()).name
    'llama-L2-d64-...-0123456789ab-....safetensors'
    """
    from ..assets import cache_dir

    name = f"{fingerprint_id(fp)}-{text_sha[:12]}-{config.key()}.safetensors"
    return cache_dir() / "calibration" / name


@torch.no_grad()
def calibrate(
    model: nn.Module,
    windows: torch.Tensor,
    config: CalibrationConfig = CalibrationConfig(),
    *,
    greedy: Sequence[str] = (),
    arch: Arch | None = None,
    cache: bool = True,
    progress: bool = True,
) -> Calibration:
    """Histograms of every method's scores over ``windows`` [n, window], cached.

    ``greedy``: methods (``"teal"``, ``"wina"``) whose greedy allocation to compute as well
    (a few minutes for the demo model on one CPU core; stored in the same cache file).
    ``cache``: read and write ``default_path(...)`` under :func:`dejavu_lab.assets.cache_dir`.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> cal = calibrate(m.model, torch.randint(0, 128, (1, 32)), cache=False, progress=False,
    ...                 greedy=["teal"])
    >>> cal.greedy_table("teal").shape[-1]  # layer sparsity + 4 site shares per step
    5
    """
    arch = arch or get_arch(model)
    windows = _check_windows(windows)
    for g in greedy:
        if not greedy_allocates(g):
            names = " and ".join(m.name for m in METHODS.values() if greedy_allocates(m.name))
            raise CalibrationError(f"greedy allocations exist for {names}, got {g!r}.")
    fp = fingerprint(model, arch)
    sha = text_hash(windows)
    path = default_path(fp, sha, config)
    if not cache:
        return _calibrate(model, arch, windows, config, greedy, fp, sha, None, progress)
    # one process calibrates; another one asking for the same waits, then loads its file
    lock = path.with_name(f".{path.name}.lock")
    with atomic.locked(lock, what="calibrating this model on this text", hint=_HINT):
        atomic.clean_partials(path.parent)  # a killed run's temporary (we hold the lock)
        return _calibrate(model, arch, windows, config, greedy, fp, sha, path, progress)


_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space, or pass cache=False"


def _calibrate(model, arch, windows, config, greedy, fp, sha, path, progress) -> Calibration:
    """:func:`calibrate`'s work: read the cache file at ``path`` (None: no cache) or compute
    the histograms, then the greedy paths missing; each stage saved whole as it finishes, so a
    run killed in the greedy search resumes from the histograms."""
    cal = None
    if path is not None and path.exists():
        try:
            cal = load_calibration(path, model, arch)
        except CalibrationError:
            cal = None  # damaged or from an older version: recompute and replace it
    if cal is None:
        if path is not None and not path.exists():
            note_stale(path, fp, "calibration")
        cal = _histograms(model, arch, windows, config, fp, sha, progress)
        if path is not None:
            cal.save(path)
    cal.config = config  # the same histograms; the greedy fields may differ
    missing = [g for g in greedy if cal.greedy_table(g) is None]
    if missing:
        from .greedy import greedy_path

        for g in missing:
            table = greedy_path(model, windows, cal, g, arch=arch, progress=progress)
            cal.greedy[f"{g}.{config.greedy_key()}"] = table
        if path is not None:
            cal.save(path)
    return cal


def _histograms(model, arch, windows, cfg, fp, sha, progress) -> Calibration:
    from transformers.activations import ACT2FN

    L, B = arch.n_layers, cfg.bins + 2
    hist = {m: torch.zeros(L, len(s), B, dtype=torch.float64) for m, s in KINDS.items()}
    norms = {(i, s): column_norms(model, arch, i, s) for i in range(L) for s in SITES}
    act = ACT2FN[arch.activation]
    device = next(model.parameters()).device

    def add(method, i, j, scores):
        idx = bucket(scores, cfg)
        hist[method][i, j] += torch.bincount(idx, minlength=B).double().cpu()

    def on_site(site):
        j = tuple(SITES).index(site)

        def fn(x: torch.Tensor, name: str) -> None:
            i = int(name.split(".")[1])
            a = x.detach().abs().float()
            a = a.reshape(*a.shape[:2], -1) if site == "o_in" else a
            for method, score in _INPUT.items():
                add(method, i, j, a * norms[(i, site)].to(a.device) if score == "weighted" else a)

        return fn

    def on_gate(g: torch.Tensor, name: str) -> None:
        add("cats", int(name.split(".")[1]), 0, act(g.detach().float()).abs())

    fns = [(f"blocks.*.{point}", on_site(site)) for site, point in SITES.items()]
    fns.append(("blocks.*.mlp.hook_pre", on_gate))
    with hooks(model, fns, arch):
        for w in tqdm(windows, desc="calibration", disable=not progress, leave=False):
            model(input_ids=w[None].to(device), use_cache=False)
    return Calibration(fp, sha, windows.numel(), cfg, hist)


def thresholds_for(ctx) -> Thresholds:
    """The :class:`Thresholds` a threshold method's builder applies, from its context.

    ``ctx.thresholds`` is a :class:`Calibration` (thresholds for ``ctx.sparsity`` and
    ``ctx.allocation`` are computed from it) or ready :class:`Thresholds` of the method.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.core import SparseContext
    >>> m = random_model("tiny-llama")
    >>> cal = calibrate(m.model, torch.randint(0, 128, (1, 16)), cache=False, progress=False)
    >>> ctx = SparseContext(m.model, m.arch, "cats", [0.0] * 2, [0.0] * 2, sparsity=[0.5, 0.0],
    ...                     thresholds=cal)
    >>> list(thresholds_for(ctx).values)  # layer 1 has no budget: it runs dense
    [(0, 'gate')]
    """
    method, src = ctx.method, ctx.thresholds
    if src is None:
        raise ValueError(
            f"method={method!r} needs thresholds=calibrate(model, windows) (a Calibration) or "
            "ready Thresholds; see dejavu_lab.sparsify.calibration."
        )
    if isinstance(src, Calibration):
        src.check_model(ctx.model, ctx.arch)
        if ctx.sparsity is None:
            raise ValueError(f"method={method!r} with a Calibration needs sparsity=.")
        # sparsified checked ctx.sparsity and set its dense layers to 0
        return src._thresholds(method, ctx.sparsity, ctx.allocation)
    if not isinstance(src, Thresholds):
        raise ValueError(
            f"thresholds must be a Calibration or Thresholds, got {type(src).__name__}."
        )
    if src.method != method:
        raise ValueError(f"these thresholds are for {src.method!r}, not {method!r}.")
    if ctx.sparsity is not None:
        raise ValueError(
            "ready Thresholds carry their own sparsity; pass sparsity= with a Calibration instead."
        )
    src.check_model(ctx.model, ctx.arch)
    if ctx.dense:
        keep = {k: v for k, v in src.values.items() if k[0] not in ctx.dense}
        src = Thresholds(src.method, keep, src.sparsity, src.fingerprint, src.allocation, src.info)
    return src
