"""Tensor-parallel batch-1 decoding across GPUs: dense vs DejaVu-sparse (Deja Vu §5.1).

Paper (§5.1): OPT-175B on 8 A100-80GB, fp16, batch 1, prompts 128-1024: DejaVu generates
1.8-2.0x faster than FasterTransformer (a dense Megatron-style tensor-parallel engine with fused
kernels) and 4.8-6.0x faster than Hugging Face. Here our dense tensor-parallel engine
(:class:`dejavu_lab.engine.TPDecoder`, cuBLAS GEMVs, NCCL, the whole step with its collectives
replayed as one CUDA graph) plays FasterTransformer's part, on random fp16 weights built shard by
shard on each rank (:func:`dejavu_lab.engine.random_shard`: the model never exists whole), batch
1, prompt 512, the variants:

- ``dense``             — every head and neuron; two all-reduces per layer, one logits all-gather;
- ``sparse``            — DejaVu, 85% of the MLP neurons and 50% of the heads removed (§5.1),
  lookahead predictors on a side stream, each rank keeping the top share of its own units;
- ``sparse_fixed_sets`` — the same kernels over fixed random sets (no predictors).

For each: ms per token (CUDA events on every rank; the slowest rank's is reported), the share of
the step the collectives take (they alone, captured in a CUDA graph:
``TPDecoder.parts()["collectives"]``), the bytes one rank reads per step
(:func:`dejavu_lab.engine.step_bytes` on its shard) and its bandwidth against the copy ceiling
measured in the same run; rows ``lm_head`` time the replicated head against the vocab-parallel
one plus its all-gather (the layout :mod:`dejavu_lab.engine.tp_weights` picks). Checks run first:
at tiny shapes the TP engine's logits against one rank's (dense, sparse keep-all), at the
benchmark shape graph replays against eager steps and sparse keep-all against dense.

What to expect (bytes per rank from :func:`~dejavu_lab.engine.step_bytes`, context 544, at
4.2 TB/s): OPT-175B on 8 ranks reads 44.0 GB per rank dense (10.5 ms) and 12.1 GB sparse (2.9 ms,
predictors aside); OPT-66B on 2 reads 66.3 / 18.5 GB (15.8 / 4.4 ms). The collectives cost the
same in both — at OPT-175B 192 all-reduces of 24 KB per step, latency-bound at ~5-10 µs each over
NVLink in a graph, i.e. 1-2 ms — so the ratio is ``(10.5 + c) / (2.9 + c)``: 2.4-3.0x at best,
if every kernel ran at the ceiling (the paper measured 1.8-2.0x against FasterTransformer). Our
target, sparse >= 2x over our dense TP engine at OPT-175B on 8 GPUs, needs the sparse
kernels near the ceiling and ``c`` small beside them: ``comm_share`` says which one is short.

    torchrun --nproc-per-node 8 kernels/bench_engine_tp.py                  # OPT-175B (auto)
    torchrun --nproc-per-node 2 kernels/bench_engine_tp.py --models opt-66b
    torchrun --nproc-per-node 2 kernels/bench_engine_tp.py --quick          # CPU, gloo, tiny

``--models auto`` (the default) takes the largest of OPT-175B/66B/30B/13B whose shard fits 85%
of one GPU's memory. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, set here before NCCL
starts). Results: ``results/engine_tp.json`` (``--name``), written by rank 0 with provenance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dejavu_lab.engine.tp import NVLS_OFF

os.environ.update(NVLS_OFF)  # before torch.distributed / NCCL start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dejavu_lab import results  # noqa: E402
from dejavu_lab.bench.timing import copy_ceiling, relerr  # noqa: E402
from dejavu_lab.engine import (  # noqa: E402
    Decoder,
    EngineError,
    SparseConfig,
    TPDecoder,
    init_tp,
    random_shard,
    step_bytes,
)
from dejavu_lab.models import random_model  # noqa: E402

AUTO = ("opt-175b", "opt-66b", "opt-30b", "opt-13b")  # largest first
ROWS: list[dict] = []


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def aligned(device) -> None:
    """Every rank idle and at the same point before a timed region."""
    sync(device)
    dist.barrier()
    sync(device)


def timed(fn, device) -> float:
    """Milliseconds of one call of fn on this rank (CUDA events, or wall clock on CPU)."""
    aligned(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def slowest(ms: float, device, op=dist.ReduceOp.MAX) -> float:
    """The largest of the ranks' times (a step takes as long as its slowest rank)."""
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def graph_ms(fn, device, reps: int = 7) -> float:
    """Median ms of fn replayed as a CUDA graph (collectives included; eager on CPU)."""
    with torch.no_grad():
        if device.type != "cuda":
            fn()
            return sorted(timed(fn, device) for _ in range(3))[1]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        return sorted(timed(g.replay, device) for _ in range(reps))[reps // 2]


def fits(preset: str, world: int, device) -> bool:
    """Whether a rank's shard (and a margin for caches) fits 85% of this GPU's memory."""
    try:
        w = random_shard(preset, 0, world, device="meta")
    except EngineError:  # a world size that does not divide the preset
        return False
    ts = [w.embed, w.lm_head, w.pos_embed] + [t for lw in w.layers for t in vars(lw).values()
                                               if isinstance(t, torch.Tensor)]  # fmt: skip
    need = sum(t.numel() * 2 for t in ts if t is not None) * 1.1
    return need < 0.85 * torch.cuda.get_device_properties(device).total_memory


def make_predictors(arch, device):
    """DejaVu's predictors at their default rank, replicated (random: only their cost counts)."""
    from dejavu_lab.predictors import PredictorConfig, Predictors

    fp = {"model_type": arch.model_type, "n_layers": arch.n_layers, "d_model": arch.d_model,
          "n_heads": arch.n_heads, "n_kv_heads": arch.n_kv_heads, "d_head": arch.d_head,
          "d_mlp": arch.d_mlp, "gated": arch.gated, "weights_sha256": "random"}  # fmt: skip
    torch.manual_seed(0)  # the same on every rank
    with torch.device(device):
        return Predictors(fp, PredictorConfig(mode="lookahead")).eval()


def fixed_sets(dec: TPDecoder, seed: int = 0) -> None:
    """Random kept sets with k_mlp / k_heads on every rank (the same draw on all ranks)."""
    fa, W, g = dec.w.full_arch, dec.world_size, torch.Generator().manual_seed(seed)
    for i in range(fa.n_layers):
        mlp = [r * (fa.d_mlp // W) + torch.randperm(fa.d_mlp // W, generator=g)[: dec.k_mlp]
               for r in range(W)]  # fmt: skip
        heads = [r * (fa.n_heads // W) + torch.randperm(fa.n_heads // W, generator=g)[: dec.k_heads]
                 for r in range(W)]  # fmt: skip
        dec.set_indices(i, mlp=torch.cat(mlp), heads=torch.cat(heads))


def decode_logits(dec, ids, n_prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n_prompt])]
        out += [dec.step(int(t)).clone() for t in ids[0, n_prompt:]]
    return torch.cat(out).float()


def check_tiny(device, dtype) -> None:
    """TP logits against one rank's Decoder on the same tiny model; graph vs eager on GPUs."""
    for preset in ("tiny-opt", "tiny-llama"):
        m = random_model(preset, device=device, dtype=dtype, seed=0).model
        ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1)).to(device)
        row = {"kind": "check", "model": preset}
        for name, sp in (("dense", None), ("sparse_all", SparseConfig(0.0, 0.0))):
            tp = TPDecoder(m, max_seq_len=32, sparse=sp)
            ref = decode_logits(Decoder(m, max_seq_len=32, sparse=sp), ids, 16)
            row[f"{name}_tp_vs_1"] = relerr(decode_logits(tp, ids, 16), ref)
            if device.type == "cuda":
                row[f"{name}_graph_vs_eager"] = graph_check(tp, ids[:, :16])
        row["check_ok"] = all(v < 2e-2 for k, v in row.items() if isinstance(v, float))
        ROWS.append(row)
        say(row)


