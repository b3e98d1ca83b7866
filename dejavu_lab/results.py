"""Recorded measurements with provenance: ``results/{name}.json``.

GPU numbers are expensive and this book is built on machines without a GPU, so benchmarks
record what they measured, and notebooks draw those records (and say which GPU, on which date)
when they cannot measure live. One file holds one run::

    {"provenance": {"gpu": ..., "torch": ..., "triton": ..., "cuda": ..., "git_sha": ...,
                    "date": ..., "command": ..., "host": ..., "python": ..., ...extra},
     "rows": [{...}, {...}]}          # one flat dict per measurement (a tidy table)

Every row maps to the commit it measured: the file's ``git_sha``, or for a run added with
:func:`add_repeat` its own in ``provenance["repeats"]``; :func:`dejavu_lab.staleness.note` says
how many commits have touched the timed code since, for a figure's caption.

``save`` writes atomically (temporary file, fsync, rename: :mod:`dejavu_lab.atomic`), so a
crashed benchmark never leaves half a file behind; ``load`` returns ``(pandas.DataFrame, provenance)`` and raises
:class:`ResultsError` with one sentence on a missing file, bad JSON or missing provenance.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from .atomic import write_text
from .errors import ResultsError

__all__ = [
    "REQUIRED_PROVENANCE",
    "ResultsError",
    "add_repeat",
    "describe",
    "git_sha",
    "list_results",
    "load",
    "load_many",
    "provenance",
    "results_dir",
    "save",
]

ENV_DIR = "DEJAVU_LAB_RESULTS"  # overrides where results live (default: <repo>/results)
ENV_SHA = "DEJAVU_LAB_GIT_SHA"  # git sha to record for a copied tree (its .git may be stale)
REQUIRED_PROVENANCE = ("gpu", "torch", "triton", "cuda", "git_sha", "date", "command", "host")


def results_dir() -> Path:
    """The folder holding ``*.json`` results: ``$DEJAVU_LAB_RESULTS`` or the repo's ``results/``.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {ENV_DIR: "/data/gpu-runs"}):
    ...     str(results_dir())
    '/data/gpu-runs'
    """
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent.parent / "results"


def git_sha() -> str:
    """The commit this tree is at: ``$DEJAVU_LAB_GIT_SHA`` (a copy of the tree, as on a GPU
    box), else git's HEAD with ``-dirty`` when tracked files changed, else ``"unknown"``.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {ENV_SHA: "abc1234"}):
    ...     git_sha()
    'abc1234'
    """
    if os.environ.get(ENV_SHA):  # a copy of the tree (a GPU box) says which commit it is
        return os.environ[ENV_SHA]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if sha.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            )
            return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


#: environment variables of the project that name the run rather than change it
IGNORED_ENV = ("DEJAVU_LAB_CACHE", "DEJAVU_LAB_GIT_SHA", "DEJAVU_LAB_LOCK_TIMEOUT",
               "DEJAVU_LAB_RESULTS", "DEJAVU_TEST_DEVICE")  # fmt: skip


def provenance(command: str) -> dict[str, Any]:
    """Where and with what a measurement was made (GPU, library versions, git sha, date, and
    the ``DEJAVU_*`` switches set in the environment, as ``env``).

    >>> info = provenance("python kernels/bench_sparse_mlp.py")
    >>> set(REQUIRED_PROVENANCE) <= set(info), info["command"]
    (True, 'python kernels/bench_sparse_mlp.py')
    """
    info: dict[str, Any] = {
        "gpu": "none (CPU)",
        "torch": None,
        "triton": None,
        "cuda": None,
        "git_sha": git_sha(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "host": platform.node(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),  # CPU runs (perplexity frontiers) depend on it as GPU runs on "gpu"
        "cpu_count": os.cpu_count(),
    }
    # the project's switches (DEJAVU_PDL, DEJAVU_PDL_EARLY, ...) change what is measured
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith("DEJAVU_") and k not in IGNORED_ENV
    }
    if env:
        info["env"] = env
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_sms"] = props.multi_processor_count
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["driver"] = _driver_version()
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _clean(value: Any) -> Any:
    """JSON-safe copy: numpy/torch scalars to Python, NaN/inf to None, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # numpy / torch scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _path(name_or_path: str | os.PathLike) -> Path:
    text = os.fspath(name_or_path)
    if text.endswith(".json") or os.sep in text or "/" in text:
        return Path(text).expanduser()
    return results_dir() / f"{text}.json"


