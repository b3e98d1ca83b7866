"""Sparse decoding in batches end to end: tokens/s of B = 1..32 sequences, dense vs sparse.

The reusable half of ``python kernels/bench_engine.py --batch 1,4,8,16,32``. Random-weight fp16 models
at real shapes (OPT-30B, Llama-3-8B), one CUDA graph per batch size, per model and prompt:

- ``dense``  — :class:`dejavu_lab.engine.BatchDecoder` with every neuron and head;
- ``sparse`` — each sequence keeps its own random sets per layer (85% MLP + 50% heads removed
  on OPT, 50% + 50% on Llama; on GQA models the kept heads are whole KV groups, so a sequence's
  skipped heads skip their cache reads); the MLP reads the union of the live sequences' sets,
  capped by the union budget (``--union-budget``: 30% of the neurons on OPT, 50% on Llama), the
  union recomputed inside every step; ``W_QKV``/``W_O`` read the union of the heads, the
  attention kernel each sequence's own heads;
- ``sparse_uncapped`` — the same with no cap (the whole union, up to ``B k`` neurons), at each
  model's target prompt (``--uncapped-at``);
- ``dense_columns`` — ``dense`` over the ``"columns"`` layout with every op through our kernels
  (``dense_ops="triton"``: the batch-1 engine's default dense step, batched), timed last, after
  the weights are converted in place (``DecoderWeights.set_layout``); skipped when
  ``--dense-ops`` is given.

Every row records tokens/s (B tokens per step), the bytes a step reads (weights of the union,
each sequence's kept KV cache, ``lm_head``), the achieved bandwidth against the copy ceiling
measured in the same run, the realised union sizes (``BatchDecoder.union_sizes``), and the time
of each part of the step alone over every layer (attention, MLP, the unions, ``lm_head``; CUDA
graphs). Batch sizes whose KV cache does not fit in GPU memory are skipped with a printed
reason (a ``skip`` row). The timed steps start from the prompt length with the cache as it is
(``rewind(..., unchecked=True)``: a step reads the same bytes whatever the cache holds); the
correctness check at each model's real shape comes first: batched vs batch-1 logits (dense, and
per-sequence heads), graph replay vs eager steps. Results: ``results/engine_batch.json``.

    python kernels/bench_engine.py --batch 1,4,8,16,32 --models llama-3-8b,opt-30b \
        --prompts 512,2048 --name engine_batch
    python kernels/bench_engine.py --batch 1,4 --quick          # CPU plumbing check, tiny shapes
"""

from __future__ import annotations

import functools
import gc

import torch

from ..engine import BatchDecoder, Decoder, SparseConfig, decoder_weights
from ..engine.batch_quality import union_means
from .engine_variants import build, skipped_too_large
from .timing import cuda, graph_ms, relerr, timed

__all__ = [
    "SPARSITY",
    "TARGET_PROMPT",
    "UNION",
    "batch_bytes",
    "bench_model",
    "print_table",
]

SPARSITY = {"opt": (0.85, 0.5), "llama": (0.5, 0.5)}  # per sequence (MLP, heads) removed

UNION = {"opt": 0.3, "llama": 0.5}  # the union budget: fraction of MLP neurons a step reads

TARGET_PROMPT = {"opt": 512, "llama": 2048}  # the target prompts (sparse_uncapped runs there)


