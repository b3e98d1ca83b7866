"""W4A16 GEMVs on an H200: our dense and threshold int4 kernels beside fp16 and gemlite.

At the Llama MLP shapes (4096->14336, 14336->4096, 5120->13824), for each int4 group size
asked for, in CUDA-graph replay over weights rotated through more than 4x the L2
(:class:`dejavu_lab.bench.int4.Int4Case`):

- fp16: cuBLAS ``x @ w_t`` and our fp16 tile GEMV with every column kept (the reference
  points), and our fp16 threshold GEMV at each kept fraction;
- int4: :func:`dejavu_lab.kernels.int4.int4_gemv` and
  :func:`~dejavu_lab.kernels.int4.int4_threshold_gemv` at 50 / 20% kept, each with the
  fastest of a few tilings (swept first, every candidate checked against the reference;
  ``--no-sweep`` runs the defaults);
- the peer: gemlite's 4-bit GEMV (``gemlite==0.6.0.post2``) on the same codes, when it imports
  (one line says so when it does not);
- the dense int4 kernel alone (``int4_sums``: its fp32 sums left for the next launch, as the
  decode step runs it), batch 1;
- the read floor: one streaming read of as many bytes as the dense int4 GEMV moves
  (:mod:`dejavu_lab.bench.read_floor`), the most any kernel of those bytes could reach; at
  each kept fraction (batch 1) a read of the kept code rows alone (``read_kept``), the
  threshold kernel's own floor; the threshold kernel alone walking kept rows listed
  beforehand (``int4_listed``, as the norm before it lists them in the decode step), and the
  standalone list maker (``lists``).

Each row gives µs per call, its own bytes (int4: codes of the rows read + scales and mins of
the groups touched), the fraction of the copy ceiling those bytes reach, the ratio to fp16
(cuBLAS and ours) and to gemlite, and for the threshold GEMV the fraction of the ideal
(dense int4 time x kept); the dense int4 row also its fraction of the read floor, the
threshold kernel alone its fraction of the kept rows' read. Written to
``results/int4_gemv.json`` with provenance.

    PYTHONPATH=. python kernels/bench_int4.py [--group 32,64,128] [--batch 1,16] [--no-sweep]
    TRITON_INTERPRET=1 python kernels/bench_int4.py --smoke   # tiny shapes, CPU: plumbing only
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from dejavu_lab import results
from dejavu_lab.bench.int4 import Int4Case, gemlite_version
from dejavu_lab.bench.timing import copy_ceiling, cuda, graph_us, print_rows, relerr, sweep
from dejavu_lab.kernels import tuning
from dejavu_lab.kernels.int4 import int4_gemv_ref
from dejavu_lab.kernels.int4.half2 import HALF2
from dejavu_lab.kernels.int4.kernel import default_config
from dejavu_lab.kernels.int4.tile import TILE

SHAPES = [  # (name, d_in, d_out): w_t [d_in, d_out]
    ("llama3-8b up", 4096, 14336),
    ("llama3-8b down", 14336, 4096),
    ("llama2-13b up", 5120, 13824),
]
KEPT = [0.5, 0.2]
N_CALLS = 120  # calls captured per graph (graph_us); --smoke: a few, in the interpreter


def _cfg(r, d, w, pps, **kw):
    return {"BLOCK_R": r, "BLOCK_D": d, "num_warps": w, "programs_per_sm": pps, **kw}


def _half2(rows, sub, d, w, **kw):
    return {"mode": "half2", "ROWS": rows, "SUB": sub, "BLOCK_D": d, "num_warps": w, **kw}


def _tile(r, d, w):
    return {"mode": "tile", "BLOCK_R": r, "BLOCK_D": d, "num_warps": w}


CANDIDATES = {  # swept per shape and group; each computes the same function (checked first)
    1: [
        dict(HALF2),  # half2 decoding (kernels/int4/half2.py), the dense default
        dict(TILE),  # the fp32-decode tile (kernels/int4/tile.py)
        _half2(32, 32, 256, 1),
        _half2(32, 32, 512, 2),
        _half2(128, 16, 1024, 4),
        _half2(64, 32, 1024, 2),  # two and four words per thread: 64- and 128-bit loads
        _half2(32, 32, 1024, 1),
        _half2(64, 32, 1024, 1),
        _half2(64, 32, 2048, 2),
        _half2(128, 16, 512, 2, compact=1),  # threshold: walk a list of the kept rows
        _half2(64, 16, 512, 2, compact=1),
        _half2(128, 8, 512, 2, compact=1),
        _half2(128, 16, 1024, 2, compact=1),
        {**HALF2, "fused": 1},  # the last program of a column tile writes the output
    ],
    16: [
        default_config(16),
        _cfg(32, 128, 4, 4, num_stages=3),
        _cfg(64, 256, 8, 2, num_stages=3),
        _cfg(128, 128, 8, 2, num_stages=2),
        _cfg(64, 128, 4, 2, num_stages=3, unpack=1),
    ],
}
SMOKE_CANDIDATES = [{"BLOCK_R": 32, "BLOCK_D": 32, "num_warps": 4, "programs": 6},
                    {"BLOCK_R": 16, "BLOCK_D": 64, "num_warps": 2, "programs": 4, "unpack": 1}]  # fmt: skip
COLUMNS = [("shape", "shape", "15s"), ("g", "group", "4d"), ("B", "batch", "3d"),
           ("provider", "provider", "10s"), ("kept", "kept", "5.2f"), ("us", "us", "8.1f"),
           ("TB/s", "tbps", "6.2f"), ("ceil", "frac_copy", "5.2f"), ("vs cuBLAS", "vs_cublas", "9.2f"),
           ("vs fp16", "vs_fp16_ours", "8.2f"), ("vs peer", "vs_gemlite", "8.2f"),
           ("ideal", "frac_ideal", "6.2f"), ("of read", "of_read", "7.2f")]  # fmt: skip


def _time(case, provider, kept, batch, config=None):
    try:
        return graph_us(case.calls(provider, kept, batch, config), n_calls=N_CALLS)
    except Exception as exc:  # one failing provider (the peer, say) must not lose the run
        print(f"  {provider}: {type(exc).__name__}: {str(exc)[:300]}")
        return math.nan


def best_configs(case, batch, candidates):
    """{'int4': cfg, 'int4_thr': cfg} and the sweep's rows (one per config and kept fraction,
    in the tuning tables' schema): dense by its time, threshold by its mean time over KEPT."""
    picks, rows = {}, []
    for provider, op in (("int4", "int4_gemv"), ("int4_thr", "int4_threshold_gemv")):
        kepts = [1.0] if provider == "int4" else KEPT
        points = {}

        def time_us(cfg, provider=provider, kepts=kepts, points=points):
            us = [graph_us(case.calls(provider, k, batch, cfg), n_calls=N_CALLS) for k in kepts]
            points[json.dumps(cfg, sort_keys=True)] = us
            return sum(us) / len(us)

        timed = sweep(candidates, lambda cfg: case.check(0.5, batch, cfg), time_us)
        for cfg, _ in timed:
            for kept, us in zip(kepts, points[json.dumps(cfg, sort_keys=True)], strict=True):
                rows.append({"kind": "sweep", "op": f"{op}_g{case.group}", "provider": provider,
                             "d_in": case.d_in, "d_out": case.d_out, "batch": batch,
                             "kept": kept, "config": cfg, "us": us})  # fmt: skip
        picks[provider] = min(timed, key=lambda t: t[1])[0] if timed else default_config(batch)
    return picks, rows


