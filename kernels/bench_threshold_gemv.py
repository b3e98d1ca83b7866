"""TEAL/WINA threshold GEMV vs dense cuBLAS, cuBLAS on the kept rows made contiguous, and TEAL.

TEAL (Liu et al. 2024, §4) reads only the weight columns whose input entry survives
``|x| > thr``; :func:`dejavu_lab.kernels.threshold_gemv` computes that mask inside the kernel.
For the Llama MLP shapes (down_proj 11008->4096, 13824->5120, 14336->4096 and the gate/up
direction) at 50 / 20 / 10% kept, batch 1 and a union batch of 16 (tokens sharing one kept
set), this times in CUDA-graph replay, on weights rotated through more than 4x the L2:

- ``dense``: cuBLAS ``x @ w_t`` over every row (ideal sparse time = dense x kept);
- ``contig``: cuBLAS over the same number of rows stored contiguously (a gather-free layout);
- ``masked`` (batch 1): TEAL's scheme in our kernel: one masked row tile per program, fp32
  atomics (``TEAL_LIKE``);
- ``ours``: the threshold GEMV as the wrapper picks it without a hint (the tuned config best on
  average over the kept fractions); ``hinted``: with ``kept=`` the budget (its tuned config).

bf16 rows repeat two shapes at batch 1.

TEAL's own split-K kernel, measured on this H200 for issue 11 (fp16, batch 1, graph replay,
11008->4096): 17.7 / 15.4 / 14.8 µs at 50 / 20 / 10% kept against a 25.4 µs dense GEMV.
``--tune`` first sweeps candidate tilings for d in {2048, 4096, 5120, 8192, 12288} and records
them in ``results/tuning_threshold_gemv.json`` (read at run time by
:mod:`dejavu_lab.kernels.tuning`). Writes ``results/threshold_gemv.json``.

    PYTHONPATH=. python kernels/bench_threshold_gemv.py [--tune [--tune-d 2048 8192]] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from dejavu_lab import results
from dejavu_lab.kernels import threshold_gemv, threshold_gemv_ref, tuning
from dejavu_lab.kernels.bench import (
    copy_ceiling,
    graph_us,
    print_rows,
    relerr,
    rotation_copies,
    sweep,
)

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
KEPT = [0.5, 0.2, 0.1]
BATCHES = [1, 16]
TEAL_US = {0.5: 17.7, 0.2: 15.4, 0.1: 14.8}  # issue 11: TEAL's kernel, 11008->4096, batch 1
TEAL_DENSE_US = 25.4


def _cfg(r, d, w, pps, pf, **kw):
    return {"BLOCK_R": r, "BLOCK_D": d, "num_warps": w, "programs_per_sm": pps, "prefetch": pf,
            **kw}  # fmt: skip


C, M, A1, AT = {"compact": True}, {"compact": False}, {"acc2d": False}, {"reduce": "atomic"}
TILE = 10**4  # programs per SM: as many as there are row tiles, one tile per program (TEAL's grid)
CANDIDATES = {  # swept by --tune; every one computes the same function (checked first)
    1: [  # FMAs over compacted rows (C) or masked row tiles (M); prefetch 2: next tile in flight
        _cfg(128, 128, 4, 4, 1, **C, **A1),
        _cfg(32, 128, 4, 4, 1, **C),
        _cfg(128, 128, 4, 2, 2, **C, **A1),
        _cfg(64, 128, 4, 12, 1, **C, **A1),
        _cfg(32, 128, 4, 16, 1, **C, **AT),
        _cfg(64, 128, 4, 8, 1, **C, **A1, **AT),
        _cfg(128, 128, 4, 4, 1, **C, **A1, **AT),
        _cfg(64, 128, 4, TILE, 0, **M, **A1, **AT),
        _cfg(128, 128, 4, TILE, 0, **M, **A1, **AT),
        _cfg(64, 256, 8, TILE, 0, **M, **A1, **AT),
        _cfg(128, 256, 8, TILE, 0, **M, **A1, **AT),
        _cfg(32, 256, 4, TILE, 0, **M, **AT),
    ],
    16: [  # tl.dot over compacted rows, Triton-pipelined loads (serial reduction only)
        _cfg(32, 128, 4, 2, 1, num_stages=3, **C),
        _cfg(64, 256, 8, 2, 1, num_stages=3, **C),
        _cfg(64, 128, 4, 8, 1, num_stages=3, **C),
        _cfg(128, 128, 4, 4, 1, num_stages=3, **C),
    ],
}
for _c in CANDIDATES[1] + CANDIDATES[16]:
    _c.setdefault("reduce", "serial")


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
        self.copies = rotation_copies(min_kept * full, full)
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

    def calls(self, kept, batch, config=None, hint=None):
        """{'dense', 'contig', 'ours'} -> one call per weight copy (``hint``: the kept hint)."""
        k, xs = self.inputs(kept, batch)
        outs = [torch.empty(batch, self.d_out, dtype=self.dtype, device=self.device) for _ in xs]
        xk = [x[:, :k].contiguous() for x in xs]
        w, thr = self.w, self.thr
        return k, {
            "dense": [lambda c=c: torch.mm(xs[c], w[c]) for c in range(self.copies)],
            "contig": [lambda c=c: torch.mm(xk[c], w[c, :k]) for c in range(self.copies)],
            "ours": [
                lambda c=c: threshold_gemv(xs[c], w[c], thr, out=outs[c], kept=hint, config=config)
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


def tune(shapes, command):
    rows = []
    for d_in, d_out in shapes:
        case = GemvCase(d_in, d_out, min_kept=min(KEPT))
        for batch in BATCHES:
            for kept in KEPT:
                k, calls = case.calls(kept, batch)
                dense = graph_us(calls["dense"])
                point = (case, kept, batch)
                timed = sweep(CANDIDATES[batch], lambda cfg, p=point: p[0].check(*p[1:], cfg),
                              lambda cfg, p=point: graph_us(p[0].calls(*p[1:], cfg)[1]["ours"]))  # fmt: skip
                for cfg, us in timed:
                    rows.append({"op": "threshold_gemv", "d_in": d_in, "d_out": d_out,
                                 "kept": kept, "k": k, "batch": batch, "config": cfg, "us": us,
                                 "dense_us": dense, "frac_ideal": dense * kept / us})  # fmt: skip
                best = min((us for _, us in timed), default=math.nan)
                print(f"tune {d_in:6d}->{d_out:6d} B={batch:2d} kept={kept:.2f}: dense {dense:7.1f} "
                      f"best {best:7.1f} us = {dense * kept / best:.2f} of ideal", flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()
    path = results.save("tuning_threshold_gemv", rows, command=command)
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


TEAL_LIKE = _cfg(64, 128, 4, TILE, 0, **M, **A1, **AT)  # TEAL's scheme in our kernel


def table(shapes, batches, ceiling, dtype=torch.float16):
    rows = []
    for name, d_in, d_out in shapes:
        case = GemvCase(d_in, d_out, min_kept=min(KEPT), dtype=dtype)
        for batch in batches:
            dense = None
            for kept in KEPT:
                k, calls = case.calls(kept, batch)
                dense = dense or graph_us(calls["dense"])
                t = {p: graph_us(calls[p]) for p in ("contig", "ours")}  # ours: no kept hint
                t["hinted"] = graph_us(case.calls(kept, batch, hint=kept)[1]["ours"])
                if batch == 1:  # masked loads of one row tile per program, fp32 atomics
                    t["masked"] = graph_us(case.calls(kept, batch, TEAL_LIKE)[1]["ours"])
                nb = nbytes(k, d_in, d_out, batch)
                # what the wrapper picks without a hint (kept=None) and with one
                cfg = tuning.lookup("threshold_gemv", d_in, d_out, None, batch, case.device)
                cfg_k = tuning.lookup("threshold_gemv", d_in, d_out, kept, batch, case.device)
                row = {"shape": name, "dtype": str(dtype).split(".")[-1], "d_in": d_in,
                       "d_out": d_out, "kept": kept, "k": k,
                       "batch": batch, "dense_us": dense, "bytes": nb, "config": cfg,
                       "hinted_config": cfg_k, **{f"{p}_us": v for p, v in t.items()},
                       "frac_ideal": dense * kept / t["ours"],
                       "frac_ideal_hinted": dense * kept / t["hinted"],
                       "vs_contig": t["contig"] / t["ours"],
                       "ours_tbps": nb / (t["ours"] * 1e-6) / 1e12, "copy_tbps": ceiling}  # fmt: skip
                if (d_in, d_out) == (11008, 4096) and batch == 1 and dtype == torch.float16:
                    row.update(teal_us=TEAL_US[kept], vs_teal=TEAL_US[kept] / t["ours"])
                rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


COLUMNS = [("shape", "shape", "16s"), ("dtype", "dtype", "8s"), ("B", "batch", "2d"),
           ("kept", "kept", "4.2f"),
           ("dense", "dense_us", "6.1f"), ("contig", "contig_us", "6.1f"),
           ("masked", "masked_us", "6.1f"), ("ours", "ours_us", "6.1f"),
           ("hinted", "hinted_us", "6.1f"), ("frac", "frac_ideal", "5.2f"),
           ("frac_h", "frac_ideal_hinted", "6.2f"), ("vs_contig", "vs_contig", "9.2f"),
           ("TB/s", "ours_tbps", "5.2f"), ("TEAL", "teal_us", "5.1f"),
           ("vs_TEAL", "vs_teal", "7.2f")]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tune", action="store_true", help="sweep tilings first (results/tuning_*.json)"
    )
    ap.add_argument("--tune-d", type=int, nargs="*", default=sorted(HIDDEN),
                    help="model widths of HIDDEN to tune at, beside the Llama shapes")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_threshold_gemv.py " + " ".join(argv or sys.argv[1:])
    global SHAPES, KEPT, BATCHES
    if args.quick:
        SHAPES, KEPT, BATCHES = [("tiny", 96, 64)], [0.5, 0.1], [1, 4]
        print_rows(table(SHAPES, BATCHES, float("nan")), COLUMNS)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_threshold_gemv needs a CUDA GPU (use --quick for a CPU check).")
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    check_correctness()
    if args.tune:
        tune(sorted({s[1:] for s in SHAPES} | {(a, b) for d in args.tune_d for a, b in
                                              ((d, HIDDEN[d]), (HIDDEN[d], d))}), command)  # fmt: skip
    rows = table(SHAPES, BATCHES, ceiling)
    rows += table([SHAPES[0], SHAPES[3]], [1], ceiling, dtype=torch.bfloat16)
    print_rows(rows, COLUMNS)
    path = results.save("threshold_gemv", rows, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
