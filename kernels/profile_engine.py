"""Where a decode step's time goes: per-kernel GPU times inside the CUDA graph.

``bench_engine.py`` times whole steps; this script replays a captured decode step under
``torch.profiler`` (CUPTI sees the kernels of a graph replay) and groups the GPU time by kernel,
so a missed speed target can be traced to the ops that miss it. For each model shape and
variant it reports, per decode step:

- each kernel's total time, its launch count and launches per layer;
- the sum of kernel times against the replay's wall time (the difference is idle GPU time
  between launches: launch latency and dependency stalls a fusion would remove);
- the bytes the step reads (:func:`dejavu_lab.engine.step_bytes`) over the measured copy
  ceiling — the floor — against both.

Random fp16 weights at real shapes (``dejavu_lab.bench.engine.build``), batch 1, prompt ``--prompt``,
DejaVu with fixed random kept sets (the predictors' kernels are listed under their own names
when ``--predictors`` is given), TEAL/WINA/CATS with thresholds calibrated on the prompt.
Writes ``results/engine_profile.json`` (``--name``) with provenance; prints one table per run.

    python kernels/profile_engine.py --models llama-2-13b,opt-30b --methods dense,dejavu,teal,cats
    python kernels/profile_engine.py --quick        # CPU plumbing check (no GPU timings)
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
from collections import defaultdict

import torch

from dejavu_lab import results
from dejavu_lab.bench.engine import SPARSITY, Variant, build, make_decoder, make_predictors
from dejavu_lab.bench.engine_int4 import int4_step_bytes
from dejavu_lab.bench.timing import copy_ceiling, cuda
from dejavu_lab.engine import SITES, SparseConfig, calibrate_thresholds, decoder_weights, step_bytes
from dejavu_lab.engine.int4 import quantize_head, quantize_weights

ROWS: list[dict] = []


def short(name: str) -> str:
    """A kernel's qualified name without template arguments, parameters or return type."""
    if name.startswith(("Memcpy", "Memset")):
        return " ".join(name.split()[:2])
    s, prev = name.replace("(anonymous namespace)", "anon"), None
    while prev != s:  # drop <...> groups, innermost first
        prev, s = s, re.sub(r"<[^<>]*>", "", s)
    s = s.split("(")[0].strip()
    return (s.split()[-1] if s else name)[:80]


