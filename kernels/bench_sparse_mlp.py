"""Sparse MLP kernels vs dense cuBLAS, contiguous cuBLAS and a torch gather (Deja Vu §4.4, App. E).

For the OPT shapes d in {4096, 8192, 12288} (hidden 4d) and the Llama shapes (d, hidden) =
(4096, 11008), (5120, 13824), (4096, 14336), kept fraction in {50, 20, 10, 5}% and batch 1
plus union batches 4 and 16, times the up-projection (fc1 + bias + ReLU, selected rows only;
at Llama shapes the gate/up direction d -> hidden) and the down-projection (fc2 over W2 stored
transposed, hidden -> d) four ways — dense cuBLAS, cuBLAS on the same number of rows made
contiguous (``contig``: the gather-free reference our gather must match), torch
``index_select`` + matmul, our Triton kernel — with ``do_bench`` (events, L2 flushed) and
``do_bench_cudagraph`` (graph replay; ``--fast``: graph replay only). Reports achieved
bandwidth over the bytes that must move and speedup over dense against the ideal 1 / kept.
Writes ``results/sparse_mlp.json`` (``--tune``: also ``results/sparse_mlp_tuning.json``;
``--tune-llama``: ``dejavu_lab/kernels/tuned/tuning_sparse_mlp.json``, read at run time;
``--tune-dejavu``: the down projection at DejaVu's OPT points, ``tuning_sparse_mlp_down_<gpu>.json``).

    PYTHONPATH=. python kernels/bench_sparse_mlp.py [--shapes all|opt|llama] [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from dejavu_lab import results
from dejavu_lab.bench.kernels import MlpCase, mlp_row
from dejavu_lab.bench.timing import copy_ceiling, graph_us, relerr, rotation_copies, sweep
from dejavu_lab.kernels import tuning

OPT_SHAPES = [(4096, 16384), (8192, 32768), (12288, 49152)]  # (d, hidden)
LLAMA_SHAPES = [(4096, 11008), (5120, 13824), (4096, 14336)]
SHAPES = OPT_SHAPES + LLAMA_SHAPES
KEPT = [0.5, 0.2, 0.1, 0.05]
BATCHES = [1, 4, 16]
PROVIDERS = ["dense", "contig", "torch", "triton"]
FAST = False  # --fast: graph replay only (graph_us)

# Candidate tile shapes for --tune (batch 1 uses the FMA path; batches > 1 the tl.dot path).
TUNE = {
    ("up", 1): [
        {"BLOCK_N": n, "BLOCK_D": bd, "num_warps": w, "prefetch": pf}
        for n, bd, w, pf in [
            (1, 1024, 4, True),
            (1, 512, 4, True),
            (2, 512, 4, True),
            (1, 2048, 8, True),
            (2, 1024, 8, True),
            (1, 1024, 4, False),
            (4, 512, 8, False),
            (1, 512, 2, True),
        ]
    ],  # fmt: skip
    ("up", 16): [
        {"BLOCK_N": n, "BLOCK_D": bd, "num_warps": w, "num_stages": st}
        for n, bd, w, st in [
            (16, 512, 4, 4),
            (16, 512, 8, 5),
            (16, 1024, 8, 3),
            (32, 256, 4, 4),
            (32, 512, 8, 4),
            (64, 128, 4, 3),
            (16, 256, 4, 5),
        ]
    ],  # fmt: skip
    ("down", 1): [
        {"BLOCK_R": r, "BLOCK_D": bd, "num_warps": w, "programs": p, "fused": fu}
        for r, bd, w, p, fu in [
            (32, 256, 4, 396, True),
            (32, 256, 4, 528, True),
            (16, 256, 1, 2112, True),
            (16, 256, 1, 4224, True),
            (32, 256, 2, 1056, True),
            (16, 256, 2, 2112, True),
            (8, 256, 1, 4224, True),
            (16, 128, 1, 4224, True),
            (16, 256, 1, 2112, False),
        ]
    ],  # fmt: skip
    ("down", 16): [
        {"BLOCK_R": r, "BLOCK_D": bd, "num_warps": w, "programs": p, "num_stages": st, "fused": fu}
        for r, bd, w, p, st, fu in [
            (64, 128, 4, 528, 4, False),
            (64, 128, 4, 528, 4, True),
            (32, 128, 4, 1056, 4, False),
            (64, 64, 4, 1056, 4, False),
            (32, 128, 2, 1056, 3, False),
        ]
    ],  # fmt: skip
}

# --tune: the best swept tiles (mean fraction of ideal over KEPT) replace the package defaults
# for the table that follows; each row records the config it ran with (None = defaults).
BEST: dict[tuple[str, bool], dict] = {}

ROWS: list[dict] = []
_CASE: dict[tuple[int, int], MlpCase] = {}
_DENSE: dict[tuple, tuple[float, float]] = {}


def case_for(d: int, n: int | None = None) -> MlpCase:
    key = (d, n or 4 * d)
    if key not in _CASE:
        _CASE.clear()  # one shape's weights on the GPU at a time
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        _CASE[key] = MlpCase(d, hidden=key[1], min_kept=min(KEPT))
    return _CASE[key]


def measure(op, d, kept, batch, provider, config=None, graph_only=False, n=None) -> dict:
    if provider == "triton" and config is None:
        config = BEST.get((op, batch == 1))
    return mlp_row(case_for(d, n), op, kept, batch, provider, dense_cache=_DENSE, config=config,
                   graph_only=graph_only, fast=FAST)  # fmt: skip


def make_benchmarks(shapes, kept, batches):
    x_vals = [(d, n, k, b) for d, n in shapes for b in batches for k in kept]
    return [
        triton.testing.Benchmark(
            x_names=["d", "n", "kept", "batch"],
            x_vals=x_vals,
            line_arg="provider",
            line_vals=PROVIDERS,
            line_names=["dense cuBLAS", "contiguous cuBLAS", "torch gather", "Triton (ours)"],
            ylabel="TB/s over bytes that must move (graph replay)",
            plot_name=f"sparse_mlp_{op}",
            args={"op": op},
        )  # fmt: skip
        for op in ("up", "down")
    ]


def check_correctness(shapes):
    """Kernels vs the fp32 reference on fresh inputs before any timing (fp16; bf16 once)."""
    worst = 0.0
    for d, n in shapes:
        for op in ("up", "down"):
            for batch in (1, 16):
                err = case_for(d, n).check(op, 0.1, batch)
                worst = max(worst, err)
                assert err < 5e-3, f"{op} d={d} batch={batch}: relative error {err:.2e}"
    small = MlpCase(min(1024, shapes[0][0]), dtype=torch.bfloat16, min_kept=0.5)
    for op in ("up", "down"):
        for batch in (1, 8):
            err = small.check(op, 0.3, batch)
            assert err < 2e-2, f"bf16 {op} batch={batch}: relative error {err:.2e}"
    print(f"correctness: worst fp16 relative error {worst:.2e} (bf16 checked too)")
    return worst


def tune(ops, d=12288):
    rows = []
    for (op, batch), configs in TUNE.items():
        if op not in ops:
            continue
        for kept in KEPT:
            for cfg in configs:
                row = measure(op, d, kept, batch, "triton", cfg, graph_only=True)
                rows.append(row)
            best = max((r for r in rows if (r["op"], r["batch"], r["kept"]) == (op, batch, kept)),
                       key=lambda r: r["frac_ideal_graph"])  # fmt: skip
            print(f"tune {op:4s} B={batch:2d} kept={kept:.2f}: best {best['config']} "
                  f"{best['frac_ideal_graph']:.2f} of ideal")  # fmt: skip
        mine = [r for r in rows if (r["op"], r["batch"]) == (op, batch)]
        score = {}
        for r in mine:
            score.setdefault(repr(r["config"]), []).append(r["frac_ideal_graph"])
        win = max(mine, key=lambda r: sum(score[repr(r["config"])]))
        BEST[(op, batch == 1)] = win["config"]
        print(f"tune {op} B={batch}: table uses {win['config']}")
    return rows


def print_table(rows):
    print(f"\n{'op':4s} {'d':>5s} {'n':>5s} {'B':>2s} {'kept':>5s} | {'dense':>7s} {'contig':>7s} "
          f"{'torch':>7s} {'ours':>7s} us (graph) | ours TB/s | speedup ideal frac | vs contig")  # fmt: skip
    key = {}
    for r in rows:
        key[(r["op"], r["d"], r["hidden"], r["batch"], r["kept"], r["provider"])] = r
    for (op, d, n, b, k, p), r in sorted(key.items()):
        if p != "triton":
            continue
        dn, tc = key[(op, d, n, b, k, "dense")], key[(op, d, n, b, k, "torch")]
        cg = key.get((op, d, n, b, k, "contig"))
        cg_ms = cg["graph_ms"] if cg else float("nan")
        print(f"{op:4s} {d:5d} {n:5d} {b:2d} {k:5.2f} | {dn['graph_ms'] * 1e3:7.1f} "
              f"{cg_ms * 1e3:7.1f} {tc['graph_ms'] * 1e3:7.1f} {r['graph_ms'] * 1e3:7.1f}    | "
              f"{r['graph_tbps']:9.2f} | {r['speedup_graph']:7.2f} {r['ideal']:5.1f} "
              f"{r['frac_ideal_graph']:4.2f} | {cg_ms / r['graph_ms']:9.2f}")  # fmt: skip


# --tune-llama: candidates for the Llama shapes, recorded for run-time lookup (.tuning)
TUNE_LLAMA = {
    ("up", True): [
        {"BLOCK_N": 1, "BLOCK_D": 2048, "num_warps": 8, "prefetch": True},
        {"BLOCK_N": 1, "BLOCK_D": 1024, "num_warps": 4, "prefetch": True},
        {"BLOCK_N": 2, "BLOCK_D": 1024, "num_warps": 8, "prefetch": True},
        {"BLOCK_N": 4, "BLOCK_D": 512, "num_warps": 4, "prefetch": True},
        {"BLOCK_N": 1, "BLOCK_D": 4096, "num_warps": 8, "prefetch": False},
    ],
    ("up", False): [
        {"BLOCK_N": 32, "BLOCK_D": 256, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 16, "BLOCK_D": 512, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3},
    ],
    ("down", True): [
        {"BLOCK_R": 32, "BLOCK_D": 256, "num_warps": 4, "programs_per_sm": 4, "fused": True},
        {"BLOCK_R": 16, "BLOCK_D": 256, "num_warps": 4, "programs_per_sm": 2, "fused": True},
        {"BLOCK_R": 32, "BLOCK_D": 256, "num_warps": 8, "programs_per_sm": 1, "fused": True},
        {"BLOCK_R": 16, "BLOCK_D": 256, "num_warps": 1, "programs_per_sm": 16, "fused": True},
        {
            "dot": True,
            "BLOCK_R": 64,
            "BLOCK_D": 256,
            "num_warps": 8,
            "num_stages": 4,
            "programs_per_sm": 1,
            "fused": True,
        },  # fmt: skip
        {
            "dot": True,
            "BLOCK_R": 32,
            "BLOCK_D": 128,
            "num_warps": 4,
            "num_stages": 3,
            "programs_per_sm": 2,
            "fused": True,
        },  # fmt: skip
    ],
    ("down", False): [
        {
            "BLOCK_R": 64,
            "BLOCK_D": 64,
            "num_warps": 4,
            "num_stages": 4,
            "programs_per_sm": 8,
            "fused": False,
        },  # fmt: skip
        {
            "BLOCK_R": 64,
            "BLOCK_D": 128,
            "num_warps": 4,
            "num_stages": 4,
            "programs_per_sm": 2,
            "fused": True,
        },  # fmt: skip
        {
            "BLOCK_R": 64,
            "BLOCK_D": 256,
            "num_warps": 8,
            "num_stages": 4,
            "programs_per_sm": 1,
            "fused": True,
        },  # fmt: skip
    ],
}


def tune_llama(command, batches=(1, 16)):
    """Sweep TUNE_LLAMA at the Llama shapes; record the timings for run-time lookup."""
    rows = []
    for d, n in LLAMA_SHAPES:
        for op in ("up", "down"):
            for batch in batches:
                for kept in (0.5, 0.2, 0.1):
                    best = None
                    for cfg in TUNE_LLAMA[(op, batch == 1)]:
                        try:
                            r = measure(op, d, kept, batch, "triton", cfg, n=n)
                        except Exception as exc:  # a candidate that fails to compile is skipped
                            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                            continue
                        d_in, d_out = (d, n) if op == "up" else (n, d)
                        rows.append({"op": f"sparse_mlp_{op}", "d_in": d_in, "d_out": d_out,
                                     "kept": kept, "batch": batch, "config": cfg,
                                     "us": r["graph_ms"] * 1e3,
                                     "frac_ideal": r["frac_ideal_graph"]})  # fmt: skip
                        best = max(best or 0.0, r["frac_ideal_graph"])
                    print(f"tune {op:4s} {d}x{n} B={batch:2d} kept={kept:.2f}: best {best:.2f} "
                          "of ideal", flush=True)  # fmt: skip
    path = results.save("tuning_sparse_mlp", rows, command=command, folder=tuning.TUNED_DIR)
    tuning.reload()
    print(f"wrote {path}")


# --tune-dejavu: DejaVu's batch-1 down projections at OPT shapes (W2^T at 15% of the neurons,
# W_O^T at half the heads: blocks of d_head rows) and Llama's (half of each), recorded per GPU
DEJAVU_POINTS = [  # (n_rows, d, kept, rows per index)
    (20480, 5120, 0.15, 1), (5120, 5120, 0.5, 128),  # OPT-13B
    (28672, 7168, 0.15, 1), (7168, 7168, 0.5, 128),  # OPT-30B
    (14336, 4096, 0.5, 1), (4096, 4096, 0.5, 128),  # Llama-3-8B
    (36864, 9216, 0.15, 1), (9216, 9216, 0.5, 128),  # OPT-66B
]  # fmt: skip
DEJAVU_TILES = [(32, 256, 4), (16, 256, 2), (32, 512, 4), (64, 256, 8), (16, 512, 4),
                (32, 128, 2), (64, 128, 4), (16, 128, 1)]  # (BLOCK_R, BLOCK_D, warps)  # fmt: skip
# the one-tile-per-program kernel (kernels/mlp/down_tile.py): no loop, so no programs or prefetch
DEJAVU_ONE_TILES = [(64, 128, 4), (128, 64, 2), (128, 128, 4), (32, 256, 4), (64, 64, 2),
                    (256, 64, 4), (32, 128, 2), (128, 256, 8), (16, 256, 2)]  # fmt: skip


def tune_dejavu(command: str) -> Path:
    """Sweep the one-tile kernel's tiles, and the split FMA path's tiles, programs per SM and
    prefetch depth (0, or 2: the next step's weights in flight) at DEJAVU_POINTS; record every correct config's graph-replay µs
    in ``tuned/tuning_sparse_mlp_down_<gpu>.json`` (read at run time, :mod:`~dejavu_lab.kernels.
    tuning`) and print the best per point against the bytes floor."""
    from dejavu_lab.kernels.mlp.down import sparse_mlp_down, sparse_mlp_down_ref

    dev, ceiling, rows = torch.device("cuda"), copy_ceiling(), []
    name = torch.cuda.get_device_name()
    slug = (re.search(r"\b[A-Z]\d{2,3}\b", name) or re.search(r"\w+$", name)).group(0).lower()
    cands = [{"mode": "tile", "BLOCK_R": r, "BLOCK_D": bd, "num_warps": w}
             for r, bd, w in DEJAVU_ONE_TILES]  # fmt: skip
    cands += [{"mode": "split", "BLOCK_R": r, "BLOCK_D": bd, "num_warps": w, "programs_per_sm": p,
               "prefetch": pf, "fused": True}
              for (r, bd, w), p, pf in itertools.product(DEJAVU_TILES, (2, 4, 8), (0, 2))]  # fmt: skip
    for n, d, kept, g in DEJAVU_POINTS:
        k = round(n // g * kept) * g
        floor_us = k * d * 2 / (ceiling * 1e6)
        copies = rotation_copies(k * d * 2, n * d * 2)
        ws = [torch.randn(n, d, device=dev, dtype=torch.float16) / n**0.5 for _ in range(copies)]
        idx = torch.randperm(n // g, device=dev)[: k // g].sort().values.to(torch.int32)
        h = torch.randn(k, device=dev, dtype=torch.float16)
        out = torch.empty(d, device=dev, dtype=torch.float16)
        ref = sparse_mlp_down_ref(h, ws[0], idx, rows_per_index=g)

        def run(cfg, w, idx=idx, h=h, out=out, g=g):
            return sparse_mlp_down(h, w, idx, rows_per_index=g, out=out, config=cfg)

        base = graph_us([functools.partial(run, None, w) for w in ws])
        timed = sweep(cands, lambda c, ref=ref, w=ws[0]: relerr(run(c, w).clone(), ref),
                      lambda c, ws=ws: graph_us([functools.partial(run, c, w) for w in ws]))  # fmt: skip
        for cfg, us in timed:
            rows.append({"op": "sparse_mlp_down", "d_in": n, "d_out": d, "kept": kept,
                         "batch": 1, "config": cfg, "us": us, "frac_ideal": floor_us / us})  # fmt: skip
        best = min(timed, key=lambda t: t[1])
        print(f"down {n}x{d} kept {kept:.2f} (x{g} rows): heuristic {base:.1f} µs "
              f"({floor_us / base:.2f} of its floor), best {best[1]:.1f} µs "
              f"({floor_us / best[1]:.2f}) {best[0]}", flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
        # after every point: a sweep cut short by a time limit keeps the points it finished
        path = results.save(f"tuning_sparse_mlp_down_{slug}", rows, command=command,
                            folder=tuning.TUNED_DIR, extra={"copy_tbps": ceiling})  # fmt: skip
    tuning.reload()
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", nargs="*", choices=["up", "down"], help="sweep tiles at d=12288")
    ap.add_argument("--tune-only", action="store_true", help="sweep, record, stop")
    ap.add_argument("--tune-llama", action="store_true", help="sweep the Llama shapes first")
    ap.add_argument("--tune-dejavu", action="store_true",
                    help="sweep the batch-1 down projection at DejaVu's OPT and Llama points, "
                    "record the GPU's table, stop")  # fmt: skip
    ap.add_argument("--shapes", choices=["all", "opt", "llama"], default="all")
    ap.add_argument("--batches", type=int, nargs="*", help="union batches to time (default 1 4 16)")
    ap.add_argument("--fast", action="store_true", help="graph replay only (short GPU lease)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_sparse_mlp.py " + " ".join(argv or sys.argv[1:])
    global SHAPES, KEPT, BATCHES, FAST
    SHAPES = {"all": OPT_SHAPES + LLAMA_SHAPES, "opt": OPT_SHAPES, "llama": LLAMA_SHAPES}[
        args.shapes
    ]
    BATCHES = args.batches or BATCHES
    FAST = args.fast
    if args.quick:
        SHAPES, KEPT, BATCHES = [(64, 256), (128, 352)], [0.5, 0.1], [1, 4]
    if args.tune_dejavu:
        print(f"wrote {tune_dejavu(command)}")
        return
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    check_correctness(SHAPES)
    if (args.tune is not None or args.tune_only) and not args.quick:
        ops = args.tune or ["up", "down"]
        trows = tune(ops)
        name = "sparse_mlp_tuning" + ("" if len(ops) == 2 else "_" + ops[0])
        results.save(name, trows, command=command, extra={"copy_tbps": ceiling})
        if args.tune_only:
            return
    if args.tune_llama and not args.quick:
        tune_llama(command)
    for bench in make_benchmarks(SHAPES, KEPT, BATCHES):
        op = bench.args["op"]

        @triton.testing.perf_report(bench)
        def run(d, n, kept, batch, provider, op=op):
            row = measure(op, d, kept, batch, provider, n=n)
            ROWS.append(row)
            return row["graph_tbps"]

        run.run(print_data=False, show_plots=False)
    print_table(ROWS)
    if args.quick:
        return
    name = "sparse_mlp" if args.shapes == "all" else f"sparse_mlp_{args.shapes}"
    path = results.save(name, ROWS, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
