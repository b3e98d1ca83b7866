"""End-to-end batch-1 decoding: HF ``generate`` vs our engine, dense and every sparsity method (§5.1).

Deja Vu §5.1: on OPT-175B (8x A100, fp16, batch 1, prompts 128-1024) DejaVu generates tokens
1.8-2.0x faster than FasterTransformer and 4.8-6.0x faster than Hugging Face. Here, on one GPU,
random-weight fp16 models at OPT-6.7B/13B/30B, Llama-2-13B and Llama-3-8B shapes (weights need
not be trained to be timed), batch 1, for each prompt length, the variants of ``--methods``:

- ``hf``     — ``model.generate`` (eager attention, dynamic cache), per token from
  (T(n) - T(1)) / (n - 1), prefill = T(1);
- ``hf_compiled`` — ``model.generate(..., cache_implementation="static")``: the static cache
  makes HF torch.compile its decode step (the strongest HF baseline); timed after a first call,
  whose extra time is recorded as ``compile_s``;
- ``dense``  — :class:`dejavu_lab.engine.Decoder`, the step replayed as a CUDA graph, its ops
  through torch/cuBLAS or our kernels as ``--dense-ops`` says; ``dense_triton`` — every dense op
  through our kernels at 100% kept (the row-gather kernels of the rows layout);
  ``dense_columns`` — every op through the threshold kernels of TEAL's columns layout with no
  threshold (every column read: TEAL's path with nothing skipped, the fastest dense step on the
  H200 at Llama shapes); ``dense_auto`` — each op (qkv, attention core, o, MLP) timed alone
  both ways first (rows ``kind: "op"``), the faster one used;
- ``dejavu`` — rows ``sparse`` (85% MLP + 50% heads removed on OPT, 50% + 50% on Llama shapes,
  ``--dejavu-sparsity``; DejaVu's predictors at their default rank choose the top-k on a side
  stream of high priority, their scores in two launches, the kept sets by ``torch.topk``),
  ``sparse_select_kernel`` (the sets by ``dejavu_lab.kernels.select`` instead), ``sparse_torch_scores`` (the predictors'
  scores by PyTorch ops, not ``dejavu_lab.kernels.predict``), ``sparse_side_priority_0`` (the
  side stream at the default priority), ``sparse_down_tile`` (the batch-1 down projections by
  the one-tile kernel, which the engine leaves to runs without side-stream predictors),
  ``sparse_fixed_sets`` (fixed random sets: no predictors), ``sparse_fixed_sets_down_split``
  (those sets with the down projections by the split kernel) and
  ``sparse_inline_predictors`` (one stream; at ``--parts-at`` only);
- ``teal``, ``wina``, ``cats`` — one row per ``--sparsity``: thresholds calibrated for that
  fraction per site on the prompt's dense prefill
  (:func:`dejavu_lab.engine.calibrate_thresholds`), applied to every token decoded;
- ``larosa``, ``rsparse`` — one row per ``--sparsity``, at the bytes TEAL reads there
  (:func:`dejavu_lab.bench.engine.planned_config`): LaRoSA over the weights with random K/V-group
  rotations folded into W_V and W_O (TEAL's kernels on them, the same kept fractions);
  R-Sparse with random low-rank factors of the rank that ``--lowrank`` (a share of each site's
  kept bytes, 0.1 as its default design) buys, and thresholds for the columns that leave.

Before a variant is timed at a model, the same variant with everything kept (DejaVu at 0%,
thresholds -1) decodes 8 tokens and its logits are compared with the dense decoder's
(``keep_all_vs_dense``, ``check_ok``); after timing, graph replays are compared with eager
steps (``graph_vs_eager``, beside ``eager_vs_eager``: two eager runs). Every row carries the
bytes the step reads (:mod:`dejavu_lab.step_bytes`, at the target kept fractions) and the
achieved bandwidth against the device-to-device copy ceiling measured in the same run. At
``--parts-at`` a breakdown times each part of the step alone (attention, MLP, predictors,
lm_head, all layers, each captured in a CUDA graph). A correctness check on small models runs
first (engine vs HF logits, sparse with everything kept vs dense, graph vs eager). Results:
``results/engine_e2e.json`` (``--name``), with provenance; a table is printed at the end.

With ``--peer-teal DIR`` (a checkout of https://github.com/FasterDecoding/TEAL, never copied
into this repository), TEAL's own decoder is timed in the same run at each Llama-shaped model,
prompt and sparsity (0: its dense gpt-fast step; each ``--sparsity``): its gpt-fast fork built
at the same shape with random fp16 weights, its sparse GEMV kernels with one threshold per site
set from 16 dense decode steps so each site keeps the asked fraction (the fraction its kernels
then keep is recorded), its decode step compiled as its ``generate.py`` compiles it
(``torch.compile(mode="reduce-overhead")``), median of ``--peer-repeats`` runs
(:mod:`dejavu_lab.bench.peer_teal`). Its rows (``kind: "peer"``, ``engine: "teal_peer"``) land
in the same results file, TEAL's commit in the provenance (``teal_commit``), and a table of
ours vs TEAL is printed at the end. TEAL's kernel wrapper needs ``msgspec``.

The models, variants, checks and timing loops live in :mod:`dejavu_lab.bench.engine` (batch 1)
and :mod:`dejavu_lab.bench.engine_batch` (``--batch``); the clocks and the copy ceiling in
:mod:`dejavu_lab.bench.timing` (``triton.testing.do_bench``'s median of a 2 GiB device copy).

    python kernels/bench_engine.py --models llama-2-13b,llama-3-8b,opt-30b --prompts 512 \
        --methods dense,dense_columns,dejavu,teal,wina,cats --sparsity 0.4,0.5 \
        --baselines hf,hf_compiled --name engine_methods           # the gated-MLP methods
    python kernels/bench_engine.py --models llama-3-8b --prompts 512 --baselines '' \
        --methods dense,teal,larosa,rsparse --sparsity 0.4,0.5 --name engine_planned
    python kernels/bench_engine.py --models opt-30b --prompts 512 --hf-new-tokens 16
    python kernels/bench_engine.py --models llama-3-8b,llama-2-13b --prompts 512 --baselines '' \
        --methods dense,teal --sparsity 0.4,0.5 --peer-teal ../TEAL --name engine_peer_teal
    python kernels/bench_engine.py --models facebook/opt-6.7b --prompts 512   # a real checkpoint
    python kernels/bench_engine.py --quick                    # CPU plumbing check, tiny shapes
    python kernels/bench_engine.py --batch 1,4,8,16,32 --models llama-3-8b,opt-30b \
        --prompts 512,2048 --new-tokens 32              # batches: dejavu_lab/bench/engine_batch.py
    python kernels/bench_engine.py --tp 8 --models opt-175b  # torchrun kernels/bench_engine_tp.py
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from dejavu_lab import results
from dejavu_lab.bench import engine as engine_bench
from dejavu_lab.bench import engine_batch as batch_bench
from dejavu_lab.bench import peer_teal, teal_import
from dejavu_lab.bench.engine import build
from dejavu_lab.bench.timing import copy_ceiling, cuda, relerr
from dejavu_lab.engine import (
    DENSE_ENGINES,
    Decoder,
    EngineError,
    SparseConfig,
    decoder_weights,
    dense_ops,
)
from dejavu_lab.errors import InputError
from dejavu_lab.models import PRESETS

MODELS = ["opt-30b", "llama-2-13b", "llama-3-8b", "opt-13b", "opt-6.7b"]  # most important first

PROMPTS = [128, 256, 512, 1024]

ALL_METHODS = (*DENSE_ENGINES, "dejavu", "teal", "wina", "cats", "larosa", "rsparse")


def check(device: str, rows: list[dict]) -> None:
    """Small models: dense vs HF logits, sparse (all kept) vs dense, graph vs eager."""
    dtype = torch.float16 if cuda() else torch.bfloat16
    for preset in ("opt-125m", "smollm2-135m", "tiny-opt-postln"):
        model, arch = build(preset, device, dtype)
        ids = torch.randint(0, 100, (1, 40), device=device)
        w = decoder_weights(model, arch)
        dense = Decoder(w, max_seq_len=64)
        sparse_all = Decoder(w, max_seq_len=64, sparse=SparseConfig(0.0, 0.0))
        sparse = Decoder(w, max_seq_len=64, sparse=SparseConfig(0.5, 0.5, kv_window=4))
        eager_kv = Decoder(w, max_seq_len=64, sparse=SparseConfig(0.5, 0.5, kv_window=0))
        with torch.no_grad():
            ref = model(ids[:, :39]).logits[0, 31:39].float()  # the positions decoded below
        logits = {}
        for name, dec in (("dense", dense), ("all", sparse_all), ("deferred", sparse),
                          ("eager_kv", eager_kv)):  # fmt: skip
            out = [dec.prefill(ids[:, :32])]
            out += [dec.step(int(ids[0, t])) for t in range(32, 39)]
            logits[name] = torch.cat(out).float()
        row = {"kind": "check", "model": preset, "dense_vs_hf": relerr(logits["dense"], ref)}
        row["sparse_all_vs_dense"] = relerr(logits["all"], logits["dense"])
        row["deferred_vs_eager_kv"] = relerr(logits["deferred"], logits["eager_kv"])
        if cuda():  # graph replay vs eager step on the same state
            for dec in (dense, sparse):
                dec.prefill(ids[:, :32])
                eager = [dec.step().clone() for _ in range(6)]
                dec.prefill(ids[:, :32])
                dec.capture()
                graph = [dec.step().clone() for _ in range(6)]
                key = "graph_vs_eager_" + ("sparse" if dec.sparse else "dense")
                row[key] = relerr(torch.cat(graph).float(), torch.cat(eager).float())
        rows.append(row)
        print("check", {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in row.items()})
        del model, w, dense, sparse_all, sparse, eager_kv
        gc.collect()


def _run_tp(args) -> int:
    """``--tp N``: ``torchrun --nproc-per-node N kernels/bench_engine_tp.py`` with the options
    that carry over (models, the first prompt, new tokens, the results name, --quick)."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp),
           str(Path(__file__).with_name("bench_engine_tp.py"))]  # fmt: skip
    if args.models != ",".join(MODELS):
        cmd += ["--models", args.models]
    if args.prompts:
        cmd += ["--prompt", args.prompts.split(",")[0]]
    cmd += ["--new-tokens", str(args.new_tokens)] + (["--name", args.name] if args.name else [])
    cmd += ["--quick"] if args.quick else []
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


