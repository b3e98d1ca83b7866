"""Tuned launch configurations, recorded on a GPU and read at run time.

``kernels/bench_threshold_gemv.py --tune`` and ``kernels/bench_fused_mlp.py --tune`` time a few
candidate tilings per (op, shape, kept fraction, batch) — d in {2048, 4096, 5120, 8192, 12288}
— and record every timing in ``dejavu_lab/kernels/tuned/tuning_*.json`` with the usual
provenance (:mod:`dejavu_lab.results`). The tables are package data, inputs to the kernels
rather than measurements, so an installed package reads the same ones as the repository. At run time :func:`lookup` returns the fastest recorded config
for the nearest tuned point *on the same GPU model*; anything else (another GPU, an untuned
shape, the CPU interpreter) gets ``None`` and the kernel's own heuristic. Any valid config
computes the same function: tuning only decides the speed.

Configs that reduce with atomics are skipped (see ``_safe``). ``DEJAVU_LAB_TUNING=off``
disables the tables; ``DEJAVU_LAB_TUNING=/path/a.json:/path/b.json``
reads those files instead of ``tuned/tuning_*.json``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

__all__ = ["TUNED_DIR", "best_table", "lookup", "reload", "tuning_files"]

ENV = "DEJAVU_LAB_TUNING"
ENV_ATOMIC = "DEJAVU_LAB_TUNING_ATOMIC"  # "1": also use recorded configs that reduce by atomics
MAX_SHAPE_DISTANCE = 0.75  # |log d_in ratio| + |log d_out ratio| to borrow a nearby shape's config
TUNED_DIR = Path(__file__).resolve().parent / "tuned"  # the tables, shipped as package data


def tuning_files() -> list[Path]:
    """The tuning tables read at run time (``TUNED_DIR/tuning_*.json`` unless overridden).

    >>> all(p.name.startswith("tuning_") for p in tuning_files())
    True
    """
    env = os.environ.get(ENV, "")
    if env.lower() in ("off", "0", "none"):
        return []
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return sorted(TUNED_DIR.glob("tuning_*.json"))


def _safe(cfg: dict) -> bool:
    """Atomic-reduction configs are never chosen at run time: on the H200 with Triton 3.6 they
    failed the benchmarks' correctness checks at some shapes and layouts (the tensor-core
    tiles of every kernel, all the fused MLP's one-launch tiles), while the serial and
    two-launch reductions passed everywhere (the tables keep only
    configs that passed their check at that point; ``DEJAVU_LAB_TUNING_ATOMIC=1`` allows them).
    """
    return cfg.get("reduce") != "atomic" and cfg.get("mode") != "atomic"


def reload() -> None:
    """Forget the tables read so far (a benchmark that just wrote a new one calls this).

    >>> reload()
    """
    _tables.cache_clear()
    _lookup.cache_clear()


@functools.cache
def _tables(key: str) -> dict:
    """{gpu: {(op, d_in, d_out, batch, kept): [(us, config), ...]}} over every readable table."""
    found: dict = {}
    for path in tuning_files():
        try:
            data = json.loads(path.read_text())
            gpu = data["provenance"]["gpu"]
            rows = data["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an unreadable table only costs speed: fall back to the heuristics
        table = found.setdefault(gpu, {})
        for r in rows:
            try:
                k = (r["op"], int(r["d_in"]), int(r["d_out"]), int(r["batch"]), float(r["kept"]))
                us, cfg = float(r["us"]), dict(r["config"])
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(us) and (_safe(cfg) or os.environ.get(ENV_ATOMIC) == "1"):
                table.setdefault(k, []).append((us, cfg))
    return found


def best_table(gpu: str | None = None) -> dict:
    """The fastest recorded ``(µs, config)`` per (op, d_in, d_out, batch, kept) for ``gpu``.

    >>> table = best_table("NVIDIA H200")
    >>> all(len(k) == 5 and us > 0 for k, (us, cfg) in table.items())
    True
    """
    tables = _tables(os.environ.get(ENV, ""))
    chosen = tables.values() if gpu is None else [tables.get(gpu, {})]
    return {k: min(v, key=lambda t: t[0]) for t in chosen for k, v in t.items()}


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(op: str, d_in: int, d_out: int, kept: float | None, batch: int,
           device: torch.device, mode: str | None = None) -> dict | None:  # fmt: skip
    """The tuned config of ``op`` nearest to this point on this GPU model, or ``None``.
    ``mode``: only configs of that ``"mode"`` (``"split"`` also takes configs without one).

    Same shape first (else the nearest tuned shape within ``MAX_SHAPE_DISTANCE`` in log
    space), then the nearest tuned batch (batch 1 and union batches run different code paths
    and never borrow from each other), then the nearest kept fraction. ``kept=None`` (a
    threshold's kept fraction is only known on the GPU) picks the config with the least mean
    slowdown against the best over every tuned kept fraction.

    >>> lookup("threshold_gemv", 11008, 4096, 0.1, 1, torch.device("cpu")) is None  # no GPU
    True
    """
    if device.type != "cuda":
        return None
    kept = None if kept is None else round(float(kept), 3)
    found = _lookup(op, int(d_in), int(d_out), kept, int(batch), _gpu_name(device.index or 0),
                    mode)  # fmt: skip
    return None if found is None else dict(found)


def _of_mode(table: dict, mode: str | None) -> dict:
    """The table's configs of ``mode`` (``None``: all; ``"split"``: also those without a mode)."""
    if mode is None:
        return table
    picked = {
        k: [(us, c) for us, c in v if c.get("mode", "split") == mode] for k, v in table.items()
    }
    return {k: v for k, v in picked.items() if v}


@functools.lru_cache(maxsize=4096)
def _lookup(op, d_in, d_out, kept, batch, gpu, mode=None):
    table = _of_mode(_tables(os.environ.get(ENV, "")).get(gpu, {}), mode)
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
    if kept is not None:
        k = min(mine, key=lambda k: abs(k[4] - kept))
        return min(table[k], key=lambda t: t[0])[1]
    slowdown: dict[str, list] = {}  # config -> [config, sum of us / best us, points]
    for k in mine:
        best = min(us for us, _ in table[k])
        for us, cfg in table[k]:
            entry = slowdown.setdefault(json.dumps(cfg, sort_keys=True), [cfg, 0.0, 0])
            entry[1] += us / best
            entry[2] += 1
    most = max(e[2] for e in slowdown.values())
    return min((e for e in slowdown.values() if e[2] == most), key=lambda e: e[1])[0]
