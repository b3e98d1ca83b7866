"""End-to-end batch-1 decoding: HF ``generate`` vs our engine, dense and every sparsity method (§5.1).

Knowl 8: on OPT-175B (8x A100, fp16, batch 1, prompts 128-1024) DejaVu generates tokens
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
  stream), ``sparse_fixed_sets`` (fixed random sets: no predictors) and
  ``sparse_inline_predictors`` (one stream; at ``--parts-at`` only);
- ``teal``, ``wina``, ``cats`` — one row per ``--sparsity``: thresholds calibrated for that
  fraction per site on the prompt's dense prefill
  (:func:`dejavu_lab.engine.calibrate_thresholds`), applied to every token decoded.

Before a variant is timed at a model, the same variant with everything kept (DejaVu at 0%,
thresholds -1) decodes 8 tokens and its logits are compared with the dense decoder's
(``keep_all_vs_dense``, ``check_ok``); after timing, graph replays are compared with eager
steps (``graph_vs_eager``, beside ``eager_vs_eager``: two eager runs). Every row carries the
bytes the step reads (:mod:`dejavu_lab.engine.nbytes`, at the target kept fractions) and the
achieved bandwidth against the device-to-device copy ceiling measured in the same run. At
``--parts-at`` a breakdown times each part of the step alone (attention, MLP, predictors,
lm_head, all layers, each captured in a CUDA graph). A correctness check on small models runs
first (engine vs HF logits, sparse with everything kept vs dense, graph vs eager). Results:
``results/engine_e2e.json`` (``--name``), with provenance; a table is printed at the end.

    python kernels/bench_engine.py --models llama-2-13b,llama-3-8b,opt-30b --prompts 512 \
        --methods dense,dense_columns,dejavu,teal,wina,cats --sparsity 0.4,0.5 \
        --baselines hf,hf_compiled --name engine_methods           # issues 11 and 12
    python kernels/bench_engine.py --models opt-30b --prompts 512 --hf-new-tokens 16
    python kernels/bench_engine.py --models facebook/opt-6.7b --prompts 512   # a real checkpoint
    python kernels/bench_engine.py --quick                    # CPU plumbing check, tiny shapes
    python kernels/bench_engine.py --batch 1,4,8,16,32 --models llama-3-8b,opt-30b \
        --prompts 512,2048 --new-tokens 32              # batches: kernels/bench_engine_batch.py
    python kernels/bench_engine.py --tp 8 --models opt-175b  # torchrun kernels/bench_engine_tp.py
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dejavu_lab import results
from dejavu_lab.engine import (
    DENSE_ENGINES,
    SITES,
    Decoder,
    EngineError,
    SparseConfig,
    calibrate_thresholds,
    decoder_weights,
    dense_ops,
    keep_all,
    step_bytes,
)
from dejavu_lab.kernels import pdl
from dejavu_lab.models import PRESETS, load_model, random_model

# the module (the package's name ``cats_mlp`` is the function): its SPLIT_GATE switch
CATS_MLP = importlib.import_module("dejavu_lab.kernels.cats_mlp")

MODELS = ["opt-30b", "llama-2-13b", "llama-3-8b", "opt-13b", "opt-6.7b"]  # most important first
PROMPTS = [128, 256, 512, 1024]
ALL_METHODS = (*DENSE_ENGINES, "dejavu", "teal", "wina", "cats")
SPARSITY = {"opt": (0.85, 0.5), "llama": (0.5, 0.5)}  # (MLP, heads) removed: §5.1; TEAL range
ROWS: list[dict] = []
CHECK = [32, 8]  # the keep-all check: prompt tokens, then tokens decoded and compared


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


def graph_ms(fn) -> float:
    """Median ms of fn captured in a CUDA graph and replayed (wall clock of fn on CPU)."""
    with torch.no_grad():
        fn()
        fn()
        if not cuda():
            return timed(fn)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return sorted(timed(g.replay) for _ in range(7))[3]


def parts_rows(dec: Decoder, base: dict) -> list[dict]:
    """Time each part of the step alone (all layers), captured in a CUDA graph when on a GPU."""
    return [{**base, "kind": "part", "part": part, "ms": graph_ms(fn)}
            for part, fn in dec.parts().items()]  # fmt: skip


def pick_dense_ops(w, arch, ids, base: dict) -> str:
    """Time each dense op alone over every layer (CUDA graph) through torch and through our
    kernels at 100% kept; the ``--dense-ops`` spec of the faster ones. The attention core is
    timed as the attention block with only the core switched (qkv and o through torch)."""
    p = ids.shape[1]
    decs = {impl: Decoder(w, max_seq_len=p + 1, dense_ops=impl)
            for impl in ("torch", "triton", "attn=triton")}  # fmt: skip
    for dec in decs.values():
        dec.prefill(ids)
    dev, dt, L = w.device, w.dtype, range(arch.n_layers)
    x = torch.randn(1, arch.d_model, device=dev, dtype=dt) / 8
    o = torch.randn(1, arch.n_heads * arch.d_head, device=dev, dtype=dt) / 8

    def over_layers(dec, op):
        if op == "qkv":
            return lambda: [dec.attn[i].qkv(x) for i in L]
        if op == "o":
            return lambda: [dec.attn[i].out(o) for i in L]
        if op == "mlp":
            return lambda: [dec.mlp[i](x) for i in L]
        return lambda: (dec._per_step(), [dec.attn[i](x) for i in L])

    spec = []
    for op in ("qkv", "attn", "o", "mlp"):
        ms = {impl: graph_ms(over_layers(decs[key], op))
              for impl, key in (("torch", "torch"),
                                ("triton", "attn=triton" if op == "attn" else "triton"))}  # fmt: skip
        best = min(ms, key=ms.get)
        spec.append(f"{op}={best}")
        ROWS.append({**base, "kind": "op", "prompt": p, "op": op, "torch_ms": ms["torch"],
                     "triton_ms": ms["triton"], "picked": best})  # fmt: skip
        print(f"{base['model']:>12} dense op {op:>4}: torch {ms['torch']:.3f} ms, ours "
              f"{ms['triton']:.3f} ms (all layers) -> {best}")  # fmt: skip
    return ",".join(spec)


@dataclass
class Variant:
    """One engine configuration timed per prompt: a row ``engine`` of the results."""

    engine: str  # dense, dense_triton, sparse, sparse_fixed_sets, sparse_inline_predictors,
    #              teal, wina, cats
    method: str = "dense"  # the SparseConfig method ("dense": sparse=None)
    sparsity: float = 0.0  # teal/wina/cats: the calibrated fraction of entries dropped per site
    sparse: SparseConfig | None = None  # dejavu's config (teal/wina/cats: built per prompt)
    predictors: bool = False  # dejavu: lookahead predictors choose the kept sets
    ops: str | None = None  # dense_ops of this decoder (None: --dense-ops)
    only_at_parts: bool = False  # time only at the breakdown's prompt
    columns: bool = False  # reads TEAL's columns layout (teal, wina, dense_columns)


def variants(methods, sparsities, dejavu_budget, preds) -> list[Variant]:
    """The variants of --methods; rows-layout methods first (TEAL/WINA convert the weights)."""
    out, ms_, hs_ = [], *dejavu_budget
    for m in methods:
        if m == "dense":
            out.append(Variant("dense"))
        elif m == "dense_triton":
            out.append(Variant("dense_triton", ops="triton"))
        elif m == "dense_columns":  # our threshold kernels over every column
            out.append(Variant("dense_columns", ops="triton", columns=True))
        elif m == "dense_auto":  # the faster of torch and ours per op, timed first
            out.append(Variant("dense_auto", ops="auto"))
        elif m == "dejavu":
            sp = SparseConfig(ms_, hs_)
            if preds is not None:
                out.append(Variant("sparse", "dejavu", sparse=sp, predictors=True))
            out.append(Variant("sparse_fixed_sets", "dejavu", sparse=sp))
            if preds is not None:
                out.append(Variant("sparse_inline_predictors", "dejavu", predictors=True,
                                   sparse=SparseConfig(ms_, hs_, side_stream=False),
                                   only_at_parts=True))  # fmt: skip
        else:
            out += [Variant(m, m, sparsity=s, columns=m in ("teal", "wina")) for s in sparsities]
    return sorted(out, key=lambda v: v.columns)  # stable: rows layout first


def decode_logits(dec: Decoder, ids, n_prompt: int) -> torch.Tensor:
    """Logits of the last prompt position and of each following token fed one by one."""
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n_prompt])]
        out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out).float()


def make_decoder(v: Variant, w, arch, max_len, preds, dense_ops, thresholds=None):
    if v.method in ("teal", "wina", "cats"):
        sp = SparseConfig(method=v.method, thresholds=thresholds)
    else:
        sp = v.sparse
    dec = Decoder(w, max_seq_len=max_len, sparse=sp, predictors=preds if v.predictors else None,
                  dense_ops=v.ops or dense_ops)  # fmt: skip
    if v.method == "dejavu" and not v.predictors:  # fixed random kept sets, one per layer
        g = torch.Generator(device="cpu").manual_seed(0)
        for i in range(arch.n_layers):
            dec.set_indices(i, mlp=torch.randperm(arch.d_mlp, generator=g)[: dec.k_mlp],
                            heads=torch.randperm(arch.n_heads, generator=g)[: dec.k_heads])  # fmt: skip
    return dec


def keep_all_check(v: Variant, w, arch, ids, ref, preds, dense_ops) -> float:
    """relerr of this variant with everything kept against the dense decoder's logits."""
    if v.method == "dejavu":
        kv = Variant(v.engine, "dejavu", sparse=SparseConfig(0.0, 0.0))
    else:
        kv = v
    thr = keep_all(w, v.method) if v.method in ("teal", "wina", "cats") else None
    dec = make_decoder(kv, w, arch, ids.shape[1] + 1, preds, dense_ops, thr)
    return relerr(decode_logits(dec, ids, CHECK[0]), ref)


