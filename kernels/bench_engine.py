"""End-to-end batch-1 decoding: HF ``generate`` vs our dense vs our sparse engine (Deja Vu §5.1).

Knowl 8: on OPT-175B (8x A100, fp16, batch 1, prompts 128-1024) DejaVu generates tokens
1.8-2.0x faster than FasterTransformer and 4.8-6.0x faster than Hugging Face. Here, on one GPU,
random-weight fp16 models at OPT-6.7B/13B/30B and Llama-2-13B shapes (weights need not be
trained to be timed; DejaVu's predictors at their default rank run in the loop and choose the
top-k), batch 1, for each prompt length:

- ``hf``     — ``model.generate`` (eager attention, dynamic cache), per token from
  (T(n) - T(1)) / (n - 1), prefill = T(1);
- ``hf_compiled`` — ``model.generate(..., cache_implementation="static")``: the static cache
  makes HF torch.compile its decode step (the strongest HF baseline); timed after a first call,
  whose extra time is recorded as ``compile_s``;
- ``dense``  — :class:`dejavu_lab.engine.Decoder`, the step replayed as a CUDA graph;
- ``sparse`` — the same with 85% MLP + 50% heads removed (OPT; Llama shape: 50% + 50%), the
  lookahead predictors on a side stream; variants without predictors (fixed random sets) and
  with the predictors inline on one stream show what the predictors cost.

Every row carries the bytes the step reads (:mod:`dejavu_lab.engine.nbytes`) and the achieved
bandwidth against the device-to-device copy ceiling measured in the same run. At one prompt
length a breakdown times each part of the step alone (attention, MLP, predictors, lm_head, all
layers, each captured in a CUDA graph); the rest of the step time is overhead. A correctness
check on small models runs first (engine vs HF logits, sparse with everything kept vs dense,
graph vs eager). Results: ``results/engine_e2e.json`` (``--name``), with provenance.

    python kernels/bench_engine.py                            # everything (~6 min on an H200)
    python kernels/bench_engine.py --models opt-30b --prompts 512 --hf-new-tokens 16
    python kernels/bench_engine.py --models facebook/opt-6.7b --prompts 512   # a real checkpoint
    python kernels/bench_engine.py --quick                    # CPU plumbing check, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from dejavu_lab import results
from dejavu_lab.engine import Decoder, SparseConfig, decoder_weights, step_bytes
from dejavu_lab.models import PRESETS, load_model, random_model

MODELS = ["opt-30b", "llama-2-13b", "opt-13b", "opt-6.7b"]  # most important first
PROMPTS = [128, 256, 512, 1024]
SPARSITY = {"opt": (0.85, 0.5), "llama": (0.5, 0.5)}  # (MLP, heads) removed: §5.1; TEAL range
ROWS: list[dict] = []


def cuda() -> bool:
    return torch.cuda.is_available()


def sync():
    if cuda():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Milliseconds of one call of fn (CUDA events on a GPU, wall clock on CPU)."""
    if not cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def copy_ceiling(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written): the practical ceiling."""
    if not cuda():
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = sorted(timed(lambda: dst.copy_(src)) for _ in range(20))[10]
    return 2 * nbytes / (ms * 1e-3) / 1e12


def build(preset: str, device: str, dtype=torch.float16):
    """A random-weight model at a preset shape, materialised on ``device`` without a CPU copy;
    a Hugging Face id or a local folder (``facebook/opt-6.7b``) loads the real checkpoint."""
    if preset not in PRESETS:
        m = load_model(preset, dtype=dtype, device=device)
        m.model.generation_config.pad_token_id = m.tokenizer.pad_token_id or 0
        return m.model, m.arch
    m = random_model(preset, device="meta", dtype=dtype)
    model, arch = m.model, m.arch
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.02)
        rot = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rot is not None:  # its inv_freq buffer was left empty by to_empty
            model.model.rotary_emb = type(rot)(config=model.config).to(device)
    model.generation_config.pad_token_id = 0
    return model, arch


def make_predictors(model, arch, device):
    """DejaVu's predictors at their default rank (random weights: only their cost matters)."""
    try:
        from dejavu_lab.collect import fingerprint
        from dejavu_lab.predictors import PredictorConfig, Predictors
    except ImportError as exc:  # the predictors module is optional for this script
        print(f"predictors unavailable ({exc}); sparse runs use fixed random sets only")
        return None
    cfg = PredictorConfig(mode="lookahead")
    return Predictors(fingerprint(model, arch), cfg).to(device).eval()


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(device: str) -> None:
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
        ROWS.append(row)
        print("check", {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in row.items()})
        del model, w, dense, sparse_all, sparse, eager_kv
        gc.collect()