def _check(name: str, rows) -> None:
    if not name or "/" in name or os.sep in name or name.endswith(".json"):
        raise ValueError(f"results name {name!r} must be a bare name such as 'sparse_mlp'.")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError("rows must be a list of dicts (one flat dict per measurement).")


def _with_extra(prov: dict, extra: dict | None) -> dict:
    for key, value in (extra or {}).items():
        if key in REQUIRED_PROVENANCE:
            raise ValueError(f"extra key {key!r} would overwrite recorded provenance; rename it.")
        prov[key] = value
    return prov


def _write(path: Path, prov: dict, rows: list[dict]) -> Path:
    payload = json.dumps(
        {"provenance": _clean(prov), "rows": _clean(rows)}, indent=1, allow_nan=False
    )
    hint = f"set {ENV_DIR} to a writable folder with free space"
    return write_text(path, payload + "\n", hint=hint)


def save(name: str, rows: list[dict], *, command: str, extra: dict | None = None,
         folder: str | os.PathLike | None = None) -> Path:  # fmt: skip
    """Write ``rows`` with provenance to ``results_dir()/{name}.json`` atomically; return the path.

    ``extra`` adds keys to the provenance (e.g. the measured copy ceiling); it may not replace
    the required keys. ``folder`` writes there instead of ``results_dir()`` (the tuned launch
    tables, which the kernels read as package data: ``dejavu_lab.kernels.tuning.TUNED_DIR``).

    >>> import tempfile
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {ENV_DIR: tempfile.mkdtemp()}):
    ...     path = save("my_bench", [{"batch": 1, "ms": 0.42}], command="python my_bench.py")
    >>> path.name, load(path)[1]["command"]
    ('my_bench.json', 'python my_bench.py')
    """
    _check(name, rows)
    where = Path(folder).expanduser() if folder is not None else results_dir()
    return _write(where / f"{name}.json", _with_extra(provenance(command), extra), rows)


def add_repeat(name: str, rows: list[dict], *, command: str, extra: dict | None = None,
               recorded: dict | None = None) -> Path:  # fmt: skip
    """Add one more run of a benchmark to ``results_dir()/{name}.json``, as rows of the same
    file: its rows are tagged ``repeat`` = 1, 2, ... (the file's first run is repeat 0) and its
    provenance goes to the file's ``provenance["repeats"]`` (index = repeat); the file's own
    provenance stays the first run's. With no file yet, the run becomes repeat 0.

    ``recorded`` is the run's own provenance when its rows come from another recording (a
    results file written on a GPU box); by default it is taken now, as :func:`save` does.

    >>> import tempfile
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {ENV_DIR: tempfile.mkdtemp()}):
    ...     for ms in (0.42, 0.43):
    ...         path = add_repeat("my_bench", [{"ms": ms}], command="python my_bench.py")
    ...     frame, prov = load(path)
    >>> frame.to_dict("records"), len(prov["repeats"])
    ([{'ms': 0.42, 'repeat': 0}, {'ms': 0.43, 'repeat': 1}], 2)
    """
    _check(name, rows)
    run = _with_extra(dict(recorded) if recorded is not None else provenance(command), extra)
    run.pop("repeats", None)
    path = results_dir() / f"{name}.json"
    if not path.is_file():
        return _write(path, {**run, "repeats": [run]}, [{**r, "repeat": 0} for r in rows])
    _, first = load(path)  # a damaged file is a ResultsError, as for any reader
    first = {k: v for k, v in first.items() if k != "repeats"}
    data = json.loads(path.read_text())
    old = [{**r, "repeat": r.get("repeat", 0)} for r in data["rows"]]
    runs = list(data["provenance"].get("repeats") or [first])
    # the next repeat: after every recorded row and every recorded run (a run may have no rows)
    k = max(1 + max((r["repeat"] for r in old), default=-1), len(runs))
    runs += [first] * (k - len(runs))  # repeats recorded without their own provenance
    prov = {**first, "repeats": [*runs[:k], run]}
    return _write(path, prov, old + [{**r, "repeat": k} for r in rows])


