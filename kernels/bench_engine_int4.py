"""End to end on an H200: fp16 dense, fp16 TEAL, int4 dense, int4 TEAL / WINA / DejaVu / CATS, one engine.

Random weights at Llama-3-8B and Llama-2-13B shapes (quantised to int4 at build time), batch 1,
one prompt, CUDA-graph replay (:func:`dejavu_lab.bench.engine_int4.bench_int4`): ms per token,
bytes per token against the copy ceiling, and the speedups the issue's targets name (int4
dense over fp16 dense; int4 + TEAL over int4 dense). Written to
``results/engine_int4.json`` with provenance.

    PYTHONPATH=. python kernels/bench_engine_int4.py [--models llama-3-8b,llama-2-13b]
        [--group 128] [--sparsity 0.4,0.5] [--methods teal,wina,dejavu,cats] [--prompt 512]
        [--int4-only llama-3-70b]   # built in int4 without fp16 (its fp16 does not fit)
    TRITON_INTERPRET=1 python kernels/bench_engine_int4.py --quick   # CPU plumbing, tiny model
"""

from __future__ import annotations

import argparse
import math
import sys

from dejavu_lab import results
from dejavu_lab.bench.engine_int4 import bench_int4
from dejavu_lab.bench.timing import copy_ceiling, cuda, print_rows

COLUMNS = [("model", "model", "12s"), ("weights", "weights", "7s"), ("engine", "engine", "6s"),
           ("sparsity", "sparsity", "8.2f"), ("ms/token", "ms_per_token", "9.3f"),
           ("TB/s", "tbps", "6.2f"), ("ceiling", "of_ceiling", "7.2f"),
           ("vs fp16", "vs_fp16_dense", "8.2f"), ("vs int4", "vs_int4_dense", "8.2f")]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3-8b,llama-2-13b", help="comma-separated presets")
    ap.add_argument(
        "--int4-only",
        default="",
        help="presets timed in int4 alone, built without fp16 (e.g. llama-3-70b)",
    )
    ap.add_argument("--group", type=int, default=128, help="int4 group size (32, 64, 128)")
    ap.add_argument("--sparsity", default="0.4,0.5", help="TEAL/WINA sparsities, comma-separated")
    ap.add_argument(
        "--methods",
        default="teal,wina,dejavu,cats",
        help="int4 sparse methods (DejaVu: that share of neurons and heads dropped)",
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--head",
        action="store_true",
        help="also int4 dense and TEAL with lm_head in int4 (weights 'int4+head')",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also int4 dense and TEAL on the plain step (each product finished by its own launch)",
    )
    ap.add_argument(
        "--kv-window",
        type=int,
        default=None,
        help="DejaVu's deferred K/V window in tokens (0: every head's K/V each step; default 16)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (plumbing)")
    ap.add_argument("--name", default="", help="results file (default engine_int4[_quick])")
    args = ap.parse_args(argv)
    command = "python kernels/bench_engine_int4.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    models = [m for m in args.models.split(",") if m]
    int4_only = [m for m in args.int4_only.split(",") if m]
    sparsities = [float(s) for s in args.sparsity.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    prompt, new, check, group = args.prompt, args.new_tokens, (32, 8), args.group
    if args.quick:
        prompt, new, check, group = 8, 4, (4, 2), 64
        models = ["tiny-llama"] if models else []
        int4_only = ["tiny-llama"] if int4_only else []
    elif not cuda():
        raise SystemExit("bench_engine_int4 needs a CUDA GPU (--quick checks the plumbing).")
    device = "cuda" if cuda() else "cpu"
    ceiling = copy_ceiling() if cuda() else math.nan
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    rows: list[dict] = []
    for preset in models + int4_only:
        bench_int4(preset, prompt=prompt, new_tokens=new, group=group, sparsities=sparsities,
                   methods=methods, device=device, ceiling=ceiling, rows=rows,
                   check_tokens=check, int4_only=preset in int4_only and preset not in models,
                   head=args.head, plain=args.plain, kv_window=args.kv_window)  # fmt: skip
    print()
    print_rows([r for r in rows if r["kind"] == "e2e" and "error" not in r], COLUMNS)
    name = args.name or ("engine_int4_quick" if args.quick else "engine_int4")
    path = results.save(name, rows, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
