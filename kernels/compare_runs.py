"""Two recordings of one benchmark side by side: the same variants at two commits, one file.

A change that must not change speed (a restructure) is checked by timing the code before and
after it on the same GPU in the same device call, alternating the two; this script joins the
result files those runs wrote (``kernels/bench_engine.py --name ...``) into one recording whose
rows carry their ``run`` label and commit, prints after / before per variant (CUDA-graph replay
time per token; the part breakdown too) and says which differ by more than ``--tolerance``.

    python kernels/compare_runs.py before=a.json before=b.json after=c.json after=d.json \
        --name engine_restructure --tolerance 0.02

Several files under one label are repeats: the table compares the medians of each label.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dejavu_lab import results

KEY = ("model", "prompt", "kind", "engine", "sparsity", "part")


def _time(row: dict) -> float | None:
    return row.get("ms_per_token", row.get("ms"))


def join(runs: list[tuple[str, Path]]) -> tuple[list[dict], dict]:
    """Rows of every file tagged with ``run`` (its label), ``repeat`` and ``run_git_sha``."""
    rows, provenance = [], {}
    for label, path in runs:
        data = json.loads(Path(path).read_text())
        repeat = sum(1 for k in provenance if k.startswith(f"{label}#"))
        provenance[f"{label}#{repeat}"] = data["provenance"]
        for r in data["rows"]:
            rows.append({**r, "run": label, "repeat": repeat,
                         "run_git_sha": data["provenance"]["git_sha"]})  # fmt: skip
    return rows, provenance


def compare(rows: list[dict], before: str, after: str, tolerance: float) -> list[dict]:
    """Per variant: the median time of each label and their ratio (after / before)."""
    times: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        t = _time(r)
        if t is None or r.get("kind") not in ("e2e", "part"):
            continue
        times.setdefault(tuple(r.get(k) for k in KEY), {}).setdefault(r["run"], []).append(t)
    out = []
    for key, by_run in times.items():
        if before not in by_run or after not in by_run:
            continue
        b, a = statistics.median(by_run[before]), statistics.median(by_run[after])
        out.append({**dict(zip(KEY, key, strict=True)), f"{before}_ms": b, f"{after}_ms": a,
                    "ratio": a / b, "within": abs(a / b - 1) <= tolerance,
                    "repeats": min(len(by_run[before]), len(by_run[after]))})  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="label=path of a result file (two labels)")
    ap.add_argument("--name", required=True, help="results/<name>.json to write")
    ap.add_argument("--tolerance", type=float, default=0.02, help="allowed |after/before - 1|")
    args = ap.parse_args()
    runs = []
    for text in args.runs:
        label, sep, path = text.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"{text!r} is not label=path of an existing result file.")
        runs.append((label, Path(path)))
    labels = list(dict.fromkeys(label for label, _ in runs))
    if len(labels) != 2:
        ap.error(f"give exactly two labels (e.g. before=... after=...), got {labels}.")
    rows, provenance = join(runs)
    table = compare(rows, *labels, args.tolerance)
    results.save(args.name, rows + [{**t, "kind": "compare"} for t in table],
                 command="python kernels/compare_runs.py " + " ".join(sys.argv[1:]),
                 extra={"runs": provenance, "tolerance": args.tolerance})  # fmt: skip
    b, a = labels
    print(f"{'model':>12} {'variant':>26} {'part':>10} {b:>9} {a:>9} {'ratio':>7}")
    for t in sorted(table, key=lambda t: (t["model"], t["kind"] != "e2e", str(t["engine"]))):
        flag = "" if t["within"] else f"  outside {args.tolerance:.0%}"
        variant = t["engine"] if not t["sparsity"] else f"{t['engine']}@{t['sparsity']:.0%}"
        print(f"{t['model']:>12} {variant:>26} {t['part'] or 'step':>10} "
              f"{t[f'{b}_ms']:9.3f} {t[f'{a}_ms']:9.3f} {t['ratio']:7.3f}{flag}")  # fmt: skip
    steps = [t for t in table if t["kind"] == "e2e"]
    bad = [t for t in steps if not t["within"]]
    print(f"{len(steps) - len(bad)} of {len(steps)} decode steps within {args.tolerance:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
