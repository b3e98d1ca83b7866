"""The reusable half of ``kernels/bench_engine_int4.py``: what 4-bit weights and activation
sparsity each buy end to end, and what they buy together, on one engine.

For one model shape (random weights at a preset, quantised at build time) and one prompt,
:func:`bench_int4` times, each in CUDA-graph replay: the fp16 dense decoder (the engine's
default) and fp16 TEAL at each sparsity; the int4 dense decoder
(``Decoder(..., weights="int4")``) and int4 TEAL / WINA / DejaVu / CATS at each sparsity
(DejaVu: that share of the neurons and of the heads dropped, random kept sets per layer, as a
predictor's would be; CATS: thresholds calibrated on the prompt). Each row has its ms per
token, its bytes per token (:func:`int4_step_bytes` for int4 TEAL/WINA: codes of the rows read,
every group's scale and min, the KV cache and ``lm_head`` in fp16;
:func:`~dejavu_lab.step_bytes.step_bytes` with ``int4_group`` for DejaVu and CATS, whose kept
rows carry their own scales) and the fraction of the copy ceiling they reach; int4 rows add
their speedup over fp16 dense and over int4 dense. Before timing, int4 TEAL, DejaVu and CATS
with everything kept are checked against int4 dense, and int4 dense against fp16 dense (the
quantisation's own error, for the record). DejaVu and CATS run on their own copy of the int4
weights, ``W_QKV`` / ``W_in`` in the rows layout (:func:`~dejavu_lab.engine.int4.
quantize_weights`, laid out anew from the columns copy: the same numbers).
"""

from __future__ import annotations

import gc
import math

import torch

from ..engine import Decoder, SparseConfig, calibrate_thresholds, decoder_weights, keep_all
from ..engine.int4 import quantize_head, quantize_weights, random_int4_weights
from ..step_bytes import step_bytes
from .engine_variants import build
from .timing import cuda, relerr, timed

__all__ = ["bench_int4", "int4_step_bytes", "ms_per_token", "random_sets"]

SITES4 = ("attn_in", "o_in", "mlp_in", "down_in")  # TEAL/WINA's sites
ROWS = ("dejavu", "cats")  # the methods that read the rows layout of W_QKV / W_in


def int4_step_bytes(arch, *, vocab: int, context: int, group: int, kept: float = 1.0,
                    d_embed: int | None = None, head: bool = False) -> float:  # fmt: skip
    """Bytes per decode step with int4 layer matrices at ``kept`` of every TEAL site: half a
    byte per weight read, a 2-byte scale and min per ``group`` weights of every group (at
    50% kept nearly every group has a kept row), KV cache and ``lm_head`` in fp16 (``head``:
    ``lm_head`` in int4 too, with its scales and mins).

    >>> from types import SimpleNamespace
    >>> shape = SimpleNamespace(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_head=16,
    ...                         d_mlp=192, gated=True)
    >>> full = step_bytes(shape, vocab=128, context=8)  # fp16: 196608 bytes of weights
    >>> int4_step_bytes(shape, vocab=128, context=8, group=64) - full["kv_cache"] - full["lm_head"]
    55296.0
    """
    site = dict.fromkeys(SITES4, kept)
    elements = step_bytes(arch, vocab=0, context=0, site_kept=site, esize=1)
    every = step_bytes(arch, vocab=0, context=0, esize=1)
    fp16 = step_bytes(arch, vocab=vocab, context=context, d_embed=d_embed)
    read = elements["attention"] + elements["mlp"]
    weights = read * 0.5 + (every["attention"] + every["mlp"]) * 4 / group
    lm_head = fp16["lm_head"] / 4 + fp16["lm_head"] / group if head else fp16["lm_head"]
    return weights + fp16["kv_cache"] + lm_head


def ms_per_token(dec: Decoder, ids: torch.Tensor, new_tokens: int) -> dict:
    """ms per decoded token (CUDA-graph replay on a GPU) and the prefill's ms.

    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama").model, max_seq_len=8)  # wall clock on CPU
    >>> sorted(ms_per_token(dec, torch.tensor([[1, 2, 3]]), 3))
    ['ms_per_token', 'prefill_ms']
    """
    with torch.no_grad():
        dec.prefill(ids)  # warm-up: compiles, allocates the kernels' buffers
        prefill = timed(lambda: dec.prefill(ids))
        if cuda():
            dec.capture()
        ms = timed(lambda: dec.decode(new_tokens - 1))
    return {"ms_per_token": ms / (new_tokens - 1), "prefill_ms": prefill}