def profile_step(dec, replays: int = 20) -> tuple[dict, float, float]:
    """Per-kernel {name: (us per step, launches per step, full name)}, replay wall us, kernel-sum us."""
    from torch.profiler import ProfilerActivity, profile

    # decode() replays the graph and runs what happens between replays (DejaVu's deferred-KV
    # flush every kv_window tokens), as generation does
    dec.decode(5)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dec.decode(replays)
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(replays)
        torch.cuda.synchronize()
    per, names = defaultdict(lambda: [0.0, 0]), {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            k = per[short(ev.name)]
            names.setdefault(short(ev.name), ev.name[:300])
            k[0] += ev.device_time_total
            k[1] += 1
    kernels = {n: (t / replays, c / replays, names[n]) for n, (t, c) in per.items()}
    return kernels, wall_us, sum(t for t, _, _ in kernels.values())


def run(
    preset: str,
    methods,
    sparsity: float,
    prompt: int,
    ceiling: float,
    device: str,
    with_predictors: bool,
    group: int | None = None,
    head: bool = False,
) -> None:
    model, arch = build(preset, device)
    vocab, d_embed = model.get_output_embeddings().weight.shape
    ms_, hs_ = SPARSITY[arch.family]
    preds = make_predictors(model, arch, device) if with_predictors else None
    w = decoder_weights(model, arch, layout="both" if {"teal", "wina"} & set(methods) else "rows",
                        release=True)  # fmt: skip
    ids = torch.randint(0, vocab, (1, prompt), device=device)
    for m in methods:
        if m == "dense":
            v = Variant("dense")
        elif m == "dejavu":
            v = Variant(
                "sparse", "dejavu", sparse=SparseConfig(ms_, hs_), predictors=preds is not None
            )
        else:
            v = Variant(m, m, sparsity=sparsity)
        thr = calibrate_thresholds(w, ids, sparsity, method=m) if m in SITES else None
        wm = w if group is None else quantize_weights(w, group, m)
        if group is not None and head:
            wm = quantize_head(wm, group)
        dec = make_decoder(v, wm, arch, prompt + 128, preds, None, thr)
        del wm
        dec.prefill(ids)
        kept = {}
        if m == "dejavu":
            kept = dict(mlp_kept=1 - ms_, head_kept=1 - hs_)
        elif m in SITES:
            kept = dict(site_kept=dict.fromkeys(SITES[m], 1 - sparsity))
        if group is not None and m in ("dense", "teal", "wina"):
            site = kept.get("site_kept", {})
            nbytes = int4_step_bytes(arch, vocab=vocab, context=prompt, group=group,
                                     kept=next(iter(site.values()), 1.0), d_embed=d_embed,
                                     head=head)  # fmt: skip
        else:
            i4 = {} if group is None else {"int4_group": group}
            nbytes = step_bytes(arch, vocab=vocab, context=prompt, d_embed=d_embed, **kept, **i4)
            nbytes = nbytes["total"]
        floor_us = nbytes / (ceiling * 1e12) * 1e6 if cuda() else float("nan")
        base = {
            "model": preset,
            "method": m,
            "weights": "fp16" if group is None else f"int4 g{group}" + (" + head" if head else ""),
            "prompt": prompt,
            "n_layers": arch.n_layers,
            "sparsity": sparsity if m in SITES else (ms_ if m == "dejavu" else 0.0),
            "bytes_per_step": nbytes,
            "floor_us": floor_us,
        }
        if not cuda():  # plumbing only: one eager step
            dec.step()
            ROWS.append({**base, "kind": "step", "wall_us": None})
            print(f"{preset} {m}: eager step ok (no GPU: no timings)")
            continue
        dec.capture()
        kernels, wall, ksum = profile_step(dec)
        ROWS.append(
            {
                **base,
                "kind": "step",
                "wall_us": wall,
                "kernel_sum_us": ksum,
                "idle_us": wall - ksum,
                "launches": sum(c for _, c, _ in kernels.values()),
                "of_floor": floor_us / wall,
            }
        )
        for name, (t, c, full) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
            ROWS.append(
                {
                    **base,
                    "kind": "kernel",
                    "kernel": name,
                    "full_name": full,
                    "us_per_step": t,
                    "launches": c,
                    "per_layer": c / arch.n_layers,
                    "share": t / wall,
                }
            )
        print_table(ROWS[-len(kernels) - 1 :])
        del dec
        gc.collect()
        torch.cuda.empty_cache()
    del model, w, preds
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def print_table(rows) -> None:
    s = rows[0]
    print(
        f"\n{s['model']} {s['weights']} {s['method']} (sparsity {s['sparsity']:.0%}), prompt {s['prompt']}: "
        f"step {s['wall_us']:.0f} us, kernels {s['kernel_sum_us']:.0f} us, idle "
        f"{s['idle_us']:.0f} us, {s['launches']:.0f} launches "
        f"({s['launches'] / s['n_layers']:.1f}/layer), floor {s['floor_us']:.0f} us "
        f"({s['of_floor']:.2f} of it)"
    )
    for r in rows[1:13]:
        print(
            f"  {r['kernel']:<58} {r['us_per_step']:8.1f} us {r['share']:6.1%} "
            f"{r['per_layer']:5.1f}/layer"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-2-13b,opt-30b")
    ap.add_argument("--methods", default="dense,dejavu,teal,cats")
    ap.add_argument("--sparsity", type=float, default=0.5, help="teal/wina/cats fraction dropped")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--predictors", action="store_true", help="DejaVu with its predictors")
    ap.add_argument(
        "--int4",
        type=int,
        default=None,
        metavar="GROUP",
        help="int4 layer matrices with this group size (dense, teal, wina, dejavu, cats)",
    )
    ap.add_argument("--head", action="store_true", help="with --int4: lm_head in int4 too")
    ap.add_argument("--name", default="engine_profile")
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check at a tiny shape")
    a = ap.parse_args(argv)
    models, methods = a.models.split(","), a.methods.split(",")
    device = "cuda" if cuda() else "cpu"
    if a.quick:
        models, a.prompt = ["tiny-llama"], 16
    elif not cuda():
        sys.exit("profile_engine.py times GPU kernels: run it on a GPU box (or pass --quick).")
    ceiling = copy_ceiling()
    for preset in models:
        run(preset, methods, a.sparsity, a.prompt, ceiling, device, a.predictors, a.int4, a.head)
    if not a.quick:
        results.save(a.name, ROWS, command=" ".join(sys.argv), extra={"copy_ceiling_tbps": ceiling})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