def _kept_sets(dec: BatchDecoder, B: int, seed: int = 0) -> None:
    """Random per-sequence sets for every layer; on GQA models whole KV groups of heads."""
    a, g = dec.arch, torch.Generator().manual_seed(seed)
    group = a.n_heads // a.n_kv_heads
    for i in range(a.n_layers):
        mlp = torch.stack([torch.randperm(a.d_mlp, generator=g)[: dec.k_mlp] for _ in range(B)])
        heads = []
        for _ in range(B):
            if group > 1 and dec.k_heads % group == 0:  # k_h / group whole groups
                kv = torch.randperm(a.n_kv_heads, generator=g)[: dec.k_heads // group]
                heads.append((kv[:, None] * group + torch.arange(group)).reshape(-1))
            else:
                heads.append(torch.randperm(a.n_heads, generator=g)[: dec.k_heads])
        dec.set_indices(i, mlp=mlp, heads=torch.stack(heads))


def batch_bytes(arch, *, vocab, d_embed, B, context, mlp_read=1.0, q_read=1.0, kv_read=1.0,
                cache_kept=1.0, esize=2) -> dict:  # fmt: skip
    """Bytes one batched step reads: the union's weight rows once for the batch (``q_read``:
    W_Q/W_O rows, ``kv_read``: W_K/W_V rows, ``mlp_read``: neurons), each sequence's kept share
    of its own KV cache (``cache_kept``), and ``lm_head``.

    >>> from types import SimpleNamespace
    >>> arch = SimpleNamespace(n_layers=2, d_model=8, d_mlp=32, d_head=4, n_heads=2, n_kv_heads=2,
    ...                        gated=False)
    >>> batch_bytes(arch, vocab=100, d_embed=8, B=1, context=10)
    {'attention': 1024.0, 'mlp': 2048.0, 'kv_cache': 640.0, 'lm_head': 1600, 'total': 5312.0}
    """
    L, d, n, dh = arch.n_layers, arch.d_model, arch.d_mlp, arch.d_head
    q_rows, kv_rows = arch.n_heads * dh, arch.n_kv_heads * dh
    parts = {
        "attention": L * (2 * q_rows * q_read + 2 * kv_rows * kv_read) * d * esize,
        "mlp": L * (3 if arch.gated else 2) * n * d * mlp_read * esize,
        "kv_cache": L * 2 * kv_rows * context * B * cache_kept * esize,
        "lm_head": vocab * d_embed * esize,
    }
    parts["total"] = sum(parts.values())
    return parts


def _fits(arch, prompt: int, new: int, window: int, reserve: float) -> int:
    """How many sequences' KV caches fit in the free GPU memory (every batch size on CPU)."""
    if not cuda():
        return 32
    per_seq = arch.n_layers * 2 * arch.n_kv_heads * (prompt + new + 2 + window) * arch.d_head * 2
    free = torch.cuda.mem_get_info()[0]
    return max(0, int((free - reserve) // per_seq))


def _forced(dec, prompts, cont) -> torch.Tensor:
    out = [dec.prefill(prompts)] + [dec.step(cont[:, t]).clone() for t in range(cont.shape[1])]
    return torch.stack(out, 1).float()


def _forced_alone(dec, prompt, cont) -> torch.Tensor:
    return torch.cat([dec.prefill(prompt[None])] + [dec.step(int(t)).clone() for t in cont]).float()


def _check(w, arch, base: dict, vocab: int, device: str, rows: list[dict]) -> None:
    """At the model's real shape: batched vs batch-1 logits (dense; sparse heads per sequence,
    MLP whole), and graph replays vs eager steps (sparse with the union), relative errors."""
    g = torch.Generator().manual_seed(1)
    lengths = (37, 64, 50, 21)
    prompts = [torch.randint(0, vocab, (n,), generator=g).to(device) for n in lengths]
    cont = torch.randint(0, vocab, (len(lengths), 6), generator=g).to(device)
    ms_, hs_ = base["mlp_sparsity"], base["head_sparsity"]
    row = {**base, "kind": "check"}
    dense = _forced(BatchDecoder(w, max_seq_len=80, max_batch=4), prompts, cont)
    alone = [_forced_alone(Decoder(w, max_seq_len=80), p, cont[b]) for b, p in enumerate(prompts)]
    row["dense_batch_vs_batch1"] = max(relerr(dense[b], a) for b, a in enumerate(alone))
    sp = SparseConfig(0.0, hs_)
    heads = BatchDecoder(w, max_seq_len=80, max_batch=4, sparse=sp)
    _kept_sets(heads, 4)
    got = _forced(heads, prompts, cont)
    errs = []
    for b, p in enumerate(prompts):
        one = Decoder(w, max_seq_len=80, sparse=sp)
        for i in range(arch.n_layers):
            one.set_indices(i, heads=heads.sets.seq_heads[i, b])
        errs.append(relerr(got[b], _forced_alone(one, p, cont[b])))
    row["heads_batch_vs_alone"] = max(errs)
    full = BatchDecoder(w, max_seq_len=80, max_batch=4, sparse=SparseConfig(ms_, hs_),
                        union_budget=base["union_budget"])  # fmt: skip
    _kept_sets(full, 4)
    eager = _forced(full, prompts, cont)
    if cuda():
        full.prefill(prompts)
        full.capture()
        replay = [full.step(cont[:, t]).clone() for t in range(cont.shape[1])]
        row["graph_vs_eager"] = relerr(torch.stack(replay, 1).float(), eager[:, 1:])
    row["check_ok"] = all(
        v < 3e-2 for k, v in row.items() if k.endswith(("_vs_batch1", "_vs_alone", "_vs_eager"))
    )
    rows.append(row)
    print("check", {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in row.items()})


def _time_variant(w, arch, engine, sparse, budget, prompt, batches, new, ceiling, base, vocab,
                 d_embed, dense_ops, rows: list[dict]) -> None:  # fmt: skip
    """One decoder of the largest batch; each batch size rewound, captured and timed."""
    dec = BatchDecoder(w, max_seq_len=prompt + new + 2, max_batch=max(batches), sparse=sparse,
                       union_budget=budget, dense_ops=None if sparse else dense_ops)  # fmt: skip
    if sparse is not None:
        _kept_sets(dec, max(batches))
    for B in batches:
        row = {**base, "kind": "batch", "engine": engine, "prompt": prompt, "batch": B,
               "union_budget": budget if sparse else None}  # fmt: skip
        try:
            dec.rewind([prompt] * B, unchecked=True)
            if cuda():
                dec.capture()
            dec.decode(2)  # warm-up (allocator, a first flush)
            dec.rewind([prompt] * B, unchecked=True)
            if cuda():
                dec.capture()  # the same graph again
            ms = timed(functools.partial(dec.decode, new)) / new
        except Exception as exc:  # record and go on: one failure must not lose the run
            print(f"{base['model']} {engine} prompt {prompt} B={B} failed: {exc!r}")
            rows.append({**row, "error": repr(exc)[:300]})
            continue
        row.update(ms_per_step=ms, tokens_per_s=B * 1e3 / ms, window=dec.W)
        kw = {}
        if sparse is not None:
            u = union_means(dec.union_sizes())
            row.update(mlp_union=u["mlp_union"], heads_union=u["heads_union"],
                       mlp_read=u["mlp_read"], heads_read=u["heads_read"])  # fmt: skip
            kw = dict(mlp_read=u["mlp_read"], q_read=u["heads_read"],
                      cache_kept=dec.k_heads / dec.H,
                      kv_read=u["heads_read"] if dec.W else 1.0)  # fmt: skip
        b = batch_bytes(arch, vocab=vocab, d_embed=d_embed, B=B, context=prompt + new // 2, **kw)
        row.update({f"bytes_{k}": v for k, v in b.items()})
        row["tbps"] = b["total"] / (ms * 1e-3) / 1e12
        row["of_ceiling"] = row["tbps"] / ceiling if ceiling == ceiling else None
        for part, fn in dec.parts().items():
            row[f"part_{part}_ms"] = graph_ms(fn)
        rows.append(row)
        print(f"{base['model']:>11} {engine:>15} prompt {prompt:5d} B={B:2d}: {ms:7.3f} ms/step "
              f"{row['tokens_per_s']:9.0f} tok/s {row['tbps']:.2f} TB/s"
              + (f" union mlp {row['mlp_union']:.0%} (read {row['mlp_read']:.0%}), heads "
                 f"{row['heads_union']:.0%}" if sparse is not None else ""))  # fmt: skip
    dec = None  # free its cache and graphs before the next variant
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def bench_model(preset, prompts, batches, new, ceiling, device, *, union_budget=None,
                uncapped_at=None, dense_ops=None, reserve=6e9, do_check=True, sparsity=None,
                rows: list[dict]) -> None:  # fmt: skip
    """Time ``dense``, ``sparse`` (and at the target prompt ``sparse_uncapped``) on ``preset`` at
    each prompt and batch size, appending one row per (variant, prompt, batch) to ``rows``; the
    correctness check first (``do_check``); batch sizes whose KV cache does not fit, and prompts
    past the model's positions, are recorded as ``skip`` rows. ``sparsity``: the (MLP, heads)
    fractions removed (default: the family's, :data:`SPARSITY`).

    >>> rows = []
    >>> bench_model("tiny-opt", [4096], [1], 4, float("nan"), "cpu", do_check=False, rows=rows)
    tiny-opt prompt 4096: skipped: prompt 4096 + 4 new tokens pass the model's 2048 positions
    >>> [r["kind"] for r in rows]
    ['skip']
    """
    if skipped_too_large(preset, device, rows):
        return
    model, arch = build(preset, device)
    vocab, d_embed = model.get_output_embeddings().weight.shape
    w = decoder_weights(model, arch, release=True)
    del model  # the engine's copies hold what a step reads
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()
    ms_, hs_ = sparsity or SPARSITY[arch.family]
    budget = union_budget if union_budget is not None else UNION[arch.family]
    base = {"model": preset, "family": arch.family, "mlp_sparsity": ms_, "head_sparsity": hs_,
            "union_budget": budget, "new_tokens": new}  # fmt: skip
    if do_check:
        try:
            _check(w, arch, base, vocab, device, rows)
        except Exception as exc:
            print(f"{preset} check failed: {exc!r}")
            rows.append({**base, "kind": "check", "error": repr(exc)[:300]})
    target = TARGET_PROMPT.get(arch.family) if uncapped_at is None else uncapped_at
    timed_prompts = []  # (prompt, batch sizes) timed over the rows layout
    for prompt in prompts:
        if prompt + new + 2 > w.max_positions:  # e.g. OPT's 2048 positions at prompt 2048
            reason = (
                f"prompt {prompt} + {new} new tokens pass the model's {w.max_positions} positions"
            )
            print(f"{preset} prompt {prompt}: skipped: {reason}")
            rows.append({**base, "kind": "skip", "prompt": prompt, "reason": reason})
            continue
        window = SparseConfig().kv_window
        n_fit = _fits(arch, prompt, new, window, reserve)
        run = [b for b in batches if b <= n_fit]
        for b in sorted(set(batches) - set(run)):
            reason = (f"the KV cache of {b} sequences of {prompt + new} tokens does not fit in "
                      f"the GPU memory left ({n_fit} would)")  # fmt: skip
            print(f"{preset} prompt {prompt} B={b}: skipped: {reason}")
            rows.append({**base, "kind": "skip", "prompt": prompt, "batch": b, "reason": reason})
        if not run:
            continue
        variants = [("dense", None, None), ("sparse", SparseConfig(ms_, hs_), budget)]
        if prompt == target:
            variants.append(("sparse_uncapped", SparseConfig(ms_, hs_), None))
        for engine, sparse, b in variants:
            _time_variant(w, arch, engine, sparse, b, prompt, run, new, ceiling, base, vocab,
                         d_embed, dense_ops, rows)  # fmt: skip
        timed_prompts.append((prompt, run))
    if timed_prompts and dense_ops is None:  # the columns layout, every op through our kernels
        w.set_layout("columns")  # in place, one matrix at a time: no second copy of the model
        for prompt, run in timed_prompts:
            _time_variant(w, arch, "dense_columns", None, None, prompt, run, new, ceiling, base,
                          vocab, d_embed, "triton", rows)  # fmt: skip
    del w
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    """Tokens/s per (model, prompt, batch): dense, sparse and the ratio, the bytes of a step, the
    attention's share of the parts, the MLP union, and dense over the columns layout against
    dense over the rows (``columns x``).

    >>> print_table([])  # doctest: +NORMALIZE_WHITESPACE
    <BLANKLINE>
    model prompt B dense tok/s sparse tok/s x uncapped x GB/step attn share mlp union columns x
    """
    by = {}
    for r in (r for r in rows if r.get("kind") == "batch" and "error" not in r):
        by.setdefault((r["model"], r["prompt"], r["batch"]), {})[r["engine"]] = r
    print(f"\n{'model':>11} {'prompt':>6} {'B':>3} {'dense tok/s':>11} {'sparse tok/s':>12} "
          f"{'x':>5} {'uncapped x':>10} {'GB/step':>8} {'attn share':>10} {'mlp union':>9} "
          f"{'columns x':>9}")  # fmt: skip
    for (m, p, b), e in sorted(by.items()):
        d, s, u, c = (e.get(k) for k in ("dense", "sparse", "sparse_uncapped", "dense_columns"))
        if d is None or s is None:
            continue
        x = s["tokens_per_s"] / d["tokens_per_s"]
        ux = f"{u['tokens_per_s'] / d['tokens_per_s']:10.2f}" if u else f"{'-':>10}"
        share = s["part_attention_ms"] / (s["part_attention_ms"] + s["part_mlp_ms"])
        print(f"{m:>11} {p:6d} {b:3d} {d['tokens_per_s']:11.0f} {s['tokens_per_s']:12.0f} "
              f"{x:5.2f} {ux} {s['bytes_total'] / 1e9:8.2f} {share:10.0%} "
              f"{s['mlp_union']:9.0%} "
              + (f"{c['tokens_per_s'] / d['tokens_per_s']:9.2f}" if c else f"{'-':>9}"))  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"error: {r.get('model')} {r.get('engine', r.get('kind'))}: {r['error'][:160]}")
