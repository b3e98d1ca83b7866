"""The reusable half of ``kernels/bench_engine.py``: batch-1 decoders at real shapes, timed
end to end against Hugging Face ``generate`` (Deja Vu §5.1).

The models, predictors and variants timed, and the decoder of each, come from
:mod:`dejavu_lab.bench.engine_variants` (:func:`build`, :func:`variants`, :class:`Variant`,
:func:`make_decoder`; importable from here as well). Before timing, each decoder's keep-all
logits are compared with the dense decoder's and its graph replays with its own eager steps;
:func:`bench_model` times every variant of one model into a list of result rows, each with the
bytes it reads and the bandwidth it reaches against the copy ceiling
(:func:`dejavu_lab.bench.timing.copy_ceiling`); :func:`print_table` prints them.
``kernels/bench_engine.py`` (argparse, the loop over models, ``results.save``) and
``kernels/profile_engine.py`` call these.
"""

from __future__ import annotations

import gc

import torch

from ..engine import (
    DENSE_ENGINES,
    SITES,
    Decoder,
    SparseConfig,
    calibrate_thresholds,
    decoder_weights,
    keep_all,
    step_bytes,
)
from ..kernels import pdl
from ..kernels.cats import mlp as cats_mlp_module  # its SPLIT_GATE switch
from .engine_variants import (
    LOWRANK,
    PLANNED,
    THRESHOLD,
    Variant,
    build,
    make_decoder,
    make_predictors,
    planned_config,
    skipped_too_large,
    variants,
)
from .timing import cuda, graph_ms, relerr, timed

__all__ = [
    "CHECK",
    "LOWRANK",
    "SPARSITY",
    "Variant",
    "bench_model",
    "choice_text",
    "build",
    "make_decoder",
    "make_predictors",
    "planned_config",
    "print_table",
    "variants",
]  # build, make_decoder, make_predictors, planned_config, variants, Variant and LOWRANK live
# in dejavu_lab.bench.engine_variants

SPARSITY = {"opt": (0.85, 0.5), "llama": (0.5, 0.5)}  # (MLP, heads) removed: §5.1; TEAL range
CHECK = (32, 8)  # the keep-all check: prompt tokens, then tokens decoded and compared


def _hf_row(model, ids, new_tokens: int, compiled: bool = False) -> dict:
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


def _engine_row(dec: Decoder, ids, new_tokens: int) -> dict:
    with torch.no_grad():
        dec.prefill(ids)  # warm-up (cuBLAS, allocator)
        prefill = timed(lambda: dec.prefill(ids))
        if cuda():
            dec.capture()
        ms = timed(lambda: dec.decode(new_tokens - 1))
    row = {"ms_per_token": ms / (new_tokens - 1), "prefill_ms": prefill}
    if dec.kernel_choice:  # the engine timed its kernels at the first capture
        row["kernel_choice"] = choice_text(dec.kernel_choice)
    return row


def choice_text(kc: dict) -> str:
    """One line for a decoder's timed kernel choice (:meth:`DecodeLoop._time_choices`).

    >>> choice_text({"chosen": {"topk_kernel": True, "down_mode": "tile"}, "ms": [5.0, 4.5],
    ...              "choices": [{"topk_kernel": False, "down_mode": "split"},
    ...                          {"topk_kernel": True, "down_mode": "tile"}]})
    'select/tile (torch.topk/split 5.000, select/tile 4.500 ms)'
    """

    def name(c):
        return f"{'select' if c['topk_kernel'] else 'torch.topk'}/{c['down_mode']}"

    timed_ = ", ".join(f"{name(c)} {ms:.3f}" for c, ms in zip(kc["choices"], kc["ms"], strict=True))
    return f"{name(kc['chosen'])} ({timed_} ms)"


def _parts_rows(dec: Decoder, base: dict) -> list[dict]:
    """Time each part of the step alone (all layers), captured in a CUDA graph when on a GPU."""
    return [{**base, "kind": "part", "part": part, "ms": graph_ms(fn)}
            for part, fn in dec.parts().items()]  # fmt: skip


def _pick_dense_ops(w, arch, ids, base: dict, rows: list[dict]) -> str:
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
        rows.append({**base, "kind": "op", "prompt": p, "op": op, "torch_ms": ms["torch"],
                     "triton_ms": ms["triton"], "picked": best})  # fmt: skip
        print(f"{base['model']:>12} dense op {op:>4}: torch {ms['torch']:.3f} ms, ours "
              f"{ms['triton']:.3f} ms (all layers) -> {best}")  # fmt: skip
    return ",".join(spec)


