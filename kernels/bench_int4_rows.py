"""DejaVu's and CATS's MLP on 4-bit weights, one token: the kept-row int4 kernels on a GPU.

At the Llama MLP shapes (Llama-3-8B: 4096 inputs, 14336 neurons; Llama-2-13B: 5120, 13824),
group 128, fp16, in CUDA-graph replay over weights rotated through more than 4x the L2
(:class:`dejavu_lab.bench.int4_rows.Int4RowsCase`): the dense int4 up projection as the engine
runs it (columns, the reference), the rows layout's up projection over every neuron, DejaVu's
over the kept neurons, CATS's gate-then-kept-up, and the down projection over the kept rows
(the scatter and the half2 kept-row list) beside its floor (the threshold GEMV over activations
already scattered). The previous one-token paths (the fp32 tile, the index walk) are timed too.
The half2 up kernel's tiles are swept first on the first shape (every candidate checked).

Each row: µs per call, the weight bytes read, the fraction of the copy ceiling they reach, and
the ratio to the dense columns up projection. Written to ``results/int4_rows_b1.json`` with
provenance.

    PYTHONPATH=. python kernels/bench_int4_rows.py [--kept 0.5,0.25] [--no-sweep]
    TRITON_INTERPRET=1 python kernels/bench_int4_rows.py --smoke   # tiny shapes, CPU: plumbing
"""

from __future__ import annotations

import argparse
import math
import sys

from dejavu_lab import results
from dejavu_lab.bench.int4_rows import Int4RowsCase
from dejavu_lab.bench.timing import copy_ceiling, graph_us, print_rows, sweep
from dejavu_lab.kernels.int4.up_half2 import UP_HALF2

SHAPES = [("llama3-8b", 4096, 14336), ("llama2-13b", 5120, 13824)]
COLUMNS = [("shape", "shape", "11s"), ("provider", "provider", "15s"), ("path", "path", "7s"),
           ("kept", "kept", "5.2f"), ("us", "us", "8.1f"), ("MB", "mb", "7.1f"),
           ("TB/s", "tbps", "6.2f"), ("ceil", "frac_copy", "5.2f"),
           ("vs dense", "vs_dense", "8.2f")]  # fmt: skip


def candidates() -> list[dict]:
    """Tilings of the half2 up kernel: rows per program, inputs per step, warps, stages, and
    programs along the inputs (``SPLIT``: partial sums and a finishing launch)."""
    out, base = [], {k: v for k, v in UP_HALF2.items() if k != "SPLIT"}
    for bn, bk, warps in (
        (16, 128, 1),
        (16, 256, 1),
        (16, 512, 2),
        (32, 128, 2),
        (32, 256, 2),
        (32, 512, 4),
        (8, 512, 1),
        (8, 1024, 2),
        (64, 128, 4),
        (64, 256, 4),
    ):
        for stages in (2, 3):
            out.append({**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                        "num_stages": stages})  # fmt: skip
    for bn, bk, warps, split in (
        (16, 128, 1, 2),
        (16, 128, 1, 4),
        (32, 128, 1, 4),
        (32, 256, 2, 4),
        (64, 128, 2, 8),
        (16, 512, 2, 2),
    ):
        out.append({**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                    "num_stages": 3, "SPLIT": split})  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", default="0.5,0.25", help="kept fractions, comma-separated")
    ap.add_argument("--no-sweep", action="store_true", help="the default tiles only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing)")
    ap.add_argument("--name", default=None, help="results file (default int4_rows_b1[_smoke])")
    args = ap.parse_args(argv)
    kepts = [float(k) for k in args.kept.split(",") if k]
    shapes = [("smoke", 256, 256)] if args.smoke else SHAPES
    n_calls = 4 if args.smoke else 120
    ceiling = copy_ceiling(2**24 if args.smoke else 2**31)
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    rows, pick = [], dict(UP_HALF2)
    for i, (name, d, n) in enumerate(shapes):
        case = Int4RowsCase(d, n, group=128, max_copies=2 if args.smoke else 64)
        if i == 0 and not args.no_sweep:
            timed = sweep(candidates()[: 2 if args.smoke else None],
                          lambda c, case=case: case.check("up_dejavu", 0.5, c),
                          lambda c, case=case: graph_us(case.calls("up_dejavu", 0.5, c),
                                                        n_calls=n_calls),
                          tol=1e-2)  # fmt: skip
            for cfg, us in timed:
                rows.append({"kind": "sweep", "shape": name, "config": cfg, "us": us})
            if timed:
                pick = min(timed, key=lambda t: t[1])[0]
            print(f"half2 up tiles: {pick}")
        dense_us = None
        plan = [("up_columns", 1.0, None, "half2"), ("up_rows", 1.0, pick, "half2")]
        for k in kepts:
            plan += [("up_dejavu", k, pick, "half2"), ("up_dejavu", k, {"mode": "tile"}, "tile"),
                     ("up_cats", k, None, "half2"), ("up_cats", k, {"mode": "tile"}, "tile"),
                     ("down_rows", k, None, "scatter"), ("down_rows", k, {"mode": "rows"}, "walk"),
                     ("down_threshold", k, None, "half2")]  # fmt: skip
        for provider, k, cfg, path in plan:
            try:
                err = case.check(provider, k, cfg)
                us = graph_us(case.calls(provider, k, cfg), n_calls=n_calls)
            except Exception as exc:  # one failing path must not lose the run
                print(f"  {name} {provider} {path}: {type(exc).__name__}: {str(exc)[:300]}")
                err, us = math.nan, math.nan
            if provider == "up_columns":
                dense_us = us
            nbytes = case.int4_bytes(provider, k)
            rows.append({"kind": "time", "shape": name, "d": d, "n": n, "group": 128,
                         "provider": provider, "path": path, "kept": k, "config": cfg,
                         "us": us, "relerr": err, "mb": nbytes / 1e6,
                         "tbps": nbytes / us / 1e6, "frac_copy": nbytes / us / 1e6 / ceiling,
                         "vs_dense": (dense_us / us) if dense_us else math.nan})  # fmt: skip
    print_rows([r for r in rows if r["kind"] == "time"], COLUMNS)
    name = args.name or ("int4_rows_b1_smoke" if args.smoke else "int4_rows_b1")
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python kernels/bench_int4_rows.py", *given])
    path = results.save(name, rows, command=command,
                        extra={"copy_tbps": ceiling, "half2_up_pick": pick})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