def measure(name, case, batch, picks, ceiling, peer):
    base = {"kind": "time", "shape": name, "d_in": case.d_in, "d_out": case.d_out,
            "group": case.group, "batch": batch, "copies": list(case.copies)}  # fmt: skip
    t = {p: _time(case, p, 1.0, batch) for p in ("cublas", "fp16_ours")}
    t["int4"] = _time(case, "int4", 1.0, batch, picks["int4"])
    t["read"] = _time(case, "read", 1.0, batch)
    if batch == 1:  # the kernel alone, as the decode step runs it (sums for the next launch)
        t["int4_sums"] = _time(case, "int4_sums", 1.0, batch)  # the tuned config, as the step
    if peer:
        t["gemlite"] = _time(case, "gemlite", 1.0, batch)
    rows = []

    def row(provider, kept, us, nbytes, **extra):
        tbps = nbytes / (us * 1e-6) / 1e12
        r = {**base, "provider": provider, "kept": kept, "us": us, "bytes": nbytes,
             "tbps": tbps, "frac_copy": tbps / ceiling, **extra}  # fmt: skip
        rows.append(r)
        return r

    b16, b4 = case.fp16_bytes(1.0, batch), case.int4_bytes(1.0, batch)
    row("cublas", 1.0, t["cublas"], b16)
    row("fp16_ours", 1.0, t["fp16_ours"], b16, vs_cublas=t["cublas"] / t["fp16_ours"])
    if peer:
        row("gemlite", 1.0, t["gemlite"], b4, vs_cublas=t["cublas"] / t["gemlite"])
    ratios = {"vs_cublas": t["cublas"] / t["int4"], "vs_fp16_ours": t["fp16_ours"] / t["int4"]}
    if peer:
        ratios["vs_gemlite"] = t["gemlite"] / t["int4"]
    row("read", 1.0, t["read"], b4)  # the read floor of int4's bytes
    row("int4", 1.0, t["int4"], b4, config=picks["int4"], of_read=t["read"] / t["int4"], **ratios)
    if batch == 1:
        row("int4_sums", 1.0, t["int4_sums"], b4, of_read=t["read"] / t["int4_sums"])
    for kept in KEPT:
        us = _time(case, "int4_thr", kept, batch, picks["int4_thr"])
        f16 = _time(case, "fp16_thr", kept, batch)
        row("fp16_thr", kept, f16, case.fp16_bytes(kept, batch), vs_cublas=t["cublas"] / f16,
            frac_ideal=t["fp16_ours"] * kept / f16)  # fmt: skip
        extra = {"vs_gemlite": t["gemlite"] / us} if peer else {}
        row("int4_thr", kept, us, case.int4_bytes(kept, batch), config=picks["int4_thr"],
            vs_cublas=t["cublas"] / us, vs_fp16_ours=f16 / us, frac_ideal=t["int4"] * kept / us,
            **extra)  # fmt: skip
        if batch == 1:  # the threshold kernel alone, against the dense kernel alone
            alone = _time(case, "int4_sums", kept, batch)
            floor = _time(case, "read_kept", kept, batch)  # a read of the kept rows alone
            row("read_kept", kept, floor, case.int4_bytes(kept, batch))
            row("int4_sums", kept, alone, case.int4_bytes(kept, batch),
                frac_ideal=t["int4_sums"] * kept / alone, of_read=floor / alone)  # fmt: skip
            listed = _time(case, "int4_listed", kept, batch)  # its rows listed beforehand
            row("int4_listed", kept, listed, case.int4_bytes(kept, batch),
                frac_ideal=t["int4_sums"] * kept / listed, of_read=floor / listed,
                vs_unlisted=alone / listed)  # fmt: skip
            row("lists", kept, _time(case, "lists", kept, batch), 2 * case.d_in * 2)
    return rows


