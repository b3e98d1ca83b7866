"""Tuned launch configurations, recorded on a GPU and read at run time (issue 12).

``kernels/bench_threshold_gemv.py --tune`` and ``kernels/bench_fused_mlp.py --tune`` time a few
candidate tilings per (op, shape, kept fraction, batch) — d in {2048, 4096, 5120, 8192, 12288}
— and record every timing in ``results/kernel_tuning*.json`` with the usual provenance
(:mod:`dejavu_lab.results`). At run time :func:`lookup` returns the fastest recorded config
for the nearest tuned point *on the same GPU model*; anything else (another GPU, an untuned
shape, the CPU interpreter) gets ``None`` and the kernel's own heuristic. Any valid config
computes the same function: tuning only decides the speed.

``DEJAVU_LAB_TUNING=off`` disables the tables; ``DEJAVU_LAB_TUNING=/path/a.json:/path/b.json``
reads those files instead of ``results/kernel_tuning*.json``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

__all__ = ["best_table", "lookup", "tuning_files"]

ENV = "DEJAVU_LAB_TUNING"
MAX_SHAPE_DISTANCE = 0.35  # |log d_in ratio| + |log d_out ratio| to borrow a nearby shape's config


def tuning_files() -> list[Path]:
    """The tuning tables read at run time (``results/kernel_tuning*.json`` unless overridden).

    >>> all(p.name.startswith("kernel_tuning") for p in tuning_files())
    True
    """
    env = os.environ.get(ENV, "")
    if env.lower() in ("off", "0", "none"):
        return []
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    from ..results import results_dir

    return sorted(results_dir().glob("kernel_tuning*.json"))


@functools.cache
def _tables(key: str) -> dict:
    """{gpu: {(op, d_in, d_out, batch, kept): (us, config)}} over every readable table."""
    best: dict = {}
    for path in tuning_files():
        try:
            data = json.loads(path.read_text())
            gpu = data["provenance"]["gpu"]
            rows = data["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unreadable table only costs speed: fall back to the heuristics
        table = best.setdefault(gpu, {})
        for r in rows:
            try:
                k = (r["op"], int(r["d_in"]), int(r["d_out"]), int(r["batch"]), float(r["kept"]))
                us, cfg = float(r["us"]), dict(r["config"])
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(us) and (k not in table or us < table[k][0]):
                table[k] = (us, cfg)
    return best


def best_table(gpu: str | None = None) -> dict:
    """The fastest recorded config per (op, d_in, d_out, batch, kept) for ``gpu``.

    >>> table = best_table("NVIDIA H200")
    >>> all(len(k) == 5 for k in table)
    True
    """
    tables = _tables(os.environ.get(ENV, "") + "|" + ",".join(map(str, tuning_files())))
    if gpu is None:
        return {k: v for t in tables.values() for k, v in t.items()}
    return tables.get(gpu, {})


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(op: str, d_in: int, d_out: int, kept: float, batch: int,
           device: torch.device) -> dict | None:  # fmt: skip
    """The tuned config of ``op`` nearest to this point on this GPU model, or ``None``.

    Same shape first (else the nearest tuned shape within ``MAX_SHAPE_DISTANCE`` in log
    space), then the nearest tuned batch (batch 1 and union batches run different code paths
    and never borrow from each other), then the nearest kept fraction.

    >>> lookup("threshold_gemv", 11008, 4096, 0.1, 1, torch.device("cpu")) is None  # no GPU
    True
    """
    if device.type != "cuda":
        return None
    table = best_table(_gpu_name(device.index or 0))
    if not table:
        return None
    mine = [k for k in table if k[0] == op and (k[3] == 1) == (batch == 1)]
    if not mine:
        return None

    def shape_dist(k):
        return abs(math.log(k[1] / d_in)) + abs(math.log(k[2] / d_out))

    dist = min(shape_dist(k) for k in mine)
    if dist > MAX_SHAPE_DISTANCE:
        return None
    mine = [k for k in mine if shape_dist(k) == dist]
    bdist = min(abs(math.log(k[3] / batch)) for k in mine)
    mine = [k for k in mine if abs(math.log(k[3] / batch)) == bdist]
    k = min(mine, key=lambda k: abs(k[4] - kept))
    return dict(table[k][1])