def graph_check(dec, ids) -> float:
    """relerr of 4 graph replays against 4 eager steps from the same prefill."""
    with torch.no_grad():
        dec.graph = None
        dec.prefill(ids)
        eager = torch.cat([dec.step().clone() for _ in range(4)])
        dec.prefill(ids)
        dec.capture()
        replay = torch.cat([dec.step().clone() for _ in range(4)])
    return relerr(replay.float(), eager.float())


def say(*parts) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def bench_model(preset, *, prompt, new, budget, device, dtype, ceiling) -> None:
    rank, W = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    w = random_shard(preset, rank, W, device=device, dtype=dtype)
    fa, la = w.full_arch, w.arch
    say(f"{preset}: shard of rank 0 built in {time.perf_counter() - t0:.1f} s, "
        f"{w.nbytes() / 1e9:.2f} GB of weights per rank")  # fmt: skip
    preds = make_predictors(fa, device)
    g = torch.Generator().manual_seed(2)  # the same prompt on every rank
    ids = torch.randint(0, w.vocab, (1, prompt), generator=g).to(device)
    base = {"model": preset, "world_size": W, "prompt": prompt, "mlp_sparsity": budget[0],
            "head_sparsity": budget[1], "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    # sparse with everything kept against dense, at this shape (short prompt)
    chk = torch.randint(0, w.vocab, (1, 40), generator=g).to(device)
    ref = decode_logits(TPDecoder(w, max_seq_len=41), chk, 32)
    keep_err = relerr(decode_logits(TPDecoder(w, max_seq_len=41, sparse=SparseConfig()), chk, 32),
                      ref)  # fmt: skip
    variants = (("dense", None, None), ("sparse", SparseConfig(*budget), preds),
                ("sparse_fixed_sets", SparseConfig(*budget), None))  # fmt: skip
    for engine, sp, p in variants:
        dec = TPDecoder(w, max_seq_len=prompt + new + 1, sparse=sp, predictors=p)
        if sp is not None and p is None:
            fixed_sets(dec)
        with torch.no_grad():
            dec.prefill(ids)
            prefill = timed(lambda d=dec: d.prefill(ids), device)
            if device.type == "cuda":
                dec.capture()
            own = timed(lambda d=dec: d.decode(new - 1), device) / (new - 1)
        ms = slowest(own, device)
        comm = slowest(graph_ms(dec.parts()["collectives"], device), device)
        fused = (getattr(dec, "_fused", None) or []) if p is not None else []  # this rank's share
        pred_bytes = sum(t.numel() * t.element_size() for f in fused for t in f
                         if isinstance(t, torch.Tensor))  # fmt: skip
        kept = (1.0, 1.0) if sp is None else (dec.k_mlp / la.d_mlp, dec.k_heads / la.n_heads)
        b = step_bytes(la, vocab=w.lm_head.shape[0], context=prompt + new // 2, mlp_kept=kept[0],
                       head_kept=kept[1], predictors=pred_bytes, d_embed=w.lm_head.shape[1])  # fmt: skip
        row = {**base, "kind": "e2e", "engine": engine, "ms_per_token": ms,
               "ms_per_token_rank0": own if rank == 0 else None, "prefill_ms": prefill,
               "comm_ms": comm, "comm_share": comm / ms, "bytes_per_rank": b["total"],
               "tbps_per_rank": b["total"] / (ms * 1e-3) / 1e12,
               "floor_ms": b["total"] / (ceiling * 1e12) * 1e3 if ceiling == ceiling else None,
               "of_ceiling": b["total"] / (ms * 1e-3) / 1e12 / ceiling if ceiling == ceiling
               else None, "keep_all_vs_dense": keep_err if sp is not None else None,
               **{f"bytes_{k}": v for k, v in b.items() if k != "total"}}  # fmt: skip
        if device.type == "cuda":
            row["graph_vs_eager"] = graph_check(dec, ids[:, : min(prompt, 64)])
        ROWS.append(row)
        say(f"{preset:>9} x{W} {engine:>18}: {ms:8.3f} ms/token (collectives {comm:.3f} ms, "
            f"{comm / ms:.0%}), {b['total'] / 1e9:.2f} GB/rank, {row['tbps_per_rank']:.2f} TB/s")  # fmt: skip
        del dec
    ROWS.append({**base, **lm_head_row(w, device)})
    dense = next(r for r in ROWS if r.get("model") == preset and r.get("engine") == "dense")
    for r in ROWS:
        if r.get("model") == preset and r.get("kind") == "e2e":
            r["speedup_vs_dense"] = dense["ms_per_token"] / r["ms_per_token"]
    del w, preds
    torch.cuda.empty_cache() if device.type == "cuda" else None


def lm_head_row(w, device) -> dict:
    """lm_head alone: replicated [V, d] on every rank vs this rank's rows + the all-gather."""
    x = torch.randn(1, w.lm_head.shape[1], dtype=w.dtype, device=device)
    rep = torch.empty(w.vocab, w.lm_head.shape[1], dtype=w.dtype, device=device).normal_(0, 0.02)
    dec = TPDecoder(w, max_seq_len=8)
    replicated = slowest(graph_ms(lambda: F.linear(x, rep), device), device)
    sharded = slowest(graph_ms(lambda: dec._gather(F.linear(x, w.lm_head)), device), device)
    say(f"lm_head: replicated {replicated:.3f} ms, vocab-parallel + all-gather {sharded:.3f} ms")
    return {"kind": "lm_head", "replicated_ms": replicated, "vocab_parallel_ms": sharded}


def print_table(ceiling: float) -> None:
    print(f"\ncopy ceiling {ceiling:.2f} TB/s per GPU; x = dense ms / variant ms")
    print(f"{'model':>9} {'W':>2} {'variant':>18} {'ms/tok':>8} {'x':>5} {'comm':>6} "
          f"{'GB/rank':>8} {'TB/s':>5} {'/ceil':>5} {'graph':>7}")  # fmt: skip
    for r in ROWS:
        if r.get("kind") != "e2e":
            continue
        oc = r.get("of_ceiling")
        print(f"{r['model']:>9} {r['world_size']:>2} {r['engine']:>18} {r['ms_per_token']:8.3f} "
              f"{r['speedup_vs_dense']:5.2f} {r['comm_share']:6.0%} "
              f"{r['bytes_per_rank'] / 1e9:8.2f} {r['tbps_per_rank']:5.2f} "
              f"{oc if oc is not None else float('nan'):5.2f} "
              f"{r.get('graph_vs_eager', float('nan')):7.1e}")  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="auto", help="comma-separated OPT/Llama presets, or auto")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sparsity", default="0.85,0.5", help="DejaVu's 'MLP,heads' removed (§5.1)")
    ap.add_argument("--no-check", action="store_true", help="skip the tiny-model checks")
    ap.add_argument("--name", default="engine_tp", help="results/<name>.json")
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check (gloo), tiny shapes")
    args = ap.parse_args(argv)
    rank, W, device = init_tp()
    if device.type != "cuda" and not args.quick:
        sys.exit("bench_engine_tp.py needs GPUs (torchrun --nproc-per-node N ...), or --quick.")
    try:
        budget = tuple(float(s) for s in args.sparsity.split(","))
        assert len(budget) == 2 and all(0 <= s < 1 for s in budget)
    except (ValueError, AssertionError):
        sys.exit(
            f"--sparsity takes 'MLP,heads' fractions removed in [0, 1), got {args.sparsity!r}."
        )
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    prompt, new = (8, 4) if args.quick else (args.prompt, args.new_tokens)
    if args.quick and args.name == "engine_tp":  # a CPU run never replaces a GPU recording
        args.name = "engine_tp_quick"
    if args.quick:
        models = ["tiny-opt", "tiny-llama"]
    elif args.models == "auto":
        models = [next((m for m in AUTO if fits(m, W, device)), AUTO[-1])]
    else:
        models = args.models.split(",")
    command = f"torchrun --nproc-per-node {W} kernels/bench_engine_tp.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    # the slowest GPU's copy bandwidth (NaN on CPU)
    ceiling = (
        slowest(copy_ceiling(), device, dist.ReduceOp.MIN)
        if device.type == "cuda"
        else float("nan")
    )
    say(f"{W} ranks ({dist.get_backend()}), models {models}, copy ceiling {ceiling:.2f} TB/s")
    extra = {"copy_tbps": ceiling, "world_size": W, "backend": dist.get_backend(),
             "nvls": {k: os.environ.get(k) for k in NVLS_OFF}}  # fmt: skip
    if not args.no_check:
        check_tiny(device, dtype)
    for preset in models:
        bench_model(preset, prompt=prompt, new=new, budget=budget, device=device, dtype=dtype,
                    ceiling=ceiling)  # fmt: skip
        if rank == 0:
            results.save(args.name, ROWS, command=command, extra=extra)
    if rank == 0:
        print_table(ceiling)
        print(f"wrote {results.save(args.name, ROWS, command=command, extra=extra)}")


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