def hf_row(model, ids, new_tokens: int, compiled: bool = False) -> dict:
    """HF ``generate``: eager (dynamic cache) or ``cache_implementation="static"``, which
    torch.compiles the decode step on a GPU; per token from (T(n) - T(1)) / (n - 1).

    The compiled run is timed after a first call that compiles (its extra time is
    ``compile_s``); the first call uses the longest length, so later calls reuse its cache."""
    kw = {"cache_implementation": "static"} if compiled else {}

    def gen(n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, **kw)  # fmt: skip

    out = {}
    with torch.no_grad():
        if compiled:  # a fresh compilation for this model and prompt, timed on its own
            torch._dynamo.reset()
            if hasattr(model, "_previous_max_cache_length"):
                model._previous_max_cache_length = -1
            first = timed(lambda: gen(new_tokens))
            tn = min(timed(lambda: gen(new_tokens)) for _ in range(2))
            out["compile_s"] = max(first - tn, 0.0) / 1e3
            out["compiled"] = cuda()  # HF compiles on accelerators only
        else:
            gen(2)  # warm-up
            tn = timed(lambda: gen(new_tokens))
        t1 = min(timed(lambda: gen(1)) for _ in range(2))
    return {"ms_per_token": (tn - t1) / (new_tokens - 1), "prefill_ms": t1, **out}


def engine_row(dec: Decoder, ids, new_tokens: int) -> dict:
    with torch.no_grad():
        dec.prefill(ids)  # warm-up (cuBLAS, allocator)
        prefill = timed(lambda: dec.prefill(ids))
        if cuda():
            dec.capture()
        ms = timed(lambda: dec.decode(new_tokens - 1))
    return {"ms_per_token": ms / (new_tokens - 1), "prefill_ms": prefill}


def parts_rows(dec: Decoder, base: dict) -> list[dict]:
    """Time each part of the step alone (all layers), captured in a CUDA graph when on a GPU."""
    out = []
    for part, fn in dec.parts().items():
        with torch.no_grad():
            fn()
            fn()
            if cuda():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                ms = sorted(timed(g.replay) for _ in range(7))[3]
            else:
                ms = timed(fn)
        out.append({**base, "kind": "part", "part": part, "ms": ms})
    return out