def graph_check(dec: Decoder, ids) -> tuple[float, float]:
    """(graph vs eager, eager vs eager): relerr of 4 graph replays against 4 eager steps from
    the same prefill, fed the same tokens, and of a second eager run against the first (GPU
    only). Fixed tokens, not greedy ones: the threshold GEMVs' fp32 atomics round in arrival
    order, a rounding flips an entry that sits at its threshold, and on random weights 32-40
    thresholded layers amplify that until a second eager run differs as much as the replay
    (H200: TEAL 50%, ~0.9 both; every column kept, ~5e-3 both) — the second number says
    whether the graph adds anything of its own."""
    graph, dec.graph = dec.graph, None
    feed = [int(t) for t in ids[0, :4]]
    with torch.no_grad():
        dec.prefill(ids)
        eager = torch.cat([dec.step(t).clone() for t in feed])
        dec.prefill(ids)
        again = torch.cat([dec.step(t).clone() for t in feed])
        dec.prefill(ids)
        dec.graph = graph
        replay = torch.cat([dec.step(t).clone() for t in feed])
    return relerr(replay.float(), eager.float()), relerr(again.float(), eager.float())


def bench_model(preset, prompts, new_tokens, hf_new, hf_prompts, device, ceiling, parts_at, *,
                baselines=("hf", "hf_compiled"), methods=("dense", "dejavu"), sparsities=(0.5,),
                dejavu_budget=None, dense_ops=None, plain=False) -> None:  # fmt: skip
    model, arch = build(preset, device)
    vocab = model.get_output_embeddings().weight.shape[0]
    d_embed = model.get_output_embeddings().weight.shape[1]
    # Llama-family ids (Mistral, Qwen2) use the Llama budgets
    ms_, hs_ = dejavu_budget or SPARSITY[arch.family]
    preds = make_predictors(model, arch, device) if "dejavu" in methods else None
    pred_bytes = sum(p.numel() * p.element_size() for p in preds.parameters()) if preds else 0
    base = {"model": preset, "family": arch.family, "mlp_sparsity": ms_, "head_sparsity": hs_}
    bw = dict(arch=arch, vocab=vocab, d_embed=d_embed, new_tokens=new_tokens, ceiling=ceiling)
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
            ROWS.append(_bw(row, prompt=p, **bw))
            print(_fmt(row))
    torch._dynamo.reset()  # drop HF's compiled graphs and their memory before our weights
    gc.collect()
    torch.cuda.empty_cache() if cuda() else None
    w = decoder_weights(model, arch)
    check_ids = torch.randint(0, vocab, (1, sum(CHECK)), device=device)
    ref = decode_logits(Decoder(w, max_seq_len=sum(CHECK) + 1, dense_ops=dense_ops), check_ids,
                        CHECK[0])  # fmt: skip
    for v in variants(methods, sparsities, (ms_, hs_), preds):
        if v.columns and w.layout == "rows":
            w.set_layout("columns")  # TEAL/WINA read W_QKV^T and W_in^T (one copy at a time)
            torch.cuda.empty_cache() if cuda() else None
        if v.ops == "auto":
            p = parts_at if parts_at in prompts else prompts[-1]
            v.ops = pick_dense_ops(w, arch, torch.randint(0, vocab, (1, p), device=device), base)
        try:
            keep_err = keep_all_check(v, w, arch, check_ids, ref, preds, dense_ops)
        except Exception as exc:
            print(f"{preset} {v.engine} keep-all check failed: {exc!r}")
            ROWS.append({**base, "kind": "e2e", "engine": v.engine, "error": repr(exc)[:300]})
            continue
        ok = keep_err < 3e-2
        print(f"{preset:>12} {v.engine:>25} keep-all vs dense: relerr {keep_err:.1e} "
              f"{'ok' if ok else 'FAILED'}")  # fmt: skip
        for p in prompts:
            if v.only_at_parts and p != parts_at:
                continue
            ids = torch.randint(0, vocab, (1, p), device=device)
            row = {**base, "kind": "e2e", "engine": v.engine, "prompt": p, "method": v.method,
                   "sparsity": v.sparsity, "dense_ops": v.ops or dense_ops or "torch",
                   "keep_all_vs_dense": keep_err, "check_ok": ok}  # fmt: skip
            try:
                thr = None
                if v.method in ("teal", "wina", "cats"):
                    thr = calibrate_thresholds(w, ids, v.sparsity, method=v.method)
                dec = make_decoder(v, w, arch, p + new_tokens, preds, dense_ops, thr)
                row.update(engine_row(dec, ids, new_tokens))
                if plain and dec.fuse_epilogues and v.method != "dejavu":  # the unfused step
                    dec.fuse_epilogues = False
                    row["plain_ms_per_token"] = engine_row(dec, ids, new_tokens)["ms_per_token"]
                    dec.fuse_epilogues = True
                    on, pdl.PDL = pdl.PDL, False  # each kernel launched after the last ends
                    row["no_pdl_ms_per_token"] = engine_row(dec, ids, new_tokens)["ms_per_token"]
                    pdl.PDL = on
                    if v.method == "cats":  # the gate through cuBLAS, as before the split
                        CATS_MLP.SPLIT_GATE = False
                        ms = engine_row(dec, ids, new_tokens)["ms_per_token"]
                        row["cublas_gate_ms_per_token"] = ms
                        CATS_MLP.SPLIT_GATE = True
                    if dec.fuse_hidden and v.method in ("teal", "wina", "cats"):  # its own saving
                        dec.fuse_hidden = False
                        ms = engine_row(dec, ids, new_tokens)["ms_per_token"]
                        row["hidden_unfused_ms_per_token"] = ms
                        dec.fuse_hidden = True
                if cuda():
                    row["graph_vs_eager"], row["eager_vs_eager"] = graph_check(dec, ids)
            except Exception as exc:  # record and go on: one failure must not lose the run
                print(f"{preset} {v.engine} prompt {p} failed: {exc!r}")
                ROWS.append({**row, "error": repr(exc)[:300]})
                continue
            kept = dict(mlp_kept=1.0, head_kept=1.0, predictors=0, site_kept=None)
            if v.method == "dejavu":
                kept.update(mlp_kept=1 - ms_, head_kept=1 - hs_,
                            predictors=pred_bytes if v.predictors else 0)  # fmt: skip
            elif v.method in SITES:
                kept["site_kept"] = dict.fromkeys(SITES[v.method], 1 - v.sparsity)
            ROWS.append(_bw(row, prompt=p, **kept, **bw))
            print(_fmt(row))
            if p == parts_at and v.engine in (*DENSE_ENGINES, "sparse", "teal", "cats"):
                ROWS.extend(parts_rows(dec, {**base, "engine": v.engine, "prompt": p,
                                             "sparsity": v.sparsity}))  # fmt: skip
            del dec
            gc.collect()
    del model, w, preds
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def _bw(row, *, arch, vocab, d_embed, prompt, new_tokens, ceiling, mlp_kept=1.0, head_kept=1.0,
        predictors=0, site_kept=None) -> dict:  # fmt: skip
    ctx = prompt + new_tokens // 2  # mean context over the generated tokens
    b = step_bytes(arch, vocab=vocab, context=ctx, mlp_kept=mlp_kept, head_kept=head_kept,
                   predictors=predictors, d_embed=d_embed, site_kept=site_kept)  # fmt: skip
    row["bytes_per_token"] = b["total"]
    row["floor_ms"] = b["total"] / (ceiling * 1e12) * 1e3 if ceiling == ceiling else None
    row["tbps"] = b["total"] / (row["ms_per_token"] * 1e-3) / 1e12
    row["of_ceiling"] = row["tbps"] / ceiling if ceiling == ceiling else None
    for k, v in b.items():
        row[f"bytes_{k}"] = v
    return row