def check_peer(case, batch):
    x = case.inputs(1.0, batch, 1, seed=2)[0]
    return relerr(case.peer[0](x).view(batch, -1), int4_gemv_ref(x, case.q[0]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="32,64,128", help="int4 group sizes, comma-separated")
    ap.add_argument("--batch", default="1", help="batches (1-32), comma-separated")
    ap.add_argument("--shapes", default="", help="only the shapes whose name contains this")
    ap.add_argument("--no-sweep", action="store_true", help="the default tiles only")
    ap.add_argument("--tune", action="store_true",
                    help="also record the sweep as the kernels' tuning table "
                    "(dejavu_lab/kernels/tuned/tuning_int4_gemv.json)")  # fmt: skip
    ap.add_argument("--tune-name", default="tuning_int4_gemv",
                    help="the tuning table --tune writes (one per GPU model: a table holds one "
                    "GPU's rows, e.g. tuning_int4_gemv_h200)")  # fmt: skip
    ap.add_argument("--no-peer", action="store_true", help="skip gemlite even when it imports")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing)")
    ap.add_argument("--name", default="", help="results file name (default int4_gemv[_smoke])")
    args = ap.parse_args(argv)
    if not args.tune_name.startswith("tuning_"):  # before any GPU time is spent
        raise SystemExit("--tune-name must start with 'tuning_' (the kernels read tuning_*.json).")
    command = "python kernels/bench_int4.py " + " ".join(argv if argv is not None else sys.argv[1:])
    groups = [int(g) for g in args.group.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    shapes = [s for s in SHAPES if args.shapes in s[0]]
    global N_CALLS
    if args.smoke:
        shapes, groups = [("tiny", 128, 64)], [g for g in groups if g <= 64][:1] or [32]
        N_CALLS = 1
    elif not cuda():
        raise SystemExit("bench_int4 needs a CUDA GPU (--smoke checks the plumbing on a CPU).")
    ceiling = copy_ceiling() if cuda() else math.nan
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    version = gemlite_version()
    peer = bool(version) and cuda() and not args.no_peer
    if not peer:
        why = "--no-peer" if args.no_peer else "no GPU" if version else "gemlite does not import"
        print(f"gemlite: skipped ({why}); install gemlite==0.6.0.post2 to time the peer")
    rows = []
    for name, d_in, d_out in shapes:
        for group in groups:
            copies = 1 if args.smoke else 64
            try:
                case = Int4Case(d_in, d_out, group=group, peer=peer, min_kept=min(KEPT),
                                max_copies=copies)  # fmt: skip
            except Exception as exc:  # the peer failed to pack: time ours without it
                print(f"gemlite: {type(exc).__name__}: {str(exc)[:300]}; timing without it")
                case = Int4Case(d_in, d_out, group=group, min_kept=min(KEPT), max_copies=copies)
            with_peer = case.peer is not None
            for batch in batches:
                if with_peer:
                    try:
                        err = check_peer(case, batch)
                        print(f"{name} g={group} B={batch}: gemlite vs our reference {err:.2e}")
                    except Exception as exc:
                        print(f"gemlite: {type(exc).__name__}: {str(exc)[:300]}")
                cands = SMOKE_CANDIDATES if args.smoke else CANDIDATES[1 if batch == 1 else 16]
                if args.no_sweep:
                    cands = cands[:1]
                picks, swept = best_configs(case, batch, cands)
                rows += [{"shape": name, "group": group, **r} for r in swept]
                rows += measure(name, case, batch, picks, ceiling, with_peer)
            del case
            if cuda():
                torch.cuda.empty_cache()
    timed = [r for r in rows if r["kind"] == "time"]
    print()
    print_rows(timed, COLUMNS)
    for name, *_ in shapes:  # the group that runs the dense int4 GEMV fastest, per shape
        mine = [r for r in timed if r["shape"] == name and r["provider"] == "int4"]
        if mine and not args.smoke:
            best = min(mine, key=lambda r: r["us"])
            print(f"{name}: fastest group {best['group']} ({best['us']:.1f} us)")
    if args.tune and not args.smoke:
        swept = [r for r in rows if r["kind"] == "sweep"]
        path = tuning.TUNED_DIR / f"{args.tune_name}.json"
        if path.is_file():  # keep the points this run did not sweep (another group, say)
            new = {(r["op"], r["d_in"], r["d_out"], r["batch"]) for r in swept}
            old = json.loads(path.read_text())["rows"]
            swept = [r for r in old if (r["op"], r["d_in"], r["d_out"], r["batch"]) not in new]
            swept += [r for r in rows if r["kind"] == "sweep"]
        path = results.save(args.tune_name, swept, command=command, folder=tuning.TUNED_DIR)
        tuning.reload()
        print(f"wrote {path}")
    out = args.name or ("int4_gemv_smoke" if args.smoke else "int4_gemv")
    path = results.save(out, rows, command=command,
                        extra={"copy_tbps": ceiling, "gemlite": version if peer else None})  # fmt: skip
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