def bench_model(
    preset,
    prompts,
    new_tokens,
    hf_new,
    hf_prompts,
    device,
    ceiling,
    parts_at,
    baselines=("hf", "hf_compiled"),
):
    model, arch = build(preset, device)
    vocab = model.get_output_embeddings().weight.shape[0]
    d_embed = model.get_output_embeddings().weight.shape[1]
    ms_, hs_ = SPARSITY[arch.family]  # Llama-family ids (Mistral, Qwen2) use the Llama budgets
    preds = make_predictors(model, arch, device)
    pred_bytes = 0
    if preds is not None:
        pred_bytes = sum(p.numel() * p.element_size() for p in preds.parameters())
    base = {"model": preset, "family": arch.family, "mlp_sparsity": ms_, "head_sparsity": hs_}
    for p in hf_prompts:
        ids = torch.randint(0, vocab, (1, p), device=device)
        for name in baselines:
            row = {**base, "kind": "e2e", "engine": name, "prompt": p}
            try:
                row.update(hf_row(model, ids, hf_new, compiled=name == "hf_compiled"))
            except Exception as exc:  # e.g. a torch.compile failure: record it, go on
                print(f"{preset} {name} prompt {p} failed: {exc!r}")
                ROWS.append({**row, "error": repr(exc)[:300]})
                continue
            ROWS.append(_bw(row, arch, vocab, d_embed, p, new_tokens, 1.0, 1.0, 0, ceiling))
            print(_fmt(row))
    w = decoder_weights(model, arch)
    configs = [("dense", None, None, 1.0, 1.0, 0)]
    kept = (1 - ms_, 1 - hs_)
    if preds is not None:
        configs.append(("sparse", SparseConfig(ms_, hs_), preds, *kept, pred_bytes))
    configs.append(("sparse_fixed_sets", SparseConfig(ms_, hs_), None, *kept, 0))
    if preds is not None:
        inline = SparseConfig(ms_, hs_, side_stream=False)
        configs.append(("sparse_inline_predictors", inline, preds, *kept, pred_bytes))
    for p in prompts:
        ids = torch.randint(0, vocab, (1, p), device=device)
        for name, sp, pr, mk, hk, pb in configs:
            if name == "sparse_inline_predictors" and p != parts_at:
                continue
            dec = Decoder(w, max_seq_len=p + new_tokens, sparse=sp, predictors=pr)
            if sp is not None and pr is None:  # fixed random kept sets, one per layer
                g = torch.Generator(device="cpu").manual_seed(0)
                for i in range(arch.n_layers):
                    dec.set_indices(i, mlp=torch.randperm(arch.d_mlp, generator=g)[: dec.k_mlp],
                                    heads=torch.randperm(arch.n_heads, generator=g)[: dec.k_heads])  # fmt: skip
            row = {**base, "kind": "e2e", "engine": name, "prompt": p}
            try:
                row.update(engine_row(dec, ids, new_tokens))
            except Exception as exc:  # record and go on: one failure must not lose the run
                print(f"{preset} {name} prompt {p} failed: {exc!r}")
                ROWS.append({**row, "error": repr(exc)[:300]})
                continue
            ROWS.append(_bw(row, arch, vocab, d_embed, p, new_tokens, mk, hk, pb, ceiling))
            print(_fmt(row))
            if p == parts_at and name in ("dense", "sparse"):
                ROWS.extend(parts_rows(dec, {**base, "engine": name, "prompt": p}))
            del dec
            gc.collect()
    del model, w, preds
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def _bw(row, arch, vocab, d_embed, prompt, new_tokens, mk, hk, pb, ceiling) -> dict:
    ctx = prompt + new_tokens // 2  # mean context over the generated tokens
    b = step_bytes(arch, vocab=vocab, context=ctx, mlp_kept=mk, head_kept=hk, predictors=pb,
                   d_embed=d_embed)  # fmt: skip
    row["bytes_per_token"] = b["total"]
    row["floor_ms"] = b["total"] / (ceiling * 1e12) * 1e3 if ceiling == ceiling else None
    row["tbps"] = b["total"] / (row["ms_per_token"] * 1e-3) / 1e12
    row["of_ceiling"] = row["tbps"] / ceiling if ceiling == ceiling else None
    for k, v in b.items():
        row[f"bytes_{k}"] = v
    return row


def _fmt(row) -> str:
    return (f"{row['model']:>12} {row['engine']:>25} prompt {row['prompt']:5d}: "
            f"{row['ms_per_token']:8.3f} ms/token, prefill {row['prefill_ms']:8.1f} ms, "
            f"{row['tbps']:.2f} TB/s"
            + (f", compile {row['compile_s']:.1f} s" if "compile_s" in row else ""))  # fmt: skip


