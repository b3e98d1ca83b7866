"""The :class:`Calibration`: score histograms per layer and site, and the thresholds they give.

A calibration holds, for every threshold method (:data:`KINDS`: its sites), one log-spaced
histogram of the scores per (layer, site) (:mod:`~dejavu_lab.sparsify.histogram`) over a
calibration text, and TEAL's greedy paths (:mod:`dejavu_lab.sparsify.greedy`) computed on
request; it gives thresholds for any sparsity and allocation (:meth:`Calibration.thresholds`).
:class:`CalibrationConfig` says how it is made; every field enters the cache key. Calibrations
and the :class:`~dejavu_lab.sparsify.thresholds.Thresholds` they give save as safetensors
carrying the fingerprint (:meth:`Calibration.save`, :func:`load_calibration`), and loading one
for another model is a ``CalibrationError``. Files are written under a temporary name and
renamed. :func:`~dejavu_lab.sparsify.calibration.calibrate` makes one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..arch import Arch
from ..budgets import budgets
from ..checks import configs as check_configs
from ..vocab import CALIBRATION_FORMAT, METHODS
from .histogram import mass_below, quantile
from .thresholds import CalibrationError, Thresholds, _check_fingerprint, _load, _save

__all__ = ["KINDS", "Calibration", "CalibrationConfig", "greedy_allocates", "load_calibration"]

# method -> its sites, for every threshold method of the table
KINDS = {m.name: m.sites for m in METHODS.values() if m.family == "threshold"}
FORMAT = CALIBRATION_FORMAT


def greedy_allocates(method: str) -> bool:
    """Whether TEAL's greedy allocation over a layer's sites applies to ``method``: the methods
    whose default allocation it is in :data:`dejavu_lab.vocab.METHODS`.

    >>> greedy_allocates("wina"), greedy_allocates("cats")
    (True, False)
    """
    spec = METHODS.get(method)
    return spec is not None and spec.allocation == "greedy"


@dataclass(frozen=True)
class CalibrationConfig:
    """How to calibrate. Every field enters the cache key.

    >>> cfg = CalibrationConfig(greedy_step=0.05)
    >>> base = CalibrationConfig()
    >>> cfg.bins, cfg.key() == base.key(), cfg.greedy_key() == base.greedy_key()
    (4096, True, False)
    """

    bins: int = 4096  # log-spaced histogram bins per (layer, site)
    log10_min: float = -8.0  # scores below 10**log10_min count as zero
    log10_max: float = 4.0  # ... above 10**log10_max as the largest
    # TEAL's greedy allocation (dejavu_lab.sparsify.greedy):
    # (defaults sized for a shared 2-core CPU: ~3 min per method for the 30-layer demo model)
    greedy_step: float = 0.04  # share of a layer's weight bytes one step removes (TEAL: ~0.004)
    greedy_max_site_step: float = 0.1  # ... but one site's sparsity moves at most this much
    greedy_max: float = 0.8  # the path is computed up to this layer sparsity
    greedy_tokens: int = 128  # tokens of the first calibration window the block forwards use
    greedy_last: float = 0.5  # output error counted on the last share of positions (TEAL: 0.25)

    def __post_init__(self):
        check_configs.calibration_config(self)  # each field whole/finite and in range

    def key(self) -> str:
        """Hash of the histogram fields (the cache file's name)."""
        return _hash({k: v for k, v in asdict(self).items() if not k.startswith("greedy")})

    def greedy_key(self) -> str:
        """Hash of the greedy fields (a greedy path's name inside the file)."""
        return _hash({k: v for k, v in asdict(self).items() if k.startswith("greedy")})


def _hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class Calibration:
    """Score histograms per layer and site over a calibration text, and TEAL's greedy paths.

    ``hist[method]``: float64 [n_layers, n_sites, bins + 2] (first bin: zero and below range;
    last: above range), sites in the order of :data:`KINDS`. ``greedy["method.greedy_key"]``:
    float32 [n_layers, steps, 1 + 4], each row ``(layer sparsity, attn_in, o_in, mlp_in,
    down_in)`` along the greedy path (:mod:`dejavu_lab.sparsify.greedy`) computed with the
    greedy fields of a config; :meth:`greedy_table` gives the one of ``config``.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.calibration import calibrate
    >>> m = random_model("tiny-llama")
    >>> cal = calibrate(m.model, torch.randint(0, 128, (2, 32)), cache=False, progress=False)
    >>> cal.hist["teal"].shape, cal.n_tokens  # 2 layers, 4 sites, 4096 + 2 bins
    (torch.Size([2, 4, 4098]), 64)
    >>> thr = cal.thresholds("teal", 0.5)
    >>> round(cal.sparsity_at("teal", 0, "mlp_in", thr.values[(0, "mlp_in")]), 3)
    0.5
    """

    fingerprint: dict
    text_sha: str  # text_hash of the calibration windows
    n_tokens: int
    config: CalibrationConfig
    hist: dict[str, torch.Tensor]
    greedy: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None  # the cache file, when it came from or went to one

    @property
    def n_layers(self) -> int:
        return self.fingerprint["n_layers"]

    def greedy_table(self, method: str) -> torch.Tensor | None:
        """The greedy path of ``method`` for this config's greedy fields, if computed."""
        return self.greedy.get(f"{method}.{self.config.greedy_key()}")

    def threshold(self, method: str, layer: int, site: str, sparsity: float) -> float:
        """The score threshold removing a share ``sparsity`` of the site's entries."""
        return quantile(self.hist[method][layer, KINDS[method].index(site)], sparsity, self.config)

    def sparsity_at(self, method: str, layer: int, site: str, t: float) -> float:
        """The share of the calibration entries with score at or below ``t``."""
        return mass_below(self.hist[method][layer, KINDS[method].index(site)], t, self.config)

    def site_sparsities(
        self,
        method: str,
        sparsity,
        allocation: str = "uniform",
        sites: Sequence[str] | None = None,
    ) -> dict[tuple[int, str], float]:
        """Each (layer, site)'s share removed for a layer budget ``sparsity`` (one, or one per
        layer; checked here, as every public entry checks it).

        ``"uniform"``: every site of the layer at the layer's budget. ``"greedy"`` (TEAL and
        WINA): the sites' shares on the greedy path where its bytes-weighted layer sparsity
        reaches the budget (interpolated between steps). ``sites``: limit to these sites
        (uniform only); the others run dense.

        >>> from dejavu_lab.models import random_model
        >>> from dejavu_lab.sparsify.calibration import calibrate
        >>> m = random_model("tiny-llama")
        >>> cal = calibrate(m.model, torch.randint(0, 128, (1, 16)), cache=False, progress=False)
        >>> cal.site_sparsities("cats", [0.5, 0.0])
        {(0, 'gate'): 0.5}
        >>> cal.site_sparsities("cats", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: sparsity must be in [0, 1) ...
        """
        checked = budgets(sparsity, self.n_layers, "sparsity")
        return self._site_sparsities(method, checked, allocation, sites)

    def _site_sparsities(
        self,
        method: str,
        sparsity: list[float],
        allocation: str = "uniform",
        sites: Sequence[str] | None = None,
    ) -> dict[tuple[int, str], float]:
        """:meth:`site_sparsities` for budgets already checked (one per layer, in [0, 1))."""
        if method not in KINDS:
            raise CalibrationError(f"method must be one of {', '.join(KINDS)}, got {method!r}.")
        s = list(sparsity)
        names = KINDS[method]
        if sites is not None:
            bad = [x for x in sites if x not in names]
            if bad:
                raise CalibrationError(f"{method} sites are {', '.join(names)}, got {bad}.")
        out: dict[tuple[int, str], float] = {}
        if allocation == "greedy" and greedy_allocates(method):
            if sites is not None:
                raise CalibrationError("the greedy allocation chooses its own sites; drop sites=.")
            path = self.greedy_table(method)
            if path is None:
                raise CalibrationError(
                    f"this calibration has no greedy allocation for {method}; calibrate with "
                    f"greedy=[{method!r}] (it runs TEAL's block-wise greedy search once)."
                )
            for i, si in enumerate(s):
                if si <= 0:
                    continue
                row = _interp_path(path[i], si, method)
                for j, site in enumerate(names):
                    if row[j] > 0:
                        out[(i, site)] = row[j]
            return out
        if allocation not in ("uniform", "greedy"):
            raise CalibrationError(f"allocation must be 'uniform' or 'greedy', got {allocation!r}.")
        for i, si in enumerate(s):
            for site in names if sites is None else sites:
                if si > 0:
                    out[(i, site)] = si
        return out

    def thresholds(
        self,
        method: str,
        sparsity,
        *,
        allocation: str = "uniform",
        dense_layers: Sequence[int] = (),
        sites: Sequence[str] | None = None,
    ) -> Thresholds:
        """:class:`Thresholds` of ``method`` for a layer budget (see :meth:`site_sparsities`).

        ``sparsity``: one number or one per layer, each in [0, 1); ``dense_layers``: layers
        left dense.
        """
        s = budgets(sparsity, self.n_layers, "sparsity")
        for i in dense_layers:
            s[i % self.n_layers] = 0.0
        return self._thresholds(method, s, allocation, sites)

    def _thresholds(self, method, s: list[float], allocation, sites=None) -> Thresholds:
        """:meth:`thresholds` for checked per-layer budgets (dense layers already at 0)."""
        alloc = self._site_sparsities(method, s, allocation, sites)
        values = {k: self.threshold(method, *k, v) for k, v in alloc.items()}
        info = {"calibration": str(self.path) if self.path else None, "text_sha": self.text_sha}
        alloc_name = allocation if greedy_allocates(method) else "uniform"
        return Thresholds(method, values, alloc, self.fingerprint, alloc_name, info)

    def check_model(self, model, arch: Arch | None = None) -> None:
        """Raise :class:`CalibrationError` unless this calibration belongs to ``model``."""
        _check_fingerprint(self.fingerprint, model, arch, "This calibration was made")

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (atomically) with the fingerprint in its metadata."""
        tensors = {f"hist.{k}": v.float() for k, v in self.hist.items()}  # counts, fp32 on disk
        tensors.update({f"greedy.{k}": v for k, v in self.greedy.items()})
        meta = {
            "format": FORMAT,
            "fingerprint": json.dumps(self.fingerprint),
            "config": json.dumps(asdict(self.config)),
            "text_sha": self.text_sha,
            "n_tokens": str(self.n_tokens),
        }
        self.path = _save(tensors, meta, path)
        return self.path


def _interp_path(path: torch.Tensor, s: float, method: str) -> list[float]:
    """Site shares where the greedy path's layer sparsity (column 0) reaches ``s``."""
    eff = path[:, 0]
    top = float(eff.max())
    if s > top + 1e-6:
        raise CalibrationError(
            f"the {method} greedy path reaches layer sparsity {top:.2f} only, not {s:.2f}; "
            "calibrate with a larger CalibrationConfig.greedy_max."
        )
    j = int(torch.searchsorted(eff.contiguous(), torch.tensor([s], dtype=eff.dtype)))
    j = min(max(j, 1), len(eff) - 1)
    e0, e1 = float(eff[j - 1]), float(eff[j])
    w = 0.0 if e1 <= e0 else min(max((s - e0) / (e1 - e0), 0.0), 1.0)
    row = (1 - w) * path[j - 1, 1:] + w * path[j, 1:]
    return [float(v) for v in row]


def load_calibration(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Calibration:
    """Load :meth:`Calibration.save`'s file; with ``model``, check it belongs to it.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.calibration import calibrate
    >>> m = random_model("tiny-opt")
    >>> cal = calibrate(m.model, torch.randint(0, 128, (1, 16)), cache=False, progress=False)
    >>> path = cal.save(f"{tempfile.mkdtemp()}/c.safetensors")
    >>> torch.equal(load_calibration(path, m.model).hist["cats"], cal.hist["cats"])
    True
    >>> load_calibration(path, random_model("tiny-llama").model)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: This calibration was made for another model ...
    """
    tensors, meta = _load(path, FORMAT, "calibration")
    cfg_dict = json.loads(meta["config"])
    known = {f.name for f in fields(CalibrationConfig)}
    cal = Calibration(
        fingerprint=json.loads(meta["fingerprint"]),
        text_sha=meta["text_sha"],
        n_tokens=int(meta["n_tokens"]),
        config=CalibrationConfig(**{k: v for k, v in cfg_dict.items() if k in known}),
        hist={k[5:]: v.double() for k, v in tensors.items() if k.startswith("hist.")},
        greedy={k[7:]: v for k, v in tensors.items() if k.startswith("greedy.")},
        path=Path(path),
    )
    if model is not None:
        cal.check_model(model, arch)
    return cal
