"""DejaVu's kept-set selection: one ``torch.topk`` per row against the engine's split top-k.

DejaVu's lookahead predictors score every neuron of the next layer, and the engine keeps the
top-k of each row (``dejavu_lab.engine.sets``). PyTorch's CUDA top-k selects a row in one
single-block launch until the row is long for the number of rows (20,000 entries for up to 20
rows: OPT-13B's 20,480 neurons and up), then in a multi-block select of about a dozen launches.
``topk_into`` cuts such rows into equal parts and selects twice, each pass one single-block
launch. This bench times both, per call, in CUDA-graph replay, at the widths and budgets the
engine runs (85% of the MLP dropped on OPT shapes, 50% at Llama-3-8B's width, batches of 16
and 32), after checking that both keep the same values. Writes ``results/topk_split.json``.

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
from dejavu_lab.engine.sets import multiblock, topk_into, topk_parts

# (shape, neurons per layer, fraction of them dropped, rows: the batch's sequences)
CASES = [("llama-3-8b", 14336, 0.5, 1), ("llama-3-8b", 14336, 0.85, 1),
         ("opt-13b", 20480, 0.85, 1), ("opt-30b", 28672, 0.85, 1), ("opt-66b", 36864, 0.85, 1),
         ("opt-13b", 20480, 0.85, 16), ("llama-3-8b", 14336, 0.85, 32)]  # fmt: skip
COLUMNS = [("shape", "shape", "11s"), ("n", "n", "6d"), ("k", "k", "6d"), ("rows", "rows", "4d"),
           ("parts", "parts", "5d"), ("multi", "multiblock", "5d"), ("torch us", "torch_us", "8.2f"),
           ("split us", "split_us", "8.2f"), ("torch/split", "speedup", "11.2f")]  # fmt: skip


def case(shape: str, n: int, drop: float, rows: int, device, n_calls: int) -> dict:
    """One row of the table: both selections checked, then timed (GPU) or only checked (CPU)."""
    k = n_keep(drop, n)
    g = torch.Generator(device="cpu").manual_seed(n + rows)
    s = torch.randn(rows, n, generator=g).to(device).squeeze(0)  # one row: a vector, as the engine
    out = {"shape": shape, "n": n, "k": k, "rows": rows, "drop": drop,
           "parts": topk_parts(n, k, rows), "multiblock": int(multiblock(rows, n))}  # fmt: skip
    bufs = {v: (torch.empty(*s.shape[:-1], k, device=device),
                torch.empty(*s.shape[:-1], k, dtype=torch.long, device=device))
            for v in ("torch", "split")}  # fmt: skip
    for v, (vals, idx) in bufs.items():
        topk_into(s, k, vals, idx, split=v == "split")
        if not torch.equal(s.gather(-1, idx), vals):
            raise SystemExit(f"{shape} {v}: the indices do not point at the values.")
    a, b = (bufs[v][0].sort(dim=-1).values for v in ("torch", "split"))
    if not torch.equal(a, b):
        raise SystemExit(f"{shape} n={n} k={k} rows={rows}: the split top-k kept other values.")
    if device.type == "cuda":
        for v, (vals, idx) in bufs.items():
            out[f"{v}_us"] = graph_us(
                [lambda v=v, vals=vals, idx=idx: topk_into(s, k, vals, idx, split=v == "split")],
                n_calls=n_calls,
            )
        out["speedup"] = out["torch_us"] / out["split_us"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="on the CPU: check both paths, no timing")
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
        path = results.save("topk_split", table, command=command)
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
