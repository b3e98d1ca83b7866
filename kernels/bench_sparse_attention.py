"""Sparse decode attention vs dense (Deja Vu §4.2, Appendix E) at OPT-175B shapes.

96 heads x d_head 128 (d = 12288), context 1024, batch 1 and union batch 16, kept heads
{50, 25}%: dense = cuBLAS QKV projection + cache write + ``scaled_dot_product_attention`` +
cuBLAS out-projection; torch = the same over ``index_select``-gathered rows and heads; ours =
:func:`dejavu_lab.kernels.sparse_attention` (sparse QKV, fused cache-append + attention over the
selected heads, sparse W_O^T). Both ``do_bench`` and ``do_bench_cudagraph`` timings; writes
``results/sparse_attention.json``.

    PYTHONPATH=. python kernels/bench_sparse_attention.py [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing

from dejavu_lab import results
from dejavu_lab.bench.kernels import AttentionCase, attention_row
from dejavu_lab.bench.timing import copy_ceiling

SHAPE = {"n_heads": 96, "d_head": 128, "context": 1024}  # OPT-175B, a 1024-token context
KEPT = [0.5, 0.25]
BATCHES = [1, 16]
PROVIDERS = ["dense", "torch", "triton"]
TUNE = [
    {"BLOCK_T": t, "num_warps": w, "programs": p}
    for t, w, p in [(64, 4, 528), (32, 4, 528), (64, 4, 264), (64, 4, 1056), (128, 8, 528),
                    (64, 4, 1)]  # programs=1: no context split
]  # fmt: skip
BEST: dict = {}

ROWS: list[dict] = []
_CASE: dict[int, AttentionCase] = {}
_DENSE: dict[int, tuple[float, float]] = {}


def case_for(batch: int) -> AttentionCase:
    if batch not in _CASE:
        _CASE.clear()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        _CASE[batch] = AttentionCase(**SHAPE, batch=batch)
    return _CASE[batch]


def measure(kept, batch, provider, config=None) -> dict:
    if provider == "triton" and config is None:
        config = BEST.get("config")
    return attention_row(case_for(batch), kept, provider, dense_cache=_DENSE, config=config)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help="sweep the attention kernel's tiles")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_sparse_attention.py " + " ".join(argv or sys.argv[1:])
    global BATCHES
    if args.quick:
        SHAPE.update(n_heads=4, d_head=16, context=32)
        BATCHES = [1, 2]
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    for batch in BATCHES:  # correctness first: fresh heads, fp32 reference
        err = case_for(batch).check(0.5)
        print(f"correctness batch {batch}: relative error {err:.2e}")
        assert err < 1e-2, f"sparse_attention relative error {err:.2e}"
    if args.tune and not args.quick:
        for cfg in TUNE:
            r = measure(0.5, 1, "triton", cfg)
            r["tuning"] = True
            ROWS.append(r)
            print(f"tune {cfg}: {r['graph_ms'] * 1e3:.1f} us, {r['frac_ideal_graph']:.2f} of ideal")
        BEST["config"] = max(ROWS, key=lambda r: r["frac_ideal_graph"])["config"]
        print(f"table uses {BEST['config']}")

    @triton.testing.perf_report(
        triton.testing.Benchmark(
            x_names=["batch", "kept"],
            x_vals=[(b, k) for b in BATCHES for k in KEPT],
            line_arg="provider",
            line_vals=PROVIDERS,
            line_names=["dense cuBLAS+SDPA", "torch gather", "Triton (ours)"],
            ylabel="ms (graph replay)",
            plot_name="sparse_attention",
            args={},
        )  # fmt: skip
    )
    def run(batch, kept, provider):
        row = measure(kept, batch, provider)
        ROWS.append(row)
        return row["graph_ms"]

    run.run(print_data=True, show_plots=False)
    print(f"\n{'B':>2s} {'kept':>5s} | {'dense':>7s} {'torch':>7s} {'ours':>7s} us (graph) | "
          "ours TB/s | speedup ideal frac | event frac")  # fmt: skip
    key = {(r["batch"], r["kept"], r["provider"]): r for r in ROWS if not r.get("tuning")}
    for (b, k, p), r in sorted(key.items()):
        if p == "triton":
            dn, tc = key[(b, k, "dense")], key[(b, k, "torch")]
            print(f"{b:2d} {k:5.2f} | {dn['graph_ms'] * 1e3:7.1f} {tc['graph_ms'] * 1e3:7.1f} "
                  f"{r['graph_ms'] * 1e3:7.1f}    | {r['graph_tbps']:9.2f} | "
                  f"{r['speedup_graph']:7.2f} {r['ideal']:5.1f} {r['frac_ideal_graph']:4.2f} | "
                  f"{r['frac_ideal_event']:4.2f}")  # fmt: skip
    path = results.save("sparse_attention", ROWS, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
