"""Calibrated thresholds of TEAL, WINA and CATS, in the form hooks and sparse kernels use.

A :class:`Thresholds` holds one score threshold ``t`` per (layer, site), a float — the output
of :meth:`dejavu_lab.sparsify.calibration.Calibration.thresholds`. The hooks read it as it is
(:meth:`Thresholds.site_thresholds`): entry ``i`` of a site's input is kept iff
``|x[i]| > t`` (TEAL, CATS), or against a per-column tensor ``t / ‖W[:, i]‖₂`` (WINA). The
engine takes the same dict (``SparseConfig(method, thresholds=thr.site_thresholds(model))``):
a float stays a float all the way to the kernels. Thresholds and calibrations save as safetensors with the model
fingerprint in the metadata; loading one for another model is a :class:`CalibrationError`.
Files are written under a temporary name and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .. import atomic
from ..arch import Arch, get_arch
from ..checks.files import older_fingerprint
from ..collect import fingerprint, fingerprint_id
from ..errors import CalibrationError
from ..vocab import METHODS
from .core import column_norms

__all__ = ["CalibrationError", "Thresholds", "load_thresholds"]

THRESHOLDS_FORMAT = "dejavu-lab-thresholds/1"


@dataclass
class Thresholds:
    """Calibrated score thresholds of one method, per (layer, site); missing sites run dense.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> thr = Thresholds("teal", {(0, "mlp_in"): 0.3}, {(0, "mlp_in"): 0.5},
    ...                  fingerprint(m.model))
    >>> thr.site_thresholds(m.model)  # what the hooks and the engine take
    {(0, 'mlp_in'): 0.3}
    """

    method: str  # a threshold method of dejavu_lab.vocab.METHODS
    values: dict[tuple[int, str], float]  # score threshold t: keep entry i iff score_i > t
    sparsity: dict[tuple[int, str], float]  # the share of entries t was calibrated to remove
    fingerprint: dict  # the model they were calibrated on
    allocation: str = "uniform"  # how the sparsity was spread over the sites of a layer
    info: dict = field(default_factory=dict)  # where they came from (calibration file, text)

    def check_model(self, model, arch: Arch | None = None) -> None:
        """Raise :class:`CalibrationError` unless these thresholds belong to ``model``."""
        _check_fingerprint(self.fingerprint, model, arch, "These thresholds were calibrated")

    def __post_init__(self):
        # one threshold per (layer, site) is a plain float, whatever it was computed or loaded as
        self.values = {k: float(v) for k, v in self.values.items()}

    def site_thresholds(self, model, arch: Arch | None = None) -> dict:
        """``{(layer, site): float | fp32 [d_in]}``: keep entry ``i`` iff ``|x[i]| > thr``.

        TEAL and CATS: the float ``t`` itself; WINA: the per-column tensor ``t / ‖W[:, i]‖₂``
        of the site's stacked weights (a zero column is never read). The hooks and the engine's
        ``SparseConfig(method, thresholds=...)`` take this form.

        >>> from dejavu_lab.models import random_model
        >>> m = random_model("tiny-llama")
        >>> Thresholds("teal", {(0, "mlp_in"): 0.3}, {}, {}).site_thresholds(m.model)
        {(0, 'mlp_in'): 0.3}
        >>> Thresholds("wina", {(0, "mlp_in"): 0.3}, {}, {}).site_thresholds(m.model)[
        ...     (0, "mlp_in")].shape  # one per input column
        torch.Size([64])
        """
        if METHODS[self.method].score != "weighted":
            return dict(sorted(self.values.items()))
        arch = arch or get_arch(model)
        out = {}
        for (i, site), t in sorted(self.values.items()):
            c = column_norms(model, arch, i, site).cpu()
            out[(i, site)] = torch.where(c > 0, t / c, torch.full_like(c, float("inf")))
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file (atomically) with the fingerprint in its metadata."""
        keys = sorted(self.values)
        tensors = {
            f"{i}.{site}": torch.tensor([self.values[(i, site)], self.sparsity[(i, site)]])
            for i, site in keys
        }
        meta = {
            "format": THRESHOLDS_FORMAT,
            "method": self.method,
            "allocation": self.allocation,
            "fingerprint": json.dumps(self.fingerprint),
            "info": json.dumps(self.info),
        }
        if not tensors:
            tensors = {"empty": torch.zeros(1)}
        return _save(tensors, meta, path)


def load_thresholds(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Thresholds:
    """Load :meth:`Thresholds.save`'s file; with ``model``, check they belong to it.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> thr = Thresholds("cats", {(1, "gate"): 0.1}, {(1, "gate"): 0.4}, fingerprint(m.model))
    >>> path = thr.save(f"{tempfile.mkdtemp()}/t.safetensors")
    >>> load_thresholds(path, m.model).values
    {(1, 'gate'): 0.10000000149011612}
    >>> load_thresholds(path, random_model("tiny-llama", seed=1).model)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: These thresholds were calibrated for another ...
    """
    tensors, meta = _load(path, THRESHOLDS_FORMAT, "thresholds")
    values, sparsity = {}, {}
    for key, t in tensors.items():
        if key == "empty":
            continue
        i, site = key.split(".", 1)
        values[(int(i), site)] = float(t[0])
        sparsity[(int(i), site)] = float(t[1])
    thr = Thresholds(
        meta["method"],
        values,
        sparsity,
        json.loads(meta["fingerprint"]),
        meta.get("allocation", "uniform"),
        json.loads(meta.get("info", "{}")),
    )
    if model is not None:
        thr.check_model(model, arch)
    return thr


# ---------------------------------------------------------------------------------------------
# files


def _check_fingerprint(fp: dict, model, arch, what: str) -> None:
    if older_fingerprint(fp):
        raise CalibrationError(
            f"{what} under the older model fingerprint, which saw 8 rows of 3 weight matrices "
            "only and cannot tell this model from another of its shape; run "
            "dejavu_lab.sparsify.calibration.calibrate on this model again."
        )
    have = fingerprint(model, arch)
    if have != fp:
        diff = [k for k in have if have[k] != fp.get(k)]
        raise CalibrationError(
            f"{what} for another model ({fingerprint_id(fp)}, this one is "
            f"{fingerprint_id(have)}; differs in {', '.join(diff)}); run "
            "dejavu_lab.sparsify.calibration.calibrate on this model."
        )


def _save(tensors: dict, meta: dict, path) -> Path:
    """Write atomically (:mod:`dejavu_lab.atomic`): a kill leaves the old file or the new one."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    hint = "pass another path, or set DEJAVU_LAB_CACHE to a writable folder with free space"
    return atomic.save_tensors(Path(path), tensors, meta, hint=hint)


def _load(path, fmt: str, what: str):
    path = Path(path)
    if not path.exists():
        raise CalibrationError(f"No {what} file at {path}.")
    if path.is_dir():
        names = sorted(p.name for p in path.glob("*.safetensors"))[:2]
        inside = f" (it holds {', '.join(names)}{', …' if len(names) > 1 else ''})" if names else ""
        raise CalibrationError(
            f"{path} is a folder, not a {what} file{inside}; pass the path of one "
            ".safetensors file written by save()."
        )
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CalibrationError(
            f"{path} is not a readable safetensors file ({str(e).splitlines()[0][:80]}); it is "
            f"truncated or damaged: delete it and calibrate again."
        ) from None
    if meta.get("format") != fmt:
        raise CalibrationError(f"{path} is a safetensors file but not a dejavu-lab {what}.")
    return tensors, meta