def _decode_logits(dec: Decoder, ids, n_prompt: int) -> torch.Tensor:
    """Logits of the last prompt position and of each following token fed one by one."""
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n_prompt])]
        out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out).float()


def _keep_all_check(v: Variant, w, arch, ids, ref, preds, dense_ops,
                   n_prompt: int = CHECK[0]) -> float:  # fmt: skip
    """relerr of this variant with everything kept against the dense decoder's logits."""
    if v.method == "dejavu":
        kv = Variant(v.engine, "dejavu", sparse=SparseConfig(0.0, 0.0))
    else:
        kv = v
    thr = keep_all(w, v.method) if v.method in THRESHOLD else None
    if v.method in PLANNED:
        thr, w, _, _ = planned_config(v, w, arch, ids, keep=True)
    dec = make_decoder(kv, w, arch, ids.shape[1] + 1, preds, dense_ops, thr)
    return relerr(_decode_logits(dec, ids, n_prompt), ref)


def _graph_check(dec: Decoder, ids) -> tuple[float, float]:
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
                dejavu_budget=None, dense_ops=None, plain=False, check_tokens=CHECK,
                lowrank=LOWRANK, rows: list[dict]) -> None:  # fmt: skip
    """Time every variant of ``methods`` (and the HF ``baselines``) on ``preset`` at each prompt,
    appending one row per (variant, prompt) to ``rows``: ms per token, prefill, the bytes a step
    reads and the bandwidth against ``ceiling`` (TB/s), the keep-all and graph checks, and at
    ``parts_at`` the time of each part of the step. A failure is recorded as a row with its
    ``error`` and the run goes on. LaRoSA and R-Sparse run at TEAL's bytes for each sparsity
    (:func:`planned_config`; ``lowrank``: R-Sparse's share of a site's kept bytes in factors).

    >>> import contextlib, io
    >>> rows = []
    >>> with contextlib.redirect_stdout(io.StringIO()):  # CPU: wall clock, plumbing only
    ...     bench_model("tiny-opt", [8], 4, 3, [8], "cpu", float("nan"), 8, baselines=(),
    ...                 methods=("dense",), check_tokens=(8, 3), rows=rows)
    >>> sorted({r["kind"] for r in rows}), [r["check_ok"] for r in rows if r["kind"] == "e2e"]
    (['e2e', 'part'], [True])
    """
    if skipped_too_large(preset, device, rows):
        return
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
                row.update(_hf_row(model, ids, hf_new, compiled=name == "hf_compiled"))
            except Exception as exc:  # e.g. a torch.compile failure: record it, go on
                print(f"{preset} {name} prompt {p} failed: {exc!r}")
                rows.append({**row, "error": repr(exc)[:300]})
                continue
            rows.append(_bw(row, prompt=p, **bw))
            print(_fmt(row))
    torch._dynamo.reset()  # drop HF's compiled graphs and their memory before our weights
    gc.collect()
    torch.cuda.empty_cache() if cuda() else None
    w = decoder_weights(model, arch, release=True)  # the model is not run again
    check_ids = torch.randint(0, vocab, (1, sum(check_tokens)), device=device)
    ref = _decode_logits(Decoder(w, max_seq_len=sum(check_tokens) + 1, dense_ops=dense_ops),
                        check_ids, check_tokens[0])  # fmt: skip
    for v in variants(methods, sparsities, (ms_, hs_), preds):
        if v.columns and w.layout == "rows":
            w.set_layout("columns")  # TEAL/WINA read W_QKV^T and W_in^T (one copy at a time)
            torch.cuda.empty_cache() if cuda() else None
        if v.ops == "auto":
            p = parts_at if parts_at in prompts else prompts[-1]
            ids = torch.randint(0, vocab, (1, p), device=device)
            v.ops = _pick_dense_ops(w, arch, ids, base, rows)
        try:
            keep_err = _keep_all_check(
                v, w, arch, check_ids, ref, preds, dense_ops, check_tokens[0]
            )
        except Exception as exc:
            print(f"{preset} {v.engine} keep-all check failed: {exc!r}")
            rows.append({**base, "kind": "e2e", "engine": v.engine, "error": repr(exc)[:300]})
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
                thr, wv, extra = None, w, 0
                if v.method in THRESHOLD:
                    thr = calibrate_thresholds(w, ids, v.sparsity, method=v.method)
                elif v.method in PLANNED:  # at TEAL's bytes: rotated weights, or factors
                    thr, wv, site_kept, extra = planned_config(v, w, arch, ids, lowrank=lowrank)
                    row["lowrank_bytes"] = extra
                dec = make_decoder(v, wv, arch, p + new_tokens, preds, dense_ops, thr)
                row["dense_ops"] = ",".join(f"{op}={how}" for op, how in dec.ops.items())
                row["layout"] = dec.w.layout  # which step ran
                row.update(_engine_row(dec, ids, new_tokens))
                if plain and dec.fuse_epilogues:  # the unfused step (DejaVu: its plain loop)
                    dec.fuse_epilogues = False
                    row["plain_ms_per_token"] = _engine_row(dec, ids, new_tokens)["ms_per_token"]
                    dec.fuse_epilogues = True
                    on, pdl.PDL = pdl.PDL, False  # each kernel launched after the last ends
                    row["no_pdl_ms_per_token"] = _engine_row(dec, ids, new_tokens)["ms_per_token"]
                    pdl.PDL = on
                    if v.method == "cats":  # the gate through cuBLAS, as before the split
                        cats_mlp_module.SPLIT_GATE = False
                        ms = _engine_row(dec, ids, new_tokens)["ms_per_token"]
                        row["cublas_gate_ms_per_token"] = ms
                        cats_mlp_module.SPLIT_GATE = True
                    if dec.fuse_hidden and v.method in THRESHOLD:  # its own saving
                        dec.fuse_hidden = False
                        ms = _engine_row(dec, ids, new_tokens)["ms_per_token"]
                        row["hidden_unfused_ms_per_token"] = ms
                        dec.fuse_hidden = True
                if cuda():
                    row["graph_vs_eager"], row["eager_vs_eager"] = _graph_check(dec, ids)
            except Exception as exc:  # record and go on: one failure must not lose the run
                print(f"{preset} {v.engine} prompt {p} failed: {exc!r}")
                rows.append({**row, "error": repr(exc)[:300]})
                continue
            kept = dict(mlp_kept=1.0, head_kept=1.0, predictors=0, site_kept=None)
            if v.method == "dejavu":
                kept.update(mlp_kept=1 - ms_, head_kept=1 - hs_,
                            predictors=pred_bytes if v.predictors else 0)  # fmt: skip
            elif v.method in PLANNED:  # R-Sparse's factors: extra bytes, as the predictors'
                kept.update(site_kept=site_kept, predictors=extra)
            elif v.method in SITES:
                kept["site_kept"] = dict.fromkeys(SITES[v.method], 1 - v.sparsity)
            rows.append(_bw(row, prompt=p, **kept, **bw))
            print(_fmt(row))
            if p == parts_at and v.engine in (*DENSE_ENGINES, "sparse", "teal", "cats", *PLANNED):
                rows.extend(_parts_rows(dec, {**base, "engine": v.engine, "prompt": p,
                                             "sparsity": v.sparsity}))  # fmt: skip
            del dec, wv
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


def print_table(rows: list[dict], ceiling: float) -> None:
    """One line per (model, prompt, variant): ms/token, ratios, GB/step, floor, checks.

    >>> print_table([], 4.0)  # doctest: +ELLIPSIS
    <BLANKLINE>
    copy ceiling 4.00 TB/s; x = ratio of ms per token (higher: this variant is faster); ...
    """
    e2e = [r for r in rows if r.get("kind") == "e2e" and "error" not in r]
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
    for (m, p), group in sorted(by.items()):
        eng = {r["engine"]: r for r in group}
        best = min((r for r in group if r["engine"] in DENSE_ENGINES),
                   key=lambda r: r["ms_per_token"], default=None)  # fmt: skip

        def x(ref, r, w):
            ok = ref is not None and ref is not r
            return f"{ref['ms_per_token'] / r['ms_per_token']:{w}.2f}" if ok else f"{'-':>{w}}"

        for r in group:
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
    bad = [r for r in rows if r.get("check_ok") is False]
    if bad:
        print(f"keep-all check FAILED for: {sorted({(r['model'], r['engine']) for r in bad})}")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"error: {r.get('model')} {r.get('engine')}: {r['error'][:160]}")