def load(name_or_path: str | os.PathLike):
    """Read a results file: ``(pandas.DataFrame of rows, provenance dict)``; never modifies it.

    >>> frame, prov = load("sparse_mlp")  # recorded on a GPU, kept in the repo's results/
    >>> sorted(frame["provider"].unique()), prov["gpu"]
    (['dense', 'torch', 'triton'], 'NVIDIA H200')
    """
    import pandas as pd

    path = _path(name_or_path)
    if not path.is_file():
        raise ResultsError(
            f"no results file at {path}; run the benchmark that records it "
            f"(see kernels/) or set {ENV_DIR} to the folder that holds it."
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path} is not valid JSON ({exc}); re-run its benchmark.") from exc
    if not isinstance(data, dict) or not isinstance(data.get("provenance"), dict):
        raise ResultsError(f"{path} has no 'provenance' object; re-run its benchmark.")
    missing = [k for k in REQUIRED_PROVENANCE if k not in data["provenance"]]
    if missing:
        raise ResultsError(f"{path} provenance lacks {missing}; re-run its benchmark.")
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ResultsError(f"{path} has no 'rows' list of objects; re-run its benchmark.")
    return pd.DataFrame(rows), data["provenance"]


def load_many(names, keep=None):
    """The recordings of ``names`` that exist, stacked: ``(frame, {name: provenance}, missing
    names)``. ``keep(df)`` picks each file's rows (a boolean Series); rows with an ``error`` are
    dropped; each row gets its ``file``. An empty frame when none exists.

    >>> frame, provs, missing = load_many(["sparse_mlp", "no_such_run"])
    >>> sorted(set(frame["file"])), missing
    (['sparse_mlp'], ['no_such_run'])
    """
    import pandas as pd

    frames, provs, missing = [], {}, []
    for name in names:
        try:
            df, prov = load(name)
        except ResultsError:
            missing.append(name)
            continue
        if keep is not None:
            df = df[keep(df)]
        if "error" in df:
            df = df[df["error"].isna()]
        frames.append(df.assign(file=name))
        provs[name] = prov
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return frame, provs, missing


def list_results() -> list[str]:
    """Names of the recorded results (``load`` takes any of them).

    >>> names = list_results()
    >>> names == sorted(names), {"demo_perplexity", "engine_e2e", "sparse_mlp"} <= set(names)
    (True, True)
    """
    folder = results_dir()
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def describe(prov: dict) -> str:
    """One line for a figure caption: 'NVIDIA H200, 2026-11-30 (torch 2.11.0, triton 3.6.0)'.

    >>> describe(load("sparse_mlp")[1])  # the date and versions change with each re-run
    'NVIDIA H200, 20...-...-... (torch ..., triton ...)'
    """
    date = str(prov.get("date", "unknown date"))[:10]
    return f"{prov.get('gpu', 'unknown GPU')}, {date} (torch {prov.get('torch')}, triton {prov.get('triton')})"


if __name__ == "__main__":  # pragma: no cover - tiny CLI: list or show a result
    if len(sys.argv) > 1:
        frame, prov = load(sys.argv[1])
        print(describe(prov))
        print(frame.to_string())
    else:
        print("\n".join(list_results()))