def random_sets(dec: Decoder, seed: int = 0) -> None:
    """Give a DejaVu decoder random kept neurons and heads in every layer (unsorted, as a
    predictor's top-k comes), for timing without predictors.

    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama", dtype=torch.float16).model, max_seq_len=8,
    ...               sparse=SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5))
    >>> random_sets(dec, seed=1)
    >>> dec.sets.mlp_idx.shape, bool((dec.sets.mlp_idx[0] != torch.arange(96)).any())
    (torch.Size([2, 96]), True)
    """
    g = torch.Generator().manual_seed(seed)
    for i in range(dec.arch.n_layers):
        mlp = torch.randperm(dec.arch.d_mlp, generator=g)[: dec.k_mlp]
        heads = torch.randperm(dec.H, generator=g)[: dec.k_heads]
        dec.set_indices(i, mlp=mlp, heads=heads)


def _logits(dec: Decoder, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n_prompt])]
        out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out).float()


def bench_int4(preset: str, *, prompt: int, new_tokens: int, group: int, sparsities, methods,
               device: str, ceiling: float, rows: list[dict], check_tokens=(32, 8),
               quiet: bool = False, int4_only: bool = False, head: bool = False,
               plain: bool = False, kv_window: int | None = None) -> None:  # fmt: skip
    """Time fp16 and int4 decoders of ``preset`` (see module doc) and append their rows
    (``check_tokens``: the checks' prompt and decoded tokens; ``quiet``: print nothing;
    ``int4_only``: int4 weights built without the fp16 model, :func:`~dejavu_lab.engine.int4.
    random_int4_weights`, for shapes fp16 cannot fit: no fp16 rows, no WINA; ``head``: also
    int4 dense and TEAL with ``lm_head`` in int4, weights ``"int4+head"``; ``plain``: also int4
    dense and TEAL on the plain step, each product finished by its own launch: rows of kind
    ``"plain"``, ``fused_over_plain`` the ratio of the speeds; ``kv_window``: DejaVu's deferred
    K/V window, :class:`~dejavu_lab.engine.SparseConfig`'s default when None).

    >>> rows = []
    >>> bench_int4("tiny-llama", prompt=4, new_tokens=3, group=64, sparsities=[0.5],
    ...            methods=["teal"], device="cpu", ceiling=float("nan"), rows=rows,
    ...            check_tokens=(4, 2), quiet=True)
    >>> [(r["weights"], r["engine"]) for r in rows if "ms_per_token" in r]
    [('fp16', 'dense'), ('fp16', 'teal'), ('int4', 'dense'), ('int4', 'teal')]
    """
    if int4_only:
        w, w4 = None, random_int4_weights(preset, group=group, device=device)
        arch, vocab = w4.arch, w4.embed.shape[0]
        methods = [m for m in methods if m != "wina"]  # WINA's column norms read fp16 weights
    else:
        model, arch = build(preset, device)
        vocab = model.config.vocab_size
        w = decoder_weights(model, arch, layout="columns")
        del model
        gc.collect()
        w4 = quantize_weights(w, group)
    ids = torch.randint(0, vocab, (1, prompt), device=device)
    ctx = prompt + new_tokens // 2  # the mean context over the decoded tokens
    base = {"model": preset, "prompt": prompt, "new_tokens": new_tokens, "group": group,
            "device": str(device)}  # fmt: skip
    say = (lambda *a: None) if quiet else print
    n_check, n_prompt = sum(check_tokens), check_tokens[0]
    check = torch.randint(0, vocab, (1, n_check), device=device)
    dense4 = _logits(Decoder(w4, max_seq_len=n_check + 1), check, n_prompt)
    teal_all = SparseConfig(method="teal", thresholds=keep_all(w4))
    keep_all4 = Decoder(w4, max_seq_len=n_check + 1, sparse=teal_all)
    keep_err = relerr(_logits(keep_all4, check, n_prompt), dense4)
    quant_err = math.nan
    if w is not None:
        quant_err = relerr(dense4, _logits(Decoder(w, max_seq_len=n_check + 1), check, n_prompt))
    held = {}  # one rows layout at a time: two would not fit beside Llama-3-70B on an 80 GB GPU

    def rows_of(m, base=w4):
        if m not in held:
            held.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            held[m] = quantize_weights(base, group, m)
        return held[m]

    everything = {"dejavu": SparseConfig(mlp_sparsity=0.0),
                  "cats": SparseConfig(method="cats", thresholds=keep_all(w4, "cats"))}  # fmt: skip
    keep_rows = {f"keep_all_{m}_vs_dense": relerr(_logits(
        Decoder(rows_of(m), max_seq_len=n_check + 1, sparse=everything[m]), check, n_prompt),
        dense4) for m in ROWS if m in methods}  # fmt: skip
    say(f"{preset}: int4 TEAL keep-all vs int4 dense {keep_err:.1e}; "
          f"int4 vs fp16 dense {quant_err:.1e} (the format's own error); "
          + "; ".join(f"{k} {v:.1e}" for k, v in keep_rows.items()))  # fmt: skip
    rows.append({**base, "kind": "check", "keep_all_vs_dense": keep_err, "int4_vs_fp16": quant_err,
                 **keep_rows})  # fmt: skip
    plan = [] if w is None else [("fp16", "dense", 0.0)] + [("fp16", "teal", s) for s in sparsities]
    plan += [("int4", "dense", 0.0)] + [("int4", m, s) for m in methods for s in sparsities]
    w4h = quantize_head(w4, group) if head else None
    if head:
        plan += [("int4+head", "dense", 0.0)]
        plan += [("int4+head", "teal", s) for s in sparsities if "teal" in methods]
    plan = [(*p, "fused") for p in plan]
    if plain:  # the same int4 steps with each product finished by its own launch
        plan += [("int4", "dense", 0.0, "plain")]
        plan += [("int4", "teal", s, "plain") for s in sparsities if "teal" in methods]
    times = {}
    for weights, method, sparsity, step in plan:
        row = {**base, "kind": "e2e" if step == "fused" else "plain", "weights": weights,
               "engine": method, "sparsity": sparsity}  # fmt: skip
        try:
            sparse = None
            if method == "dejavu":
                window = {} if kv_window is None else {"kv_window": kv_window}
                sparse = SparseConfig(mlp_sparsity=sparsity, head_sparsity=sparsity, **window)
                row["kv_window"] = sparse.kv_window
            elif method != "dense":
                thr = calibrate_thresholds(w if w is not None else w4, ids, sparsity, method=method)
                sparse = SparseConfig(method=method, thresholds=thr)
            four = rows_of(method) if method in ROWS else w4
            weights_of = {"int4": four, "int4+head": w4h}.get(weights, w)
            dec = Decoder(weights_of, max_seq_len=prompt + new_tokens, sparse=sparse)
            dec.fuse_epilogues = step == "fused"
            if method == "dejavu":
                random_sets(dec, seed=0)
            row.update(ms_per_token(dec, ids, new_tokens))
            del dec
        except Exception as exc:  # record and go on: one failure must not lose the run
            say(f"{preset} {weights} {method} {sparsity}: failed: {exc!r}")
            rows.append({**row, "error": repr(exc)[:300]})
            continue
        kept = 1.0 - sparsity
        if weights == "int4" and method in ROWS:
            sites = ({"mlp_kept": kept, "head_kept": kept} if method == "dejavu"
                     else {"site_kept": {"gate": kept}})  # fmt: skip
            nbytes = step_bytes(arch, vocab=vocab, context=ctx, int4_group=group, **sites)["total"]
        elif weights.startswith("int4"):
            nbytes = int4_step_bytes(arch, vocab=vocab, context=ctx, group=group, kept=kept,
                                     head=weights == "int4+head")  # fmt: skip
        else:
            site = dict.fromkeys(SITES4, kept)
            nbytes = step_bytes(arch, vocab=vocab, context=ctx, site_kept=site)["total"]
        ms = row["ms_per_token"]
        row.update(bytes_per_token=nbytes, tbps=nbytes / (ms * 1e-3) / 1e12)
        row["of_ceiling"] = row["tbps"] / ceiling
        if step == "plain":
            row["fused_over_plain"] = ms / times.get((weights, method, sparsity), math.nan)
            rows.append(row)
            say(f"{preset:>12} {weights} {method:>6} {sparsity:4.2f} plain step: {ms:8.3f} "
                f"ms/token ({row['fused_over_plain']:.3f}x the fused step's speed)")  # fmt: skip
            continue
        times[(weights, method, sparsity)] = ms
        if ("fp16", "dense", 0.0) in times:
            row["vs_fp16_dense"] = times[("fp16", "dense", 0.0)] / ms
        if weights.startswith("int4") and ("int4", "dense", 0.0) in times:
            row["vs_int4_dense"] = times[("int4", "dense", 0.0)] / ms
        rows.append(row)
        say(f"{preset:>12} {weights} {method:>6} {sparsity:4.2f}: {ms:8.3f} ms/token, "
              f"{row['tbps']:.2f} TB/s, x{row.get('vs_fp16_dense', float('nan')):.2f} over fp16 "
              f"dense")  # fmt: skip
    held.clear()
    del w, w4, w4h, rows_of
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()
