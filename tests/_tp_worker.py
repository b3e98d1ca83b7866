"""One rank of the tensor-parallel test (tests/test_engine_tp.py): run every case, rank 0 writes
the JSON the test reads. Launched as ``torchrun --nproc-per-node 2 tests/_tp_worker.py OUT``
(gloo, CPU); each rank builds the same tiny random model (seed 0) and its TP=1 reference."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dejavu_lab.bench.timing import relerr
from dejavu_lab.engine import (
    Decoder,
    EngineError,
    SparseConfig,
    TPDecoder,
    calibrate_thresholds,
    init_tp,
)
from dejavu_lab.models import random_model

PROMPT, STEPS, NEW = 8, 8, 16  # prompt tokens, teacher-forced steps compared, greedy tokens
BENCH = Path(__file__).resolve().parents[1] / "kernels" / "bench_engine_tp.py"


T0 = time.perf_counter()


def log(*what) -> None:
    """Progress on stderr (the test shows it when the launch fails)."""
    print(
        f"[rank {dist.get_rank()} {time.perf_counter() - T0:6.1f} s, cpu {time.process_time():.1f} s]",
        *what,
        file=sys.stderr,
        flush=True,
    )


def logits_of(dec, ids) -> torch.Tensor:
    """Prefill on the first PROMPT ids, then STEPS steps fed the next ids: [1 + STEPS, V]."""
    out = [dec.prefill(ids[:, :PROMPT])]
    out += [dec.step(int(t)).clone() for t in ids[0, PROMPT : PROMPT + STEPS]]
    return torch.cat(out).float()


def fixed_sets(dec_tp, world: int, n_layers: int, n: int, h: int) -> list[tuple]:
    """Per layer, global kept sets with k_mlp / k_heads on every rank (the same on all ranks)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_layers):
        mlp = [
            r * (n // world) + torch.randperm(n // world, generator=g)[: dec_tp.k_mlp]
            for r in range(world)
        ]
        heads = [
            r * (h // world) + torch.randperm(h // world, generator=g)[: dec_tp.k_heads]
            for r in range(world)
        ]
        out.append((torch.cat(mlp), torch.cat(heads)))
    return out


def compare(name, preset, ref, tp, ids, rank) -> dict:
    log(preset, name)
    a, b = logits_of(tp, ids), logits_of(ref, ids)
    gen_tp = tp.generate(ids[:, :PROMPT], NEW)[0, PROMPT:].tolist()
    gen_ref = ref.generate(ids[:, :PROMPT], NEW)[0, PROMPT:].tolist()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, gen_tp)  # every rank must decode the same tokens
    return {
        "model": preset,
        "case": name,
        "relerr": relerr(a, b),
        "max_abs": (a - b).abs().max().item(),
        "tokens_tp": gen_tp,
        "tokens_ref": gen_ref,
        "ranks_agree": all(t == gen_tp for t in every),
    }


def cases(rank: int, world: int) -> list[dict]:
    rows = []
    for preset in ("tiny-opt", "tiny-llama"):
        ids = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
        m = random_model(preset, seed=0).model  # fp32: the dense path
        L = 32
        rows.append(
            compare(
                "dense", preset, Decoder(m, max_seq_len=L), TPDecoder(m, max_seq_len=L), ids, rank
            )
        )
        m16 = random_model(preset, seed=0, dtype=torch.float16).model  # the sparse kernels
        keep = SparseConfig(0.0, 0.0)
        rows.append(
            compare(
                "sparse_keep_all",
                preset,
                Decoder(m16, max_seq_len=L, sparse=keep),
                TPDecoder(m16, max_seq_len=L, sparse=keep),
                ids,
                rank,
            )
        )
        sp = SparseConfig(0.5, 0.5, kv_window=4)  # deferred KV (MHA) with a flush every 4 tokens
        ref, tp = Decoder(m16, max_seq_len=L, sparse=sp), TPDecoder(m16, max_seq_len=L, sparse=sp)
        a = ref.arch
        for i, (mlp, heads) in enumerate(fixed_sets(tp, world, a.n_layers, a.d_mlp, a.n_heads)):
            ref.set_indices(i, mlp=mlp, heads=heads)
            tp.set_indices(i, mlp=mlp, heads=heads)
        row = compare("sparse_fixed_sets", preset, ref, tp, ids, rank)
        row["window"] = tp.window
        rows.append(row)
        rows.append(predictor_case(preset, m16, rank, world))
        # TEAL (Llama) / CATS (OPT): thresholds calibrated at full width, cut per rank
        method = "teal" if preset == "tiny-llama" else "cats"
        thr = calibrate_thresholds(m16, ids[:, :PROMPT], 0.5, method=method)
        sp = SparseConfig(method=method, thresholds=thr)
        rows.append(
            compare(
                f"{method}_calibrated",
                preset,
                Decoder(m16, max_seq_len=L, sparse=sp),
                TPDecoder(m16, max_seq_len=L, sparse=sp),
                ids,
                rank,
            )
        )
    # post-LN OPT with project_in/out and an odd vocabulary (the last lm_head shard padded)
    m = random_model("tiny-opt-postln", seed=0, vocab_size=127).model
    ids = torch.randint(0, 127, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    rows.append(
        compare(
            "dense_odd_vocab",
            "tiny-opt-postln",
            Decoder(m, max_seq_len=32),
            TPDecoder(m, max_seq_len=32),
            ids,
            rank,
        )
    )
    m = random_model("tiny-llama", seed=0).model  # lm_head replicated instead of vocab-parallel
    rows.append(
        compare(
            "dense_replicated_head",
            "tiny-llama",
            Decoder(m, max_seq_len=32),
            TPDecoder(m, max_seq_len=32, vocab_parallel=False),
            ids,
            rank,
        )
    )
    return rows


@torch.no_grad()
def predictor_case(preset, model, rank, world) -> dict:
    """DejaVu's predictors under TP: each rank's kept sets are the top-k of its own units."""
    from dejavu_lab.collect import fingerprint
    from dejavu_lab.predictors import PredictorConfig, Predictors

    log(preset, "predictors")
    torch.manual_seed(3)
    pred = Predictors(fingerprint(model), PredictorConfig(mode="lookahead")).eval()
    dec = TPDecoder(model, max_seq_len=32, sparse=SparseConfig(0.5, 0.5), predictors=pred)
    x = torch.randn(1, dec.arch.d_model, generator=torch.Generator().manual_seed(4)).half()
    (n0, n1), (h0, h1) = dec.w.shard.neurons, dec.w.shard.heads
    ok = True
    for i in range(dec.arch.n_layers):
        dec.sets.predict(i, x)
        ms, hs = pred.mlp_scores(i, x.float())[0, n0:n1], pred.head_scores(i, x.float())[0, h0:h1]
        want_m = set(torch.topk(ms, dec.k_mlp).indices.tolist())
        want_h = set(torch.topk(hs, dec.k_heads).indices.tolist())
        ok &= (
            set(dec.sets.mlp_idx[i].tolist()) == want_m
            and set(dec.sets.head_idx[i].tolist()) == want_h
        )
    gen = dec.generate(torch.tensor([[5, 6, 7]]), NEW)[0].tolist()
    every = [None] * world
    dist.all_gather_object(every, gen)
    oks = [None] * world
    dist.all_gather_object(oks, ok)
    return {
        "model": preset,
        "case": "predictors",
        "local_topk_ok": all(oks),
        "ranks_agree": all(t == gen for t in every),
        "k_mlp": dec.k_mlp,
    }


def errors(world: int) -> dict:
    """One-sentence errors: world sizes that do not divide, unbalanced fixed sets."""
    log("errors")
    out = {}
    for name, preset, kw in (
        ("kv_heads", "tiny-llama", {"num_key_value_heads": 1}),
        ("neurons", "tiny-opt", {"ffn_dim": 255}),
    ):
        try:
            TPDecoder(random_model(preset, **kw).model, max_seq_len=16)
            out[name] = None
        except EngineError as exc:
            out[name] = str(exc)
    m = random_model("tiny-opt", dtype=torch.float16).model
    dec = TPDecoder(m, max_seq_len=16, sparse=SparseConfig(0.5, 0.5))
    try:
        dec.set_indices(0, mlp=range(128))  # every neuron of rank 0, none of rank 1's
        out["unbalanced"] = None
    except EngineError as exc:
        out["unbalanced"] = str(exc)
    return out


def bench(out_dir: Path) -> dict:
    """kernels/bench_engine_tp.py --quick in this same launch (its results in out_dir)."""
    log("bench --quick")
    spec = importlib.util.spec_from_file_location("bench_engine_tp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine_tp"] = mod
    spec.loader.exec_module(mod)
    mod.main(["--quick", "--name", "engine_tp_quick"])
    return {"path": str(out_dir / "engine_tp_quick.json")}


def main() -> None:
    out = Path(sys.argv[1])
    rank, world, _ = init_tp("gloo")  # CPU tensors, even on a machine with GPUs
    result = {
        "world_size": world,
        "backend": dist.get_backend(),
        "cases": cases(rank, world),
        "errors": errors(world),
        "bench": bench(out.parent),
    }
    log("done")
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
