"""TEAL/WINA threshold GEMV vs dense cuBLAS, cuBLAS on the kept rows made contiguous, and TEAL.

TEAL (Liu et al. 2024, §4) reads only the weight columns whose input entry survives
``|x| > thr``; :func:`dejavu_lab.kernels.threshold_gemv` computes that mask inside the kernel.
For the Llama MLP shapes (down_proj 11008->4096, 13824->5120, 14336->4096 and the gate/up
direction) at 50 / 20 / 10% kept, batch 1 and a union batch of 16 (tokens sharing one kept
set), this times in CUDA-graph replay, on weights rotated through more than 4x the L2:

- ``dense``: cuBLAS ``x @ w_t`` over every row (ideal sparse time = dense x kept);
- ``contig``: cuBLAS over the same number of rows stored contiguously (a gather-free layout);
- ``masked``: the compacting kernel without compaction (masked loads of fixed row tiles, each
  program looping over its chunk of rows; batch 1 only);
- ``compact``: the compacting kernel (batch 1 only; union batches always run it);
- ``tile``: the tile kernel's union-batch form (batches above 1; opt-in, ``mode="tile"``);
- ``ours``: the threshold GEMV as the wrapper runs it: at batch 1 the tile kernel
  (:mod:`dejavu_lab.kernels.threshold.tile`, TEAL's grid of one masked tile per program with
  fp32 atomics), for union batches the compacting kernel's tuned config.

TEAL's own split-K kernel, measured on this H200 (fp16, batch 1, graph replay,
11008->4096): 17.7 / 15.4 / 14.8 µs at 50 / 20 / 10% kept against a 25.4 µs dense GEMV (rerun
in this harness, weights rotated, on 2026-12-01: 17.7 / 15.3 / 14.7 µs; a scratch script that
imported TEAL's file, which is not part of this project).
``--tune`` first sweeps candidate tilings for d in {2048, 4096, 5120, 8192, 12288} and records
them in ``dejavu_lab/kernels/tuned/tuning_threshold_gemv.json`` (read at run time by
:mod:`dejavu_lab.kernels.tuning`). Writes ``results/threshold_gemv.json``.

    PYTHONPATH=. python kernels/bench_threshold_gemv.py [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from dejavu_lab import results
from dejavu_lab.bench.timing import copy_ceiling, graph_us, relerr
from dejavu_lab.kernels import threshold_gemv, threshold_gemv_ref, tuning
from dejavu_lab.kernels.threshold.gemv import default_config

SHAPES = [  # (name, d_in, d_out): the weight is w_t [d_in, d_out]
    ("llama2-7b down", 11008, 4096),
    ("llama2-13b down", 13824, 5120),
    ("llama3-8b down", 14336, 4096),
    ("llama2-7b up", 4096, 11008),
    ("llama2-13b up", 5120, 13824),
    ("llama3-8b up", 4096, 14336),
]
HIDDEN = {
    2048: 8192,
    4096: 11008,
    5120: 13824,
    8192: 28672,
    12288: 49152,
}  # Llama-3.2-1B .. OPT-175B
TUNE_SHAPES = sorted(
    {(n, d) for d, n in HIDDEN.items()}
    | {(d, n) for d, n in HIDDEN.items()}
    | {(d_in, d_out) for _, d_in, d_out in SHAPES}
)
KEPT = [0.5, 0.2, 0.1]
BATCHES = [1, 16]
# the engine's TEAL/WINA sites at batch 1 (W^T [d_in, d_out]): q/k/v input, o input, the
# gate/up input (one launch over both), down input; Llama-2-13B and Llama-3-8B (GQA)
ENGINE_SHAPES = [(5120, 15360), (5120, 5120), (5120, 27648), (13824, 5120),
                 (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # fmt: skip
ENGINE_KEPT = [0.5, 0.6]  # TEAL at 50% and 40% sparsity
TEAL_US = {0.5: 17.7, 0.2: 15.4, 0.1: 14.8}  # TEAL's kernel, 11008->4096, batch 1
TEAL_DENSE_US = 25.4


def _cfg(r, d, w, pps, **kw):
    return {"BLOCK_R": r, "BLOCK_D": d, "num_warps": w, "programs_per_sm": pps, **kw}


CANDIDATES = {  # swept by --tune; every one computes the same function (checked first)
    1: [  # compacted rows, FMAs; prefetch 2 = weights double-buffered
        _cfg(32, 128, 4, 4, prefetch=1),
        _cfg(32, 128, 4, 8, prefetch=1),
        _cfg(32, 128, 4, 8, prefetch=2),
        _cfg(16, 256, 4, 8, prefetch=2),
        _cfg(32, 256, 4, 4, prefetch=2),
        _cfg(32, 128, 4, 8, prefetch=2, reduce="atomic"),
        _cfg(32, 128, 2, 16, prefetch=2),
        _cfg(64, 256, 8, 1, prefetch=1, dot=True, num_stages=4, reduce="atomic"),
    ],
    16: [  # masked row tiles (x read coalesced) or compacted rows; tl.dot, pipelined loads
        _cfg(64, 128, 4, 2, compact=False, num_stages=4),
        _cfg(32, 128, 4, 4, compact=False, num_stages=3),
        _cfg(64, 256, 8, 1, compact=False, num_stages=4),
        _cfg(64, 128, 4, 1, compact=False, num_stages=4, reduce="atomic"),
        _cfg(64, 128, 4, 2, num_stages=4, reduce="atomic"),
        _cfg(32, 128, 4, 1, num_stages=3),
    ],
}


def _tile(r, d, w):
    return {"mode": "tile", "BLOCK_R": r, "BLOCK_D": d, "num_warps": w}


ENGINE_CANDIDATES = [  # --tune-engine: the batch-1 tile kernel's grid, one compacting config
    _tile(r, d, w)
    for r, d, w in [(128, 64, 2), (64, 128, 2), (256, 64, 2), (128, 128, 2), (64, 64, 2),
                    (128, 64, 1), (64, 128, 1), (128, 32, 1), (256, 32, 2), (32, 128, 2)]
] + [_cfg(32, 128, 4, 8, prefetch=1, mode="compact")]  # fmt: skip
CANDIDATES[1] += [_tile(128, 64, 2), _tile(64, 128, 2), _tile(256, 64, 2)]
UNION_TILE = {"BLOCK_R": 64, "BLOCK_D": 64, "num_warps": 4}  # the union-batch tile, untuned
CANDIDATES[16] += [_tile(64, 64, 4), _tile(128, 64, 4), _tile(64, 128, 4)]
for _c in CANDIDATES[1] + CANDIDATES[16] + ENGINE_CANDIDATES:
    if _c.get("mode") == "tile":
        continue
    _c.setdefault("mode", "compact")
    _c.setdefault("reduce", "serial")
    _c.setdefault("compact", True)
    _c.setdefault("prefetch", 1)


L2_ROTATE_BYTES = 4 * 60e6  # every timed call reads weights that are not in the 60 MB L2
MAX_BYTES = 6e9


class GemvCase:
    """Weight copies [copies, d_in, d_out] and, per copy, tokens whose kept set is exactly
    ``kept`` of the columns (the same set for every token: the union is the kept fraction).

    >>> case = GemvCase(64, 32, device="cpu")
    >>> case.copies, case.check(0.25, 2) < 1e-2
    (64, True)
    """

    def __init__(self, d_in, d_out, *, dtype=torch.float16, min_kept=0.1, device=None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.d_in, self.d_out, self.dtype = d_in, d_out, dtype
        full = d_in * d_out * 2
        want = math.ceil(L2_ROTATE_BYTES / (min_kept * full))
        self.copies = max(1, min(want, int(MAX_BYTES // full), 64))
        self.w = torch.randn(self.copies, d_in, d_out, dtype=dtype, device=self.device)
        self.w.mul_(d_in**-0.5)
        self.thr = torch.ones(d_in, device=self.device)  # TEAL: one threshold per site

    def inputs(self, kept, batch):
        k = round(kept * self.d_in)
        xs = []
        for _ in range(self.copies):
            x = torch.rand(batch, self.d_in, device=self.device) * 1.8 - 0.9  # |x| < thr: dropped
            keep = torch.randperm(self.d_in, device=self.device)[:k]
            big = torch.rand(batch, k, device=self.device) + 1.1
            x[:, keep] = big * torch.sign(torch.randn(batch, k, device=self.device))
            xs.append(x.to(self.dtype))
        return k, xs

    def calls(self, kept, batch, config=None, masked=False):
        k, xs = self.inputs(kept, batch)
        outs = [torch.empty(batch, self.d_out, dtype=self.dtype, device=self.device) for _ in xs]
        xk = [x[:, :k].contiguous() for x in xs]
        w, thr = self.w, self.thr
        no_compaction = {"mode": "compact", "compact": False} if masked else {}
        cfg = {**(config or {}), **no_compaction} or None
        return k, {
            "dense": [lambda c=c: torch.mm(xs[c], w[c]) for c in range(self.copies)],
            "contig": [lambda c=c: torch.mm(xk[c], w[c, :k]) for c in range(self.copies)],
            "ours": [
                lambda c=c: threshold_gemv(xs[c], w[c], thr, out=outs[c], config=cfg)
                for c in range(self.copies)
            ],
        }

    def check(self, kept, batch, config=None):
        _, xs = self.inputs(kept, batch)
        got = threshold_gemv(xs[0], self.w[0], self.thr, config=config)
        if got.isnan().any():
            return float("inf")
        return relerr(got, threshold_gemv_ref(xs[0], self.w[0], self.thr))


def nbytes(k, d_in, d_out, batch):
    """Bytes that must move: the kept rows, the tokens and thresholds, the outputs."""
    return k * d_out * 2 + batch * d_in * 2 + d_in * 4 + batch * d_out * 2


def tune(shapes, command, *, name="tuning_threshold_gemv", batches=None, kepts=None,
         candidates=None):  # fmt: skip
    rows = []
    for d_in, d_out in shapes:
        case = GemvCase(d_in, d_out, min_kept=min(kepts or KEPT))
        for batch in batches or BATCHES:
            for kept in kepts or KEPT:
                k, calls = case.calls(kept, batch)
                base = {"op": "threshold_gemv", "d_in": d_in, "d_out": d_out, "kept": kept,
                        "k": k, "batch": batch}  # fmt: skip
                dense = graph_us(calls["dense"])
                best = None
                for cfg in (candidates or CANDIDATES)[batch]:
                    _, c2 = case.calls(kept, batch, cfg)
                    try:
                        err = case.check(kept, batch, cfg)
                        if not err < 5e-3:  # a wrong candidate is never recorded
                            print(f"  {cfg}: WRONG, relative error {err:.2e}")
                            continue
                        us = graph_us(c2["ours"])
                    except Exception as exc:  # a candidate that fails to compile is skipped
                        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    rows.append({**base, "config": cfg, "us": us, "dense_us": dense,
                                 "frac_ideal": dense * kept / us})  # fmt: skip
                    best = us if best is None else min(best, us)
                print(f"tune {d_in:6d}->{d_out:6d} B={batch:2d} kept={kept:.2f}: dense {dense:7.1f} "
                      f"best {best or math.nan:7.1f} us = {dense * kept / (best or math.nan):.2f} of ideal", flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()
    path = results.save(name, rows, command=command, folder=tuning.TUNED_DIR)
    tuning.reload()
    print(f"wrote {path}")
    return rows


def check_correctness():
    worst = 0.0
    for _, d_in, d_out in SHAPES[:1] + SHAPES[3:4]:
        case = GemvCase(d_in, d_out, min_kept=0.5)
        for batch in (1, 16, 32):
            for kept in (0.1, 0.5):
                err = case.check(kept, batch)
                worst = max(worst, err)
                if not err < 5e-3:
                    print(f"WRONG: {d_in}->{d_out} B={batch} kept={kept}: error {err:.2e}")
    small = GemvCase(1024, 768, dtype=torch.bfloat16, min_kept=0.5)
    for batch in (1, 8):
        err = small.check(0.3, batch)
        assert err < 2e-2, f"bf16 batch={batch}: relative error {err:.2e}"
    print(f"correctness: worst fp16 relative error {worst:.2e} (bf16 checked too)")


def table(shapes, batches, ceiling):
    rows = []
    for name, d_in, d_out in shapes:
        case = GemvCase(d_in, d_out, min_kept=min(KEPT))
        for batch in batches:
            dense = None
            for kept in KEPT:
                k, calls = case.calls(kept, batch)
                dense = dense or graph_us(calls["dense"])
                t = {p: graph_us(calls[p]) for p in ("contig", "ours")}
                if batch == 1:  # the compacting kernel, and its masked-tile mode
                    t["masked"] = graph_us(case.calls(kept, batch, masked=True)[1]["ours"])
                    compact = {"mode": "compact"}
                    t["compact"] = graph_us(case.calls(kept, batch, config=compact)[1]["ours"])
                else:  # the tile kernel's union-batch form (opt-in until it is the faster one)
                    tile = {"mode": "tile", **UNION_TILE}
                    t["tile"] = graph_us(case.calls(kept, batch, config=tile)[1]["ours"])
                nb = nbytes(k, d_in, d_out, batch)
                # what the wrapper picks (it cannot know the kept fraction: kept=None)
                cfg = default_config(batch, d_in, d_out, device=case.device)
                row = {"shape": name, "d_in": d_in, "d_out": d_out, "kept": kept, "k": k,
                       "batch": batch, "dense_us": dense, "bytes": nb, "config": cfg,
                       **{f"{p}_us": v for p, v in t.items()},
                       "frac_ideal": dense * kept / t["ours"], "vs_contig": t["contig"] / t["ours"],
                       "ours_tbps": nb / (t["ours"] * 1e-6) / 1e12, "copy_tbps": ceiling}  # fmt: skip
                if (d_in, d_out) == (11008, 4096) and batch == 1:
                    row.update(teal_us=TEAL_US[kept], vs_teal=TEAL_US[kept] / t["ours"])
                rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def print_table(rows):
    print(f"\n{'shape':16s} {'B':>2s} {'kept':>4s} | {'dense':>6s} {'contig':>6s} {'masked':>6s} "
          f"{'compact':>7s} {'tile':>6s} {'ours':>6s} us | frac ideal | vs contig | TB/s | vs TEAL")  # fmt: skip
    for r in rows:
        masked = r.get("masked_us", float("nan"))
        compact = r.get("compact_us", float("nan"))
        tile = r.get("tile_us", float("nan"))
        teal = f"{r['vs_teal']:.2f}x" if "vs_teal" in r else ""
        print(f"{r['shape']:16s} {r['batch']:2d} {r['kept']:4.2f} | {r['dense_us']:6.1f} "
              f"{r['contig_us']:6.1f} {masked:6.1f} {compact:7.1f} {tile:6.1f} {r['ours_us']:6.1f}    | {r['frac_ideal']:10.2f} "
              f"| {r['vs_contig']:9.2f} | {r['ours_tbps']:4.2f} | {teal}")  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tune",
        action="store_true",
        help="sweep tilings first (dejavu_lab/kernels/tuned/tuning_*.json)",
    )
    ap.add_argument("--tune-engine", action="store_true",
                    help="sweep a wider batch-1 grid at the engine's TEAL shapes only "
                    "(dejavu_lab/kernels/tuned/tuning_threshold_gemv_engine.json), then stop")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_threshold_gemv.py " + " ".join(argv or sys.argv[1:])
    global SHAPES, KEPT, BATCHES
    if args.quick:
        SHAPES, KEPT, BATCHES = [("tiny", 96, 64)], [0.5, 0.1], [1, 4]
        print_table(table(SHAPES, BATCHES, float("nan")))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_threshold_gemv needs a CUDA GPU (use --quick for a CPU check).")
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    check_correctness()
    if args.tune_engine:
        tune(ENGINE_SHAPES, command, name="tuning_threshold_gemv_engine", batches=[1],
             kepts=ENGINE_KEPT, candidates={1: ENGINE_CANDIDATES})  # fmt: skip
        return
    if args.tune:
        tune(TUNE_SHAPES, command)
    rows = table(SHAPES, BATCHES, ceiling)
    print_table(rows)
    path = results.save("threshold_gemv", rows, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
