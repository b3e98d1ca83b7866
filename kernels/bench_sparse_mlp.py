"""Sparse MLP kernels vs dense cuBLAS and a torch gather baseline (Deja Vu §4.4, Appendix E).

For d in {4096, 8192, 12288} (OPT-6.7B, -66B, -175B; hidden 4d), kept fraction in
{50, 20, 10, 5}% and batch 1 plus union batches 4 and 16, times the up-projection
(fc1 + bias + ReLU, selected rows only) and the down-projection (fc2 over W2 stored
transposed) three ways — dense cuBLAS, torch ``index_select`` + matmul, our Triton kernel —
with ``do_bench`` (events, L2 flushed) and ``do_bench_cudagraph`` (graph replay). Reports
achieved bandwidth over the bytes that must move and speedup over dense against the ideal
1 / kept. Writes ``results/sparse_mlp.json`` (``--tune``: also ``results/sparse_mlp_tuning.json``).

    PYTHONPATH=. python kernels/bench_sparse_mlp.py [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing

from dejavu_lab import results
from dejavu_lab.kernels.bench import MlpCase, copy_ceiling, mlp_row

DIMS = [4096, 8192, 12288]
KEPT = [0.5, 0.2, 0.1, 0.05]
BATCHES = [1, 4, 16]
PROVIDERS = ["dense", "torch", "triton"]

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
_CASE: dict[int, MlpCase] = {}
_DENSE: dict[tuple, tuple[float, float]] = {}


def case_for(d: int) -> MlpCase:
    if d not in _CASE:
        _CASE.clear()  # one shape's weights on the GPU at a time
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        _CASE[d] = MlpCase(d, min_kept=min(KEPT))
    return _CASE[d]


def measure(op, d, kept, batch, provider, config=None, graph_only=False) -> dict:
    if provider == "triton" and config is None:
        config = BEST.get((op, batch == 1))
    return mlp_row(case_for(d), op, kept, batch, provider, dense_cache=_DENSE, config=config,
                   graph_only=graph_only)  # fmt: skip


def make_benchmarks(dims, kept, batches):
    x_vals = [(d, k, b) for d in dims for b in batches for k in kept]
    return [
        triton.testing.Benchmark(
            x_names=["d", "kept", "batch"],
            x_vals=x_vals,
            line_arg="provider",
            line_vals=PROVIDERS,
            line_names=["dense cuBLAS", "torch gather", "Triton (ours)"],
            ylabel="TB/s over bytes that must move (graph replay)",
            plot_name=f"sparse_mlp_{op}",
            args={"op": op},
        )  # fmt: skip
        for op in ("up", "down")
    ]


def check_correctness(dims):
    """Kernels vs the fp32 reference on fresh inputs before any timing (fp16; bf16 once)."""
    worst = 0.0
    for d in dims:
        for op in ("up", "down"):
            for batch in (1, 16):
                err = case_for(d).check(op, 0.1, batch)
                worst = max(worst, err)
                assert err < 5e-3, f"{op} d={d} batch={batch}: relative error {err:.2e}"
    small = MlpCase(min(1024, dims[0]), dtype=torch.bfloat16, min_kept=0.5)
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
    print(f"\n{'op':4s} {'d':>5s} {'B':>2s} {'kept':>5s} | {'dense':>7s} {'torch':>7s} "
          f"{'ours':>7s} us (graph) | ours TB/s | speedup ideal frac | event frac")  # fmt: skip
    key = {}
    for r in rows:
        key[(r["op"], r["d"], r["batch"], r["kept"], r["provider"])] = r
    for (op, d, b, k, p), r in sorted(key.items()):
        if p != "triton":
            continue
        dn, tc = key[(op, d, b, k, "dense")], key[(op, d, b, k, "torch")]
        print(f"{op:4s} {d:5d} {b:2d} {k:5.2f} | {dn['graph_ms'] * 1e3:7.1f} "
              f"{tc['graph_ms'] * 1e3:7.1f} {r['graph_ms'] * 1e3:7.1f}    | "
              f"{r['graph_tbps']:9.2f} | {r['speedup_graph']:7.2f} {r['ideal']:5.1f} "
              f"{r['frac_ideal_graph']:4.2f} | {r['frac_ideal_event']:4.2f}")  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", nargs="*", choices=["up", "down"], help="sweep tiles at d=12288")
    ap.add_argument("--tune-only", action="store_true", help="sweep, record, stop")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_sparse_mlp.py " + " ".join(argv or sys.argv[1:])
    global DIMS, KEPT, BATCHES
    if args.quick:
        DIMS, KEPT, BATCHES = [64, 128], [0.5, 0.1], [1, 4]
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    check_correctness(DIMS)
    if (args.tune is not None or args.tune_only) and not args.quick:
        ops = args.tune or ["up", "down"]
        trows = tune(ops)
        name = "sparse_mlp_tuning" + ("" if len(ops) == 2 else "_" + ops[0])
        results.save(name, trows, command=command, extra={"copy_tbps": ceiling})
        if args.tune_only:
            return
    for bench in make_benchmarks(DIMS, KEPT, BATCHES):
        op = bench.args["op"]

        @triton.testing.perf_report(bench)
        def run(d, kept, batch, provider, op=op):
            row = measure(op, d, kept, batch, provider)
            ROWS.append(row)
            return row["graph_tbps"]

        run.run(print_data=False, show_plots=False)
    print_table(ROWS)
    path = results.save("sparse_mlp", ROWS, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