def print_table(ceiling: float) -> None:
    e2e = [r for r in ROWS if r.get("kind") == "e2e" and "error" not in r]
    print(f"\ncopy ceiling {ceiling:.2f} TB/s; ms per token (x: speedup of sparse)")
    by = {}
    for r in e2e:
        by.setdefault((r["model"], r["prompt"]), {})[r["engine"]] = r
    print(f"{'model':>12} {'prompt':>6} {'hf':>8} {'hf_comp':>8} {'dense':>8} {'/floor':>6} "
          f"{'sparse':>8} {'vs dense':>8} {'vs hf':>7} {'vs hfc':>7} {'fixed':>8}")  # fmt: skip
    for (m, p), e in sorted(by.items()):
        hf, hfc, de = e.get("hf"), e.get("hf_compiled"), e.get("dense")
        sp, fx = e.get("sparse") or e.get("sparse_fixed_sets"), e.get("sparse_fixed_sets")

        def ms(r):
            return f"{r['ms_per_token']:8.2f}" if r else f"{'-':>8}"

        def ratio(a, b, w):
            return f"{a['ms_per_token'] / b['ms_per_token']:{w}.2f}" if a and b else f"{'-':>{w}}"

        floor = f"{de['ms_per_token'] / de['floor_ms']:6.2f}" if de and de["floor_ms"] else "     -"
        print(f"{m:>12} {p:6d} {ms(hf)} {ms(hfc)} {ms(de)} {floor} {ms(sp)} {ratio(de, sp, 8)} "
              f"{ratio(hf, sp, 7)} {ratio(hfc, sp, 7)} {ms(fx)}")  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets or HF ids")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=32, help="HF is slow: fewer tokens")
    ap.add_argument("--hf-prompts", default=None, help="prompts for HF (default: --prompts)")
    ap.add_argument("--baselines", default="hf,hf_compiled",
                    help="HF baselines among hf (eager), hf_compiled (static cache + torch.compile)"
                    "; '' for none")  # fmt: skip
    ap.add_argument("--parts-at", type=int, default=512, help="prompt of the time breakdown")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--name", default="engine_e2e", help="results/<name>.json")
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check at tiny shapes")
    args = ap.parse_args(argv)
    command = "python kernels/bench_engine.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    device = "cuda" if cuda() else "cpu"
    if not cuda() and not args.quick:
        sys.exit("bench_engine.py needs an NVIDIA GPU (or --quick for a CPU plumbing check).")
    models = args.models.split(",") if not args.quick else ["tiny-opt", "tiny-llama"]
    prompts = [int(p) for p in args.prompts.split(",")] if not args.quick else [8, 16]
    hf_prompts = [int(p) for p in (args.hf_prompts or ",".join(map(str, prompts))).split(",")]
    new, hf_new = (args.new_tokens, args.hf_new_tokens) if not args.quick else (4, 3)
    parts_at = args.parts_at if not args.quick else 16
    if args.quick:
        hf_prompts = prompts
        SPARSITY.update({"opt": (0.5, 0.5), "llama": (0.5, 0.5)})
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - {"hf", "hf_compiled"}:
        sys.exit(f"--baselines takes hf and hf_compiled, got {args.baselines!r}.")
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    if not args.no_check:
        try:
            check(device)
        except Exception as exc:
            print(f"correctness check failed: {exc!r}")
            ROWS.append({"kind": "check", "error": repr(exc)[:300]})
    for preset in models:
        t0 = time.perf_counter()
        try:
            bench_model(
                preset, prompts, new, hf_new, hf_prompts, device, ceiling, parts_at, baselines
            )
        except Exception as exc:
            print(f"{preset} failed: {exc!r}")
            ROWS.append({"kind": "e2e", "model": preset, "error": repr(exc)[:300]})
            gc.collect()
            torch.cuda.empty_cache() if cuda() else None
        print(f"{preset}: {time.perf_counter() - t0:.0f} s")
        results.save(args.name, ROWS, command=command, extra={"copy_tbps": ceiling})
    print_table(ceiling)
    path = results.save(args.name, ROWS, command=command, extra={"copy_tbps": ceiling})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