def _fmt(row) -> str:
    name = row["engine"] + (f"@{row['sparsity']:.0%}" if row.get("method") in SITES else "")
    return (f"{row['model']:>12} {name:>25} prompt {row['prompt']:5d}: "
            f"{row['ms_per_token']:8.3f} ms/token, prefill {row['prefill_ms']:8.1f} ms, "
            f"{row['tbps']:.2f} TB/s"
            + (f", compile {row['compile_s']:.1f} s" if "compile_s" in row else ""))  # fmt: skip


def print_table(ceiling: float) -> None:
    """One line per (model, prompt, variant): ms/token, ratios, GB/step, floor, checks."""
    e2e = [r for r in ROWS if r.get("kind") == "e2e" and "error" not in r]
    print(f"\ncopy ceiling {ceiling:.2f} TB/s; x = ratio of ms per token (higher: this variant "
          "is faster); floor = bytes / ceiling")  # fmt: skip
    print(
        f"vs best = against the fastest dense variant of the run ({', '.join(DENSE_ENGINES)}); "
        "graph / eager2 = relerr of graph replays / of a second eager run against eager steps"
    )
    print(f"{'model':>12} {'prompt':>6} {'variant':>25} {'ms/tok':>8} {'vs dense':>8} "
          f"{'vs best':>7} {'vs hf':>6} {'vs hfc':>6} {'GB/step':>8} {'/floor':>6} "
          f"{'keep-all':>8} {'graph':>7} {'eager2':>7}")  # fmt: skip
    by = {}
    for r in e2e:
        by.setdefault((r["model"], r["prompt"]), []).append(r)
    for (m, p), rows in sorted(by.items()):
        eng = {r["engine"]: r for r in rows}
        best = min((r for r in rows if r["engine"] in DENSE_ENGINES),
                   key=lambda r: r["ms_per_token"], default=None)  # fmt: skip

        def x(ref, r, w):
            ok = ref is not None and ref is not r
            return f"{ref['ms_per_token'] / r['ms_per_token']:{w}.2f}" if ok else f"{'-':>{w}}"

        for r in rows:
            name = r["engine"] + (f"@{r['sparsity']:.0%}" if r.get("method") in SITES else "")
            floor = r["ms_per_token"] / r["floor_ms"] if r.get("floor_ms") else float("nan")
            ka = r.get("keep_all_vs_dense")
            ka = f"{ka:8.1e}" if ka is not None else f"{'-':>8}"
            ge, e2 = (r.get(k) for k in ("graph_vs_eager", "eager_vs_eager"))
            ge = f"{ge:7.1e}" if ge is not None else f"{'-':>7}"
            e2 = f"{e2:7.1e}" if e2 is not None else f"{'-':>7}"
            print(f"{m:>12} {p:6d} {name:>25} {r['ms_per_token']:8.2f} "
                  f"{x(eng.get('dense'), r, 8)} {x(best, r, 7)} {x(eng.get('hf'), r, 6)} "
                  f"{x(eng.get('hf_compiled'), r, 6)} {r['bytes_per_token'] / 1e9:8.2f} "
                  f"{floor:6.2f} {ka} {ge} {e2}")  # fmt: skip
    bad = [r for r in ROWS if r.get("check_ok") is False]
    if bad:
        print(f"keep-all check FAILED for: {sorted({(r['model'], r['engine']) for r in bad})}")
    errors = [r for r in ROWS if "error" in r]
    for r in errors:
        print(f"error: {r.get('model')} {r.get('engine')}: {r['error'][:160]}")


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets or HF ids")
    ap.add_argument("--methods", default="dense,dejavu,teal,cats",
                    help=f"comma-separated among {', '.join(ALL_METHODS)}")  # fmt: skip
    ap.add_argument(
        "--sparsity",
        default="0.5",
        help="teal/wina/cats: fractions dropped per site, comma-separated (0.4,0.5)",
    )
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
    ap.add_argument("--name", default=None, help="results/<name>.json (default engine_e2e, "
                    "with --batch engine_batch)")  # fmt: skip
    ap.add_argument(
        "--batch",
        default=None,
        help="batch sizes, e.g. 1,4,8,16,32: time BatchDecoder (kernels/bench_engine_batch.py)",
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
        help="also time each dense/TEAL/WINA/CATS decoder with its epilogues unfused "
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
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check at tiny shapes")
    args = ap.parse_args(argv)
    Decoder.fuse_hidden = not args.no_fuse_hidden
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
        spec = importlib.util.spec_from_file_location(
            "bench_engine_batch", Path(__file__).with_name("bench_engine_batch.py")
        )
        batch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(batch)
        return batch.run(args, command)
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
    if not all(0 <= s < 1 for s in sparsities + (budget or [])):
        sys.exit("sparsities are fractions removed, in [0, 1).")
    models = args.models.split(",") if not args.quick else ["tiny-opt", "tiny-llama"]
    prompts = [int(p) for p in (args.prompts or ",".join(map(str, PROMPTS))).split(",")]
    prompts = [8, 16] if args.quick and not args.prompts else prompts
    hf_prompts = [int(p) for p in (args.hf_prompts or ",".join(map(str, prompts))).split(",")]
    new, hf_new = (args.new_tokens, args.hf_new_tokens) if not args.quick else (4, 3)
    parts_at = args.parts_at if not args.quick else prompts[-1]
    if args.quick:
        hf_prompts = prompts
        SPARSITY.update({"opt": (0.5, 0.5), "llama": (0.5, 0.5)})
        CHECK[:] = [8, 3]
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
            bench_model(preset, prompts, new, hf_new, hf_prompts, device, ceiling, parts_at,
                        baselines=baselines, methods=methods, sparsities=sparsities,
                        dejavu_budget=budget, dense_ops=args.dense_ops,
                        plain=args.plain)  # fmt: skip
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