def run_batch(args, command: str) -> None:
    """The ``--batch`` run: :class:`~dejavu_lab.engine.BatchDecoder` at each batch size."""
    device = "cuda" if cuda() else "cpu"
    batches = sorted({int(b) for b in args.batch.split(",")})
    if not all(1 <= b <= 32 for b in batches):
        raise SystemExit("--batch takes batch sizes in 1..32, e.g. 1,4,8,16,32.")
    models = args.models.split(",") if not args.quick else ["tiny-opt", "tiny-llama"]
    prompts = [int(p) for p in (args.prompts or "512,2048").split(",")]
    sparsity, union, uncapped_at = None, args.union_budget, None  # the families' defaults
    if args.quick:
        prompts = [int(p) for p in args.prompts.split(",")] if args.prompts else [8, 16]
        sparsity, uncapped_at = (0.5, 0.5), prompts[-1]
        union = 0.5 if union is None else union
    new = args.new_tokens if not args.quick else 4
    ceiling = copy_ceiling()
    rows: list[dict] = []
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    for preset in models:
        t0 = time.perf_counter()
        try:
            batch_bench.bench_model(
                preset, prompts, batches, new, ceiling, device, union_budget=union,
                uncapped_at=uncapped_at, sparsity=sparsity, dense_ops=args.dense_ops,
                do_check=not args.no_check, rows=rows,
            )  # fmt: skip
        except Exception as exc:
            print(f"{preset} failed: {exc!r}")
            rows.append({"kind": "batch", "model": preset, "error": repr(exc)[:300]})
            gc.collect()
            torch.cuda.empty_cache() if cuda() else None
        print(f"{preset}: {time.perf_counter() - t0:.0f} s")
        results.save(args.name, rows, command=command, extra={"copy_tbps": ceiling})
    batch_bench.print_table(rows)
    print(f"wrote {results.save(args.name, rows, command=command, extra={'copy_tbps': ceiling})}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets or HF ids")
    ap.add_argument("--methods", default="dense,dejavu,teal,cats",
                    help=f"comma-separated among {', '.join(ALL_METHODS)}")  # fmt: skip
    ap.add_argument(
        "--sparsity",
        default="0.5",
        help="teal/wina/cats: fractions dropped per site, comma-separated (0.4,0.5); "
        "larosa/rsparse: at TEAL's bytes for each",
    )
    ap.add_argument("--lowrank", type=float, default=engine_bench.LOWRANK,
                    help="rsparse: share of each site's kept bytes in its low-rank factors")  # fmt: skip
    ap.add_argument(
        "--dejavu-sparsity",
        default=None,
        help="dejavu's 'MLP,heads' removed (default: 0.85,0.5 OPT; 0.5,0.5 Llama)",
    )
    ap.add_argument(
        "--dense-ops",
        default=None,
        help="each dense op through torch or triton: torch, triton, qkv=triton,... (default: "
        "the engine's, our attention core on a GPU and torch for the rest)",
    )
    ap.add_argument("--prompts", default=None, help=f"default {','.join(map(str, PROMPTS))}"
                    " (--quick: 8,16)")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=32, help="HF is slow: fewer tokens")
    ap.add_argument("--hf-prompts", default=None, help="prompts for HF (default: --prompts)")
    ap.add_argument("--baselines", default="hf,hf_compiled",
                    help="HF baselines among hf (eager), hf_compiled (static cache + torch.compile)"
                    "; '' for none")  # fmt: skip
    ap.add_argument("--parts-at", type=int, default=512, help="prompt of the time breakdown")
    ap.add_argument("--no-check", action="store_true", help="skip the small-model check")
    ap.add_argument("--repeat", action="store_true", help="add this run to results/<name>.json "
                    "as one more repeat (rows tagged repeat=k) instead of replacing it")  # fmt: skip
    ap.add_argument("--name", default=None, help="results/<name>.json (default engine_e2e, "
                    "with --batch engine_batch)")  # fmt: skip
    ap.add_argument(
        "--batch",
        default=None,
        help="batch sizes, e.g. 1,4,8,16,32: time BatchDecoder (dejavu_lab/bench/engine_batch.py)",
    )
    ap.add_argument(
        "--union-budget",
        type=float,
        default=None,
        help="--batch: fraction of MLP neurons a step's union reads (default 0.3 OPT, 0.5 Llama)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: relaunches "
                    "kernels/bench_engine_tp.py under torchrun with this many processes")  # fmt: skip
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also time each decoder with its epilogues unfused "
        "(fuse_epilogues=False): plain_ms_per_token; without programmatic dependent launch: "
        "no_pdl_ms_per_token; TEAL/WINA/CATS also without fuse_hidden: hidden_unfused_ms_per_token; "
        "CATS also with cuBLAS's gate: cublas_gate_ms_per_token",
    )
    ap.add_argument(
        "--no-fuse-hidden",
        action="store_true",
        help="TEAL/WINA: finish the gate/up sums in their own launch "
        "(Decoder.fuse_hidden = False; by default the down GEMV does it as it loads them)",
    )
    ap.add_argument("--peer-teal", default=None, metavar="DIR",
                    help="a TEAL checkout: also time TEAL's own decoder at each Llama shape, "
                    "dense and at each --sparsity (dejavu_lab/bench/peer_teal.py)")  # fmt: skip
    ap.add_argument("--peer-repeats", type=int, default=3, help="--peer-teal: timed runs (median)")
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check at tiny shapes")
    args = ap.parse_args(argv)
    Decoder.fuse_hidden = not args.no_fuse_hidden
    if args.peer_teal and (args.batch or args.tp > 1):
        sys.exit("--peer-teal times TEAL's decoder at batch 1 on one GPU; drop --batch and --tp.")
    if args.tp > 1:  # one process per GPU: torchrun runs the tensor-parallel benchmark
        return _run_tp(args)
    command = "python kernels/bench_engine.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    device = "cuda" if cuda() else "cpu"
    if not cuda() and not args.quick:
        sys.exit("bench_engine.py needs an NVIDIA GPU (or --quick for a CPU plumbing check).")
    quick = "_quick" if args.quick else ""  # a CPU plumbing run never replaces a GPU recording
    if args.batch:  # the batched engine's benchmark lives in its own file
        args.name = args.name or "engine_batch" + quick
        return run_batch(args, command)
    args.name = args.name or "engine_e2e" + quick
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(ALL_METHODS):
        sys.exit(f"--methods takes {', '.join(ALL_METHODS)}, got {args.methods!r}.")
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - {"hf", "hf_compiled"}:
        sys.exit(f"--baselines takes hf and hf_compiled, got {args.baselines!r}.")
    try:
        sparsities = [float(s) for s in args.sparsity.split(",")]
        budget = ([float(s) for s in args.dejavu_sparsity.split(",")]
                  if args.dejavu_sparsity else None)  # fmt: skip
        if budget is not None and len(budget) != 2:
            raise ValueError
        dense_ops(args.dense_ops)
    except (ValueError, EngineError) as exc:
        sys.exit(f"bad --sparsity, --dejavu-sparsity or --dense-ops: {exc or 'MLP,heads'}")
    if not all(0 <= s < 1 for s in sparsities + (budget or []) + [args.lowrank]):
        sys.exit("sparsities are fractions removed, in [0, 1).")
    models = args.models.split(",") if not args.quick else ["tiny-opt", "tiny-llama"]
    prompts = [int(p) for p in (args.prompts or ",".join(map(str, PROMPTS))).split(",")]
    prompts = [8, 16] if args.quick and not args.prompts else prompts
    hf_prompts = [int(p) for p in (args.hf_prompts or ",".join(map(str, prompts))).split(",")]
    new, hf_new = (args.new_tokens, args.hf_new_tokens) if not args.quick else (4, 3)
    parts_at = args.parts_at if not args.quick else prompts[-1]
    if args.quick:
        hf_prompts = prompts
        budget = budget or (0.5, 0.5)  # both families
    check_tokens = (8, 3) if args.quick else engine_bench.CHECK
    extra = {}
    if args.peer_teal:  # a bad folder or a missing dependency fails here, before any timing
        try:
            extra["teal_commit"] = teal_import.teal_commit(args.peer_teal)
        except InputError as exc:
            sys.exit(f"--peer-teal: {exc}")
    ceiling = copy_ceiling()
    extra["copy_tbps"] = ceiling
    rows: list[dict] = []
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    if not args.no_check:
        try:
            check(device, rows)
        except Exception as exc:
            print(f"correctness check failed: {exc!r}")
            rows.append({"kind": "check", "error": repr(exc)[:300]})
    for preset in models:
        t0 = time.perf_counter()
        try:
            engine_bench.bench_model(
                preset, prompts, new, hf_new, hf_prompts, device, ceiling, parts_at,
                baselines=baselines, methods=methods, sparsities=sparsities, dejavu_budget=budget,
                dense_ops=args.dense_ops, plain=args.plain, check_tokens=check_tokens,
                lowrank=args.lowrank, rows=rows,
            )  # fmt: skip
        except Exception as exc:
            print(f"{preset} failed: {exc!r}")
            rows.append({"kind": "e2e", "model": preset, "error": repr(exc)[:300]})
            gc.collect()
            torch.cuda.empty_cache() if cuda() else None
        if args.peer_teal and getattr(PRESETS.get(preset), "family", None) == "llama":
            try:  # TEAL dense (its gpt-fast step) and at each sparsity, after ours is freed
                peer_teal.bench_teal(args.peer_teal, preset, prompts, new, [0.0, *sparsities],
                                     device, repeats=args.peer_repeats, rows=rows)  # fmt: skip
            except Exception as exc:
                print(f"{preset} teal_peer failed: {exc!r}")
                rows.append({"kind": "peer", "model": preset, "error": repr(exc)[:300]})
        elif args.peer_teal:
            print(f"{preset}: TEAL's decoder runs Llama-shaped presets only; not timed")
        print(f"{preset}: {time.perf_counter() - t0:.0f} s")
        if not args.repeat:  # a killed run keeps the models it finished
            results.save(args.name, rows, command=command, extra=extra)
    engine_bench.print_table(rows, ceiling)
    if args.peer_teal:
        peer_teal.print_peer_table(rows)
    save = results.add_repeat if args.repeat else results.save
    path = save(args.name, rows, command=command, extra=extra)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
