"""DejaVu's kept sets: ``torch.topk`` against our one-launch select, per call.

DejaVu's lookahead predictors score every neuron of the next layer, and the engine keeps the
top-k of each row (``dejavu_lab.engine.sets``) with ``torch.topk``. Our
``dejavu_lab.kernels.select.topk_select`` gives each row one program, finds the k-th largest
by bisection over its key's bits (32 counting passes over the row, which stays in L1) and writes
the kept entries in index order. This bench times it
beside ``torch.topk`` (PyTorch selects in one single-block
launch until a row is long for the number of rows, 20,000 entries for up to 20 rows, then in a
multi-block select of about a dozen launches), per call in CUDA-graph replay, at the widths and
budgets the engine runs (85% of the MLP dropped on OPT shapes, 50% and 85% at Llama-3-8B's
width, the 40 or 56 heads at 50%, batches of 16 and 32), after checking that both keep the same
values. Writes ``results/topk_select.json``.

    python kernels/bench_topk.py            # on a GPU
    python kernels/bench_topk.py --quick    # the same shapes on the CPU: checks only
"""

from __future__ import annotations

import argparse
import sys

import torch

from dejavu_lab import results
from dejavu_lab.bench.timing import graph_us, print_rows
from dejavu_lab.budgets import n_keep
from dejavu_lab.engine.sets import topk_into

# (shape, entries per row: neurons or heads, fraction of them dropped, rows: the sequences)
CASES = [("llama-3-8b", 14336, 0.5, 1), ("llama-3-8b", 14336, 0.85, 1),
         ("opt-13b", 20480, 0.85, 1), ("opt-30b", 28672, 0.85, 1), ("opt-66b", 36864, 0.85, 1),
         ("opt-13b", 40, 0.5, 1), ("opt-30b", 56, 0.5, 1),
         ("opt-13b", 20480, 0.85, 16), ("llama-3-8b", 14336, 0.85, 32)]  # fmt: skip
COLUMNS = [("shape", "shape", "11s"), ("n", "n", "6d"), ("k", "k", "6d"), ("rows", "rows", "4d"),
           ("torch us", "torch_us", "8.2f"), ("ours us", "kernel_us", "8.2f"),
           ("torch/ours", "speedup", "10.2f")]  # fmt: skip


def case(shape: str, n: int, drop: float, rows: int, device, n_calls: int) -> dict:
    """One row of the table: both selections checked, then timed (GPU) or only checked (CPU)."""
    k = n_keep(drop, n)
    g = torch.Generator(device="cpu").manual_seed(n + rows)
    s = torch.randn(rows, n, generator=g).to(device).squeeze(0)  # one row: a vector, as the engine
    out = {"shape": shape, "n": n, "k": k, "rows": rows, "drop": drop}
    bufs = {v: (torch.empty(*s.shape[:-1], k, device=device),
                torch.empty(*s.shape[:-1], k, dtype=torch.long, device=device))
            for v in ("torch", "kernel")}  # fmt: skip
    for v, (vals, idx) in bufs.items():
        topk_into(s, k, vals, idx, kernel=v == "kernel")
        if not torch.equal(s.gather(-1, idx), vals):
            raise SystemExit(f"{shape} {v}: the indices do not point at the values.")
    a, b = (bufs[v][0].sort(dim=-1).values for v in ("torch", "kernel"))
    if not torch.equal(a, b):
        raise SystemExit(f"{shape} n={n} k={k} rows={rows}: the two selections kept other values.")
    if device.type == "cuda":
        for v, (vals, idx) in bufs.items():
            out[f"{v}_us"] = graph_us(
                [lambda v=v, vals=vals, idx=idx: topk_into(s, k, vals, idx, kernel=v == "kernel")],
                n_calls=n_calls,
            )
        out["speedup"] = out["torch_us"] / out["kernel_us"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="on the CPU: check both selections, no timing"
    )
    ap.add_argument("--calls", type=int, default=80, help="calls per captured graph")
    args = ap.parse_args(argv)
    command = "python kernels/bench_topk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_topk needs a CUDA GPU (use --quick for a CPU check).")
    else:
        device = torch.device("cuda")
    table = [case(*c, device, args.calls) for c in CASES]
    print_rows(table, COLUMNS)
    if not args.quick:
        path = results.save("topk_select", table, command=command)
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
