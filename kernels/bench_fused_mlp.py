"""Fused sparse MLP and CATS vs dense cuBLAS, contiguous cuBLAS and the two-kernel path.

Deja Vu §4.4 runs a sparse MLP as an up gather then a down gather:
:func:`dejavu_lab.kernels.fused_sparse_mlp` reads the kept neurons' gate and up rows in one pass
and applies the activation in one launch, then reduces their down rows in a second (a
one-launch atomic variant is slower, and wrong with tensor-core tiles: see
:mod:`dejavu_lab.kernels.mlp.fused`). :func:`~dejavu_lab.kernels.cats_mlp`
is CATS (cuBLAS dense gate, then the up and down rows of the kept neurons only). For Llama SwiGLU
shapes (d, n) = (4096, 11008), (5120, 13824), (4096, 14336) plus d = 2048, 8192 and OPT-175B's
ReLU MLP (12288, 49152), at 50 / 20 / 10% kept, batch 1 and a union batch of 16, in CUDA-graph
replay on weights rotated through more than 4x the L2:

- ``dense``: cuBLAS gate/up GEMV, activation, cuBLAS down GEMV (every neuron);
- ``contig``: the same on the kept neurons' rows stored contiguously (gather-free layout);
- ``two``: our ``sparse_mlp_up`` then ``sparse_mlp_down`` (two launches over ``idx``);
- ``ours``: the fused kernel; ``cats``: CATS with a threshold keeping the same fraction;
  ``cats_fg``: CATS's one-kernel path (gate and masked up rows in one Triton kernel).

Target: at 10% kept the fused MLP within 1.3x of (bytes / copy ceiling) + 3 µs.
``--tune`` sweeps tilings first (``dejavu_lab/kernels/tuned/tuning_fused_mlp.json``, read at run time; CATS's
rows are the up kernel's and its down GEMV's, op ``cats_up``).
Writes ``results/sparse_mlp_fused.json``.

    PYTHONPATH=. python kernels/bench_fused_mlp.py [--tune] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from dejavu_lab import results
from dejavu_lab.bench.timing import (
    copy_ceiling,
    graph_us,
    print_rows,
    relerr,
    rotation_copies,
    sweep,
)
from dejavu_lab.kernels import (
    cats_mlp,
    cats_mlp_ref,
    fused_sparse_mlp,
    fused_sparse_mlp_ref,
    sparse_mlp_down,
    sparse_mlp_up,
    tuning,
)

SHAPES = [  # (name, d, n, gated, activation)
    ("llama3.2-1b", 2048, 8192, True, "silu"),
    ("llama2-7b", 4096, 11008, True, "silu"),
    ("llama3-8b", 4096, 14336, True, "silu"),
    ("llama2-13b", 5120, 13824, True, "silu"),
    ("llama3-70b", 8192, 28672, True, "silu"),
    ("opt-175b", 12288, 49152, False, "relu"),
]
KEPT = [0.5, 0.2, 0.1]
BATCHES = [1, 16]


def _cfg(n, k, c, w, **kw):
    return {"BLOCK_N": n, "BLOCK_K": k, "BLOCK_C": c, "num_warps": w, **kw}


CANDIDATES = {  # (op, batch 1?) -> configs swept by --tune (each checked first)
    ("fused", True): [
        _cfg(8, 1024, 1024, 8),
        _cfg(4, 1024, 1024, 4),
        _cfg(16, 512, 512, 8),
        _cfg(4, 2048, 2048, 8),
        _cfg(16, 128, 128, 4, dot=True, num_stages=4),
    ],
    ("fused", False): [
        _cfg(16, 128, 128, 4, num_stages=3),
        _cfg(32, 128, 128, 4, num_stages=3),
    ],
    ("cats", True): [  # the up kernel's tiles and the down GEMV's (dejavu_lab.kernels.cats.up)
        {
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "num_warps": 4,
            "num_stages": s,
            "dot": True,
            "down": {"BLOCK_R": 16, "prefetch": 2, "programs_per_sm": 8, "num_warps": w},
        }
        for s in (4, 5)
        for w in (2, 4)
    ]
    + [
        {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "dot": True},
        {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4},
    ],
    ("cats", False): [
        {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    ],
}


class MlpWeights:
    """Weight copies of one MLP: w_in [copies, 2n or n, d], w_down_t [copies, n, d].

    >>> m = MlpWeights(32, 64, True, "silu", device="cpu")
    >>> m.copies, m.check("ours", 0.25, 2) < 1e-2, m.check("cats", 0.25, 1) < 1e-2
    (64, True, True)
    """

    def __init__(self, d, n, gated, act, *, dtype=torch.float16, min_kept=0.1, device=None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.d, self.n, self.gated, self.act, self.dtype = d, n, gated, act, dtype
        full = (3 if gated else 2) * n * d * 2
        self.copies = rotation_copies(min_kept * full, full)
        dev = self.device
        self.w_in = torch.randn(self.copies, (2 if gated else 1) * n, d, dtype=dtype, device=dev)
        self.w_in.mul_(d**-0.5)
        self.w_down_t = torch.randn(self.copies, n, d, dtype=dtype, device=dev).mul_(n**-0.5)

    def _act(self, z):
        return F.silu(z) if self.act == "silu" else torch.relu(z)

    def inputs(self, kept, batch):
        k = round(kept * self.n)
        x0 = torch.randn(self.copies, self.d, dtype=self.dtype, device=self.device)
        xs = [x0[c].expand(batch, self.d).contiguous() for c in range(self.copies)]
        idx = [torch.randperm(self.n, device=self.device)[:k].to(torch.int32) for _ in xs]
        thr = []  # CATS: |act(gate)| above this keeps ~kept of the neurons
        for c in range(self.copies):
            a = self._act(x0[c].float() @ self.w_in[c, : self.n].float().T).abs()
            thr.append(
                torch.full((self.n,), float(torch.quantile(a, 1 - kept)), device=self.device)
            )
        return k, xs, idx, thr

    def calls(self, kept, batch, config=None, cats_config=None):
        k, xs, idx, thr = self.inputs(kept, batch)
        n, gated, act = self.n, self.gated, self.act
        w_in, w_dt = self.w_in, self.w_down_t
        out = [torch.empty(batch, self.d, dtype=self.dtype, device=self.device) for _ in xs]
        cs = range(self.copies)

        def mlp(x, w, wd, kk):
            if gated:
                return (self._act(F.linear(x, w[:kk])) * F.linear(x, w[n : n + kk])) @ wd[:kk]
            return self._act(F.linear(x, w[:kk])) @ wd[:kk]

        def two(c):
            up = dict(up_weight=w_in[c, n:]) if gated else {}
            h = sparse_mlp_up(xs[c], w_in[c, :n], idx[c], activation=act, validate=False, **up)
            return sparse_mlp_down(h, w_dt[c], idx[c], validate=False, out=out[c])

        return k, {
            "dense": [lambda c=c: mlp(xs[c], w_in[c], w_dt[c], n) for c in cs],
            "contig": [lambda c=c: mlp(xs[c], w_in[c], w_dt[c], k) for c in cs],
            "two": [lambda c=c: two(c) for c in cs],
            "ours": [
                lambda c=c: fused_sparse_mlp(
                    xs[c],
                    w_in[c],
                    w_dt[c],
                    idx[c],
                    activation=act,
                    gated=gated,
                    out=out[c],
                    validate=False,
                    config=config,
                )  # fmt: skip
                for c in cs
            ],
            "cats": [
                lambda c=c: cats_mlp(
                    xs[c], w_in[c], w_dt[c], thr[c], activation=act, out=out[c], config=cats_config
                )  # fmt: skip
                for c in cs
            ],
            "cats_fg": [
                lambda c=c: cats_mlp(
                    xs[c],
                    w_in[c],
                    w_dt[c],
                    thr[c],
                    activation=act,
                    out=out[c],
                    config={"fused_gate": True},
                )  # fmt: skip
                for c in cs
            ],
        }

    def check(self, provider, kept, batch, config=None):
        _, xs, idx, thr = self.inputs(kept, batch)
        x, w, wd = xs[0], self.w_in[0], self.w_down_t[0]
        if provider in ("cats", "cats_fg"):
            config = {**(config or {}), "fused_gate": provider == "cats_fg"}
            got = cats_mlp(x, w, wd, thr[0], activation=self.act, config=config)
            ref = cats_mlp_ref(x, w, wd, thr[0], activation=self.act)
        else:
            kw = dict(activation=self.act, gated=self.gated)
            got = fused_sparse_mlp(x, w, wd, idx[0], config=config, **kw)
            ref = fused_sparse_mlp_ref(x, w, wd, idx[0], **kw)
        return float("inf") if got.isnan().any() else relerr(got, ref)

    def nbytes(self, k, batch, cats=False):
        mats = 2 if self.gated else 1
        rows = (self.n + mats * k) if cats else (mats + 1) * k
        return rows * self.d * 2 + (0 if cats else 4 * k) + 2 * batch * self.d * 2


def check_correctness():
    worst = 0.0
    for name, d, n, gated, act in SHAPES[1:2] + SHAPES[-1:]:
        m = MlpWeights(d, n, gated, act, min_kept=1.0)
        for batch in (1, 16, 32):
            for p in ("ours", "cats", "cats_fg"):
                for extra in ({}, {"BLOCK_N": 16, "dot": True}):
                    err = m.check(p, 0.1, batch, extra or None)
                    worst = max(worst, err)
                    if not err < 5e-3:
                        print(f"WRONG: {p} {name} B={batch} {extra}: error {err:.2e}")
        del m
    small = MlpWeights(1024, 2816, True, "silu", dtype=torch.bfloat16, min_kept=1.0)
    for batch in (1, 8):
        for p in ("ours", "cats"):
            err = small.check(p, 0.3, batch)
            assert err < 2e-2, f"bf16 {p} batch={batch}: relative error {err:.2e}"
    print(f"correctness: worst fp16 relative error {worst:.2e} (bf16 checked too)")


def tune(command):
    rows = []
    for name, d, n, gated, act in SHAPES:
        m = MlpWeights(d, n, gated, act, min_kept=min(KEPT))
        for batch in BATCHES:
            for kept in KEPT:
                k, calls = m.calls(kept, batch)
                dense = graph_us(calls["dense"])
                for op in ("fused", "cats"):
                    p = "ours" if op == "fused" else "cats"
                    point = (m, kept, batch, p)
                    timed = sweep(CANDIDATES[(op, batch == 1)],
                                  lambda cfg, q=point: q[0].check(q[3], q[1], q[2], cfg),
                                  lambda cfg, q=point: graph_us(q[0].calls(q[1], q[2], cfg, cfg)[1][q[3]]))  # fmt: skip
                    nb = m.nbytes(k, batch, cats=op == "cats")
                    for cfg, us in timed:
                        rows.append({"op": {"fused": "fused_mlp", "cats": "cats_up"}[op],
                                     "shape": name, "d_in": d, "d_out": n,
                                     "kept": kept, "k": k, "batch": batch, "config": cfg,
                                     "us": us, "dense_us": dense, "bytes": nb})  # fmt: skip
                    best = min((us for _, us in timed), default=math.nan)
                    print(f"tune {op:5s} {name:12s} B={batch:2d} kept={kept:.2f}: dense {dense:7.1f}"
                          f" best {best:7.1f} us", flush=True)  # fmt: skip
        del m
        torch.cuda.empty_cache()
    path = results.save("tuning_fused_mlp", rows, command=command, folder=tuning.TUNED_DIR)
    tuning.reload()
    print(f"wrote {path}")


def table(ceiling):
    rows = []
    for name, d, n, gated, act in SHAPES:
        m = MlpWeights(d, n, gated, act, min_kept=min(KEPT))
        for batch in BATCHES:
            dense = None
            for kept in KEPT:
                k, calls = m.calls(kept, batch)
                dense = dense or graph_us(calls["dense"])
                t = {p: graph_us(calls[p]) for p in ("contig", "two", "ours", "cats", "cats_fg")}
                nb, nb_cats = m.nbytes(k, batch), m.nbytes(k, batch, cats=True)
                floor = nb / (ceiling * 1e12) * 1e6 + 3.0
                rows.append({"shape": name, "d": d, "n": n, "gated": gated, "kept": kept, "k": k,
                             "batch": batch, "dense_us": dense, **{f"{p}_us": v for p, v in t.items()},
                             "bytes": nb, "cats_bytes": nb_cats, "frac_ideal": dense * kept / t["ours"],
                             "vs_contig": t["contig"] / t["ours"], "vs_two": t["two"] / t["ours"],
                             "target_us": 1.3 * floor, "vs_target": 1.3 * floor / t["ours"],
                             "ours_tbps": nb / (t["ours"] * 1e-6) / 1e12,
                             "cats_tbps": nb_cats / (t["cats"] * 1e-6) / 1e12,
                             "cats_vs_dense": dense / t["cats"],
                             "copy_tbps": ceiling})  # fmt: skip
        del m
        torch.cuda.empty_cache()
    return rows


COLUMNS = [("shape", "shape", "12s"), ("B", "batch", "2d"), ("kept", "kept", "4.2f"),
           ("dense", "dense_us", "6.1f"), ("contig", "contig_us", "6.1f"), ("two", "two_us", "6.1f"),
           ("ours", "ours_us", "6.1f"), ("cats", "cats_us", "6.1f"), ("cats_fg", "cats_fg_us", "7.1f"),
           ("frac", "frac_ideal", "5.2f"),
           ("vs_contig", "vs_contig", "9.2f"), ("target", "target_us", "6.1f"),
           ("TB/s", "ours_tbps", "5.2f"), ("cats", "cats_tbps", "5.2f")]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tune",
        action="store_true",
        help="sweep tilings first (dejavu_lab/kernels/tuned/tuning_*.json)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes (plumbing check, CPU)")
    args = ap.parse_args(argv)
    command = "python kernels/bench_fused_mlp.py " + " ".join(argv or sys.argv[1:])
    global SHAPES, KEPT, BATCHES
    if args.quick:
        SHAPES, KEPT, BATCHES = [("tiny", 32, 96, True, "silu")], [0.5, 0.1], [1, 4]
        print_rows(table(1.0), COLUMNS)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_mlp needs a CUDA GPU (use --quick for a CPU check).")
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    check_correctness()
    if args.tune:
        tune(command)
    rows = table(ceiling)
    print_rows(rows, COLUMNS)
    path = results.save("sparse_mlp_fused", rows, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
