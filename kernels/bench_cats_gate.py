"""CATS's dense gate at batch 1: cuBLAS against the split-K tiles of ``kernels.cats.sums``.

CATS (``dejavu_lab.kernels.cats.mlp``) computes the gate of every neuron densely, then reads the
up and down rows of the neurons it keeps. On an H200 the gate alone (13824 x 5120 at Llama-2-13B's
shape) ran at about 3.8 TB/s through cuBLAS, under the 4.2 TB/s that the threshold tile grid
reaches on the same bytes. This bench times, at the Llama shapes, batch 1, fp16, in CUDA-graph
replay with weights rotated past the L2:

- ``cublas_fp32`` (``torch.mm(..., out_dtype=float32)``, cuBLAS's fp32 sums), ``cublas_fp16``;
- ``rows_sums`` at each candidate tiling (fp32 sums left in a workspace, as CATS reads them);
- CATS's hidden activations (gate + threshold + kept up rows) and the whole CATS MLP at 50% kept,
  each with the cuBLAS gate and with the split-K gate.

Every variant is checked against fp32 math first. Writes ``results/cats_gate.json``.

    python kernels/bench_cats_gate.py            # on a GPU
    python kernels/bench_cats_gate.py --quick    # tiny shapes, CPU plumbing check
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from dejavu_lab import results
from dejavu_lab.bench.timing import copy_ceiling, graph_us, print_rows, relerr, rotation_copies
from dejavu_lab.kernels.cats.mlp import cats_hidden, cats_mlp, cats_mlp_ref
from dejavu_lab.kernels.cats.sums import rows_sums

SHAPES = [("llama-2-13b", 5120, 13824), ("llama-3-8b", 4096, 14336), ("llama-2-7b", 4096, 11008)]
TILES = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
         for n, k, w in [(64, 128, 2), (64, 128, 1), (128, 64, 2), (128, 64, 1), (32, 128, 1),
                         (64, 64, 1), (128, 128, 4), (256, 64, 4), (64, 256, 4), (32, 256, 2)]]  # fmt: skip
KEPT = 0.5


def case(d, n, device, copies):
    w = [torch.randn(2 * n, d, dtype=torch.float16, device=device) / d**0.5 for _ in range(copies)]
    wd = [torch.randn(n, d, dtype=torch.float16, device=device) / n**0.5 for _ in range(copies)]
    x = [torch.randn(1, d, dtype=torch.float16, device=device) for _ in range(copies)]
    thr = []
    for c in range(copies):
        a = F.silu(x[c].float() @ w[c][:n].float().T).abs()
        thr.append(torch.full((n,), float(torch.quantile(a, 1 - KEPT)), device=device))
    return w, wd, x, thr


def mm(x, w, fp32):
    """cuBLAS's gate (fp32 or fp16 output); fp32 math on the CPU (--quick)."""
    if x.device.type != "cuda":
        return x.float() @ w.float().T
    return torch.mm(x, w.T, out_dtype=torch.float32) if fp32 else torch.mm(x, w.T)


def rows(d, n, device, ceiling):
    gate_bytes = n * d * 2
    copies = rotation_copies(gate_bytes, 4 * gate_bytes) if device.type == "cuda" else 1
    w, wd, x, thr = case(d, n, device, copies)
    cs = range(copies)
    want = (x[0].float() @ w[0][:n].float().T)[0]
    out = []

    def row(variant, us, nbytes, err, config=None):
        out.append({"d": d, "n": n, "variant": variant, "config": config, "us": us,
                    "bytes": nbytes, "tbps": nbytes / (us * 1e-6) / 1e12,
                    "of_ceiling": nbytes / (us * 1e-6) / 1e12 / ceiling, "relerr": err})  # fmt: skip

    for label, fp32 in (("cublas_fp32", True), ("cublas_fp16", False)):
        g = mm(x[0], w[0][:n], fp32)
        row(label, graph_us([lambda c=c, f=fp32: mm(x[c], w[c][:n], f) for c in cs]), gate_bytes,
            relerr(g[0], want))  # fmt: skip
    for cfg in TILES:
        try:
            ws = rows_sums(x[0], w[0][:n], kind="bench_check", config=cfg)
            err = relerr(ws, want)
            ws.zero_()  # the timed calls below pile up in their own workspace
            us = graph_us([lambda c=c, f=cfg: rows_sums(x[c], w[c][:n], kind="bench", config=f)
                           for c in cs])  # fmt: skip
        except Exception as exc:  # a tiling that fails to compile is skipped
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        row("rows_sums", us, gate_bytes, err, cfg)
    kept_bytes = gate_bytes + KEPT * gate_bytes  # the gate and about half the up rows
    mlp_bytes = kept_bytes + KEPT * gate_bytes
    ref = cats_mlp_ref(x[0], w[0], wd[0], thr[0], activation="silu")
    for label, extra in (("cublas", {"cublas_gate": True}), ("rows_sums", {})):
        h = cats_hidden(x[0], w[0], thr[0], activation="silu", n=n, config=extra)
        a = F.silu(want)
        hr = torch.where(a.abs() > thr[0], a * (x[0].float() @ w[0][n:].float().T)[0], 0.0)
        row(f"hidden_{label}", graph_us([lambda c=c, e=extra: cats_hidden(
            x[c], w[c], thr[c], activation="silu", n=n, config=e) for c in cs]),
            kept_bytes, relerr(h[0], hr))  # fmt: skip
        y = cats_mlp(x[0], w[0], wd[0], thr[0], activation="silu", config=extra)
        row(f"mlp_{label}", graph_us([lambda c=c, e=extra: cats_mlp(
            x[c], w[c], wd[c], thr[c], activation="silu", config=e) for c in cs]), mlp_bytes, relerr(y, ref))  # fmt: skip
    return out


COLUMNS = [("d", "d", "6d"), ("n", "n", "6d"), ("variant", "variant", "14s"),
           ("config", "config", "52s"), ("us", "us", "7.2f"), ("TB/s", "tbps", "5.2f"),
           ("of ceiling", "of_ceiling", "5.2f"), ("relerr", "relerr", "8.1e")]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_cats_gate.py " + " ".join(argv or sys.argv[1:])
    global TILES
    shapes = SHAPES
    if args.quick:
        shapes, device, ceiling = [("tiny", 64, 96)], torch.device("cpu"), 1.0
        TILES = TILES[:2]
    elif not torch.cuda.is_available():
        raise SystemExit("bench_cats_gate needs a CUDA GPU (use --quick for a CPU check).")
    else:
        device, ceiling = torch.device("cuda"), copy_ceiling()
        print(f"copy ceiling: {ceiling:.2f} TB/s")
    table = []
    for name, d, n in shapes:
        for r in rows(d, n, device, ceiling):
            table.append({"shape": name, **r, "config": r["config"] or {}})
        torch.cuda.empty_cache() if device.type == "cuda" else None
    bad = [r for r in table if not r["relerr"] < 1e-2]
    print_rows([{**r, "config": str(r["config"])} for r in table], COLUMNS)
    if bad:
        raise SystemExit(f"{len(bad)} variants computed the wrong result: {bad[:2]}")
    if not args.quick:
        path = results.save("cats_gate", table, command=command, extra={"copy_tbps": ceiling})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
