"""Tables and figures of the end-to-end decoding chapter (Deja Vu §5.1).

Reads what ``kernels/bench_engine.py`` recorded (``results/engine_e2e.json``) — or runs it live
on a GPU box — and shapes it: the latency table beside the paper's ratios, where a token's time
goes (attention, MLP, predictors, lm_head, overhead), and the bytes-per-token prediction
(:mod:`dejavu_lab.step_bytes`) beside the measured speedup.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import plotly.express as px

from .. import results
from ..models import PRESETS
from . import source

__all__ = [
    "PAPER",
    "breakdown",
    "breakdown_figure",
    "budgets_phrase",
    "fused_sentence",
    "gains_sentence",
    "latency_intro",
    "latency_table",
    "load",
    "method_table",
    "part_floors",
    "speedup_table",
    "summary",
]

# Deja Vu §5.1 (OPT-175B, 8x A100 80GB, fp16, batch 1, prompts 128-1024): ratios only, as reported.
PAPER = {"vs FasterTransformer": "1.8-2.0x", "vs Hugging Face": "4.8-6.0x"}
NAME = "engine_e2e"


def load(live: bool | None = None, models: str = "opt-6.7b", prompts: str = "128,512",
         methods: str = "dense,dejavu"):  # fmt: skip
    """(rows, provenance, live): measure now when a GPU is here (``live=None``), else read the
    recorded run. A live run writes ``results/engine_e2e_live.json`` via the benchmark script.

    >>> frame, prov, live = load(live=False)  # the recorded run, whatever machine this is
    >>> live, "gpu" in prov, sorted(set(frame["kind"]))
    (False, True, ['check', 'e2e', 'part'])
    """
    import torch

    live = torch.cuda.is_available() if live is None else live
    name = NAME
    if live:
        script = Path(__file__).resolve().parents[2] / "kernels" / "bench_engine.py"
        name = NAME + "_live"
        cmd = [sys.executable, str(script), "--models", models, "--prompts", prompts,
               "--parts-at", prompts.split(",")[-1], "--name", name, "--no-check",
               "--methods", methods]  # fmt: skip
        subprocess.run(cmd, check=True)
    frame, prov = results.load(name)
    return frame, prov, live


def _e2e(frame: pd.DataFrame) -> pd.DataFrame:
    e = frame[frame["kind"] == "e2e"]
    return e[e["error"].isna()] if "error" in e else e


def latency_table(frame: pd.DataFrame, model: str) -> pd.DataFrame:
    """ms per token by prompt length: HF (eager; compiled when recorded), dense, sparse, and the
    ratios, beside the paper's (§5.1).

    >>> t = latency_table(load(live=False)[0], "opt-6.7b")
    >>> t.index.name, list(t.columns)
    ('prompt', ['HF generate (ms)', 'HF compiled (ms)', 'dense engine (ms)', 'sparse engine (ms)',
                'sparse vs dense', 'sparse vs HF', 'sparse vs HF compiled',
                'paper vs FasterTransformer', 'paper vs Hugging Face'])
    """
    e = _e2e(frame)
    e = e[e["model"] == model]
    t = e.pivot_table(index="prompt", columns="engine", values="ms_per_token")
    t.index = t.index.astype(int)
    out = pd.DataFrame(index=t.index)
    for col, name in (("hf", "HF generate (ms)"), ("hf_compiled", "HF compiled (ms)"),
                      ("dense", "dense engine (ms)"), ("sparse", "sparse engine (ms)")):  # fmt: skip
        if col in t:
            out[name] = t[col]
    if {"dense", "sparse"} <= set(t):
        out["sparse vs dense"] = t["dense"] / t["sparse"]
    if {"hf", "sparse"} <= set(t):
        out["sparse vs HF"] = t["hf"] / t["sparse"]
    if {"hf_compiled", "sparse"} <= set(t):
        out["sparse vs HF compiled"] = t["hf_compiled"] / t["sparse"]
    for k, v in PAPER.items():
        out[f"paper {k}"] = v
    return out


def method_table(frame: pd.DataFrame, model: str, prompt: int) -> pd.DataFrame:
    """Every variant at one model and prompt (the gated-MLP methods beside DejaVu): ms per token,
    the ratios to our dense engine and to both HF baselines, GB read per step (at the target
    kept fractions) and that over the copy ceiling.

    >>> rows = [dict(kind="e2e", model="m", prompt=512, engine=e, sparsity=s, ms_per_token=t,
    ...              bytes_per_token=b, floor_ms=f)
    ...         for e, s, t, b, f in (("hf", 0, 30.0, 26e9, 6.2), ("hf_compiled", 0, 10.0, 26e9, 6.2),
    ...                               ("dense", 0, 8.5, 26e9, 6.2), ("teal", 0.5, 5.0, 13e9, 3.1))]
    >>> t = method_table(pd.DataFrame(rows), "m", 512)
    >>> t.loc[("teal", 0.5), ["vs dense", "vs HF compiled"]].round(2).tolist()
    [1.7, 2.0]
    """
    e = _e2e(frame)
    e = e[(e["model"] == model) & (e["prompt"] == prompt)].copy()
    if "sparsity" not in e:
        e["sparsity"] = 0.0
    e["sparsity"] = e["sparsity"].fillna(0.0)
    ms = e.set_index("engine")["ms_per_token"].groupby(level=0).first()
    out = pd.DataFrame({"ms per token": e["ms_per_token"].values,
                        "GB per step": e["bytes_per_token"].values / 1e9,
                        "/ its floor": (e["ms_per_token"] / e["floor_ms"]).values},
                       index=pd.MultiIndex.from_frame(e[["engine", "sparsity"]]))  # fmt: skip
    for ref, col in (("dense", "vs dense"), ("hf", "vs HF"), ("hf_compiled", "vs HF compiled")):
        out[col] = ms[ref] / out["ms per token"] if ref in ms else float("nan")
    return out


def breakdown(frame: pd.DataFrame, model: str) -> pd.DataFrame:
    """Where one token's time goes, dense vs sparse, at the prompt of the recorded breakdown.

    attention, MLP and lm_head are each timed alone over every layer (CUDA graph); predictors
    is the time they add to the step (sparse minus sparse with fixed sets: on a side stream
    most of their own time hides); overhead is the rest of the measured step (embedding,
    residual adds, stream joins, launch gaps between the parts).

    >>> b = breakdown(load(live=False)[0], "opt-6.7b")
    >>> list(b.columns), b[b.engine == "sparse"].part.tolist()
    (['engine', 'part', 'ms', 'prompt'], ['attention', 'mlp', 'lm_head', 'predictors', 'overhead'])
    """
    parts = frame[(frame["kind"] == "part") & (frame["model"] == model)]
    prompt = int(parts["prompt"].iloc[0])
    e = _e2e(frame)
    e = e[(e["model"] == model) & (e["prompt"] == prompt)].set_index("engine")["ms_per_token"]
    rows = []
    for engine in ("dense", "sparse"):
        p = parts[parts["engine"] == engine].set_index("part")["ms"]
        got = {k: p.get(k, 0.0) for k in ("attention", "mlp", "lm_head")}
        if engine == "sparse" and "sparse_fixed_sets" in e:
            got["predictors"] = max(e["sparse"] - e["sparse_fixed_sets"], 0.0)
        got["overhead"] = max(e[engine] - sum(got.values()), 0.0)
        rows += [{"engine": engine, "part": k, "ms": v, "prompt": prompt} for k, v in got.items()]
    return pd.DataFrame(rows)


def part_floors(frame: pd.DataFrame, model: str, ceiling: float) -> pd.DataFrame:
    """Each part's measured time beside its bytes over the copy ceiling (ms), dense and sparse.

    >>> frame, prov, _ = load(live=False)
    >>> t = part_floors(frame, "opt-6.7b", prov["copy_tbps"])  # the run's measured TB/s
    >>> list(t.index.names), list(t.columns)
    (['engine', 'part'], ['GB', 'floor (ms)', 'measured (ms)', 'measured / floor'])
    """
    b = breakdown(frame, model)
    prompt = int(b["prompt"].iloc[0])
    e = _e2e(frame)
    e = e[(e["model"] == model) & (e["prompt"] == prompt)].set_index("engine")
    key = {"attention": ["bytes_attention", "bytes_kv_cache"], "mlp": ["bytes_mlp"],
           "lm_head": ["bytes_lm_head"], "predictors": ["bytes_predictors"]}  # fmt: skip
    rows = []
    for _, r in b.iterrows():
        if r["part"] not in key:
            continue
        nbytes = sum(e.loc[r["engine"], k] for k in key[r["part"]])
        floor = nbytes / (ceiling * 1e12) * 1e3
        rows.append({"engine": r["engine"], "part": r["part"], "GB": nbytes / 1e9,
                     "floor (ms)": floor, "measured (ms)": r["ms"],
                     "measured / floor": r["ms"] / floor if floor else None})  # fmt: skip
    return pd.DataFrame(rows).set_index(["engine", "part"])


def breakdown_figure(frame: pd.DataFrame, models: list[str]):
    """Stacked bars: ms per token by part, dense vs sparse, one group per model.

    >>> fig = breakdown_figure(load(live=False)[0], ["opt-6.7b"])
    >>> [bar.name for bar in fig.data]  # one trace per part, stacked
    ['attention', 'mlp', 'predictors', 'lm_head', 'overhead']
    """
    df = pd.concat([breakdown(frame, m).assign(model=m) for m in models])
    fig = px.bar(df, x="engine", y="ms", color="part", facet_col="model", barmode="stack",
                 labels={"ms": "ms per token", "engine": ""},
                 category_orders={"part": ["attention", "mlp", "predictors", "lm_head",
                                           "overhead"]})  # fmt: skip
    fig.update_yaxes(matches=None, showticklabels=True)
    return fig


def speedup_table(frame: pd.DataFrame, prompt: int) -> pd.DataFrame:
    """Per model: bytes per token dense/sparse, the speedup they predict, the speedup measured,
    and achieved bandwidth as a share of the copy ceiling.

    >>> t = speedup_table(load(live=False)[0], prompt=512)
    >>> t.index.name, list(t.columns[:5])
    ('model', ['sparsity (MLP, heads)', 'dense GB/token', 'sparse GB/token', 'predicted speedup',
               'measured speedup'])
    """
    e = _e2e(frame)
    e = e[e["prompt"] == prompt].set_index(["model", "engine"])
    rows = []
    for model in e.index.get_level_values(0).unique():
        d, s = e.loc[(model, "dense")], e.loc[(model, "sparse")]
        rows.append({
            "model": model,
            "sparsity (MLP, heads)": f"{s['mlp_sparsity']:.0%}, {s['head_sparsity']:.0%}",
            "dense GB/token": d["bytes_per_token"] / 1e9,
            "sparse GB/token": s["bytes_per_token"] / 1e9,
            "predicted speedup": d["bytes_per_token"] / s["bytes_per_token"],
            "measured speedup": d["ms_per_token"] / s["ms_per_token"],
            "dense: of ceiling": d["of_ceiling"],
            "sparse: of ceiling": s["of_ceiling"],
            "dense / its floor": d["ms_per_token"] / d["floor_ms"],
            "sparse / its floor": s["ms_per_token"] / s["floor_ms"],
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("model")


def summary(frame: pd.DataFrame, model: str, prompt: int) -> pd.DataFrame:
    """Our headline ratios at one model and prompt, beside the paper's (§5.1).

    >>> s = summary(load(live=False)[0], "opt-6.7b", 512)
    >>> s.loc["sparse vs Hugging Face"].tolist()
    ['4.8-6.0x', '...x']
    """
    e = _e2e(frame)
    e = e[(e["model"] == model) & (e["prompt"] == prompt)].set_index("engine")
    d, s = e.loc["dense"], e.loc["sparse"]
    rows = {
        "sparse vs fast dense baseline": (f"{PAPER['vs FasterTransformer']} vs FasterTransformer",
                                          f"{d['ms_per_token'] / s['ms_per_token']:.2f}x vs our "
                                          "CUDA-graph dense engine"),
        "sparse vs Hugging Face": (PAPER["vs Hugging Face"],
                                   f"{e.loc['hf', 'ms_per_token'] / s['ms_per_token']:.2f}x"
                                   if "hf" in e.index else "not measured"),
        "sparse vs Hugging Face compiled": ("-",
                                            f"{e.loc['hf_compiled', 'ms_per_token'] / s['ms_per_token']:.2f}x"
                                            if "hf_compiled" in e.index else "not measured"),
        "dense baseline vs its bandwidth floor": ("-", f"{d['ms_per_token'] / d['floor_ms']:.2f}x"),
        "ideal speedup from bytes per token": ("-", f"{d['bytes_per_token'] / s['bytes_per_token']:.2f}x"),
    }  # fmt: skip
    return pd.DataFrame(
        rows, index=["paper (OPT-175B, 8x A100)", f"ours ({model}, prompt {prompt})"]
    ).T


def _budget(frame: pd.DataFrame, model: str) -> tuple[float, float] | None:
    s = _e2e(frame)
    s = s[(s["model"] == model) & (s["engine"] == "sparse")]
    if not len(s):
        return None
    return float(s["mlp_sparsity"].iloc[0]), float(s["head_sparsity"].iloc[0])


def budgets_phrase(frame: pd.DataFrame, models) -> str:
    """The sparse engine's budgets of ``models``, as run: models sharing a budget named together.

    >>> frame = load(live=False)[0]
    >>> budgets_phrase(frame, ["opt-6.7b", "opt-30b", "llama-2-13b"])
    'opt-6.7b and opt-30b at 85% MLP + 50% heads removed; llama-2-13b at 50% + 50%'
    >>> budgets_phrase(frame, ["opt-6.7b"])  # a live run of one model names only that one
    'opt-6.7b at 85% MLP + 50% heads removed'
    """
    groups: dict[tuple, list[str]] = {}
    for m in models:
        b = _budget(frame, m)
        if b is not None:
            groups.setdefault(b, []).append(m)
    parts = []
    for i, ((mlp, heads), ms) in enumerate(groups.items()):
        how = f"{mlp:.0%} MLP + {heads:.0%} heads removed" if i == 0 else f"{mlp:.0%} + {heads:.0%}"
        parts.append(f"{source.listing(ms)} at {how}")
    return "; ".join(parts)


def latency_intro(frame: pd.DataFrame, model: str, prov: dict, *, live: bool) -> str:
    """The sentence above the latency table: which model, which weights, where it was measured,
    and the sparse engine's budget there.

    >>> frame, prov, _ = load(live=False)
    >>> latency_intro(frame, "opt-30b", prov, live=False)
    'Per-token decode latency (ms) at the opt-30b shape with random fp16 weights, batch 1, recorded on NVIDIA H200, ... The sparse engine keeps 15% of the MLP neurons and 50% of the heads, as the paper does.'
    >>> latency_intro(frame, "facebook/opt-6.7b", {"gpu": "NVIDIA H200", "date": "2026-12-05"},
    ...               live=True)[:99]
    'Per-token decode latency (ms) of facebook/opt-6.7b with its own weights, batch 1, measured live on '
    """
    weights = (f"at the {model} shape with random fp16 weights" if model in PRESETS
               else f"of {model} with its own weights")  # fmt: skip
    text = (f"Per-token decode latency (ms) {weights}, batch 1, "
            f"{source.origin(prov, live=live, frame=frame)}.")  # fmt: skip
    b = _budget(frame, model)
    if b is not None:
        text += (f" The sparse engine keeps {1 - b[0]:.0%} of the MLP neurons and {1 - b[1]:.0%} "
                 "of the heads" + (", as the paper does." if b == (0.85, 0.5) else "."))  # fmt: skip
    return text


def gains_sentence(speed: pd.DataFrame) -> str:
    """Each model's measured speedup beside what its bytes allow (:func:`speedup_table`),
    largest model first; with several, whether the larger shapes gain more.

    >>> t = speedup_table(load(live=False)[0], prompt=512)
    >>> gains_sentence(t)
    'The opt-30b shape gains ...× (its bytes allow ...×), the llama-2-13b shape ...× (...×), ...'
    >>> gains_sentence(t.loc[["opt-6.7b"]])  # a live run of one model
    'Only the opt-6.7b shape ran: it gains ...× (its bytes allow ...×).'
    """
    if not len(speed):
        return "No model ran both engines here."
    s = speed.sort_values("dense GB/token", ascending=False)
    each = [f"the {m} shape {r['measured speedup']:.2f}× ({r['predicted speedup']:.2f}×)"
            for m, r in s.iterrows()]  # fmt: skip
    first = s.iloc[0]
    if len(s) == 1:
        return (f"Only the {s.index[0]} shape ran: it gains {first['measured speedup']:.2f}× "
                f"(its bytes allow {first['predicted speedup']:.2f}×).")  # fmt: skip
    head = (f"The {s.index[0]} shape gains {first['measured speedup']:.2f}× (its bytes allow "
            f"{first['predicted speedup']:.2f}×)")  # fmt: skip
    text = head + ", " + source.listing(each[1:]) + "."
    same = s[s["sparsity (MLP, heads)"] == first["sparsity (MLP, heads)"]]["measured speedup"]
    if len(same) > 1 and same.is_monotonic_decreasing:  # by bytes, at one budget
        mlp, heads = first["sparsity (MLP, heads)"].split(", ")
        text += (f" At {mlp} MLP + {heads} heads removed, the larger the shape, the more "
                 "sparsity pays: at small shapes the kernels are short, so fixed per-kernel "
                 "costs weigh more.")  # fmt: skip
    return text


def fused_sentence(fused: pd.DataFrame, fprov: dict, unfused: pd.DataFrame, uprov: dict,
                   model: str, prompt: int) -> str:  # fmt: skip
    """The fused DejaVu step beside the unfused one, each against the dense step of its own
    run (like with like: two recordings, two runs), with where each comes from.

    >>> f, fp = results.load("engine_e2e_fused")
    >>> u, up = results.load("engine_e2e")
    >>> fused_sentence(f, fp, u, up, "opt-30b", 512)
    "At the opt-30b shape, prompt 512, the fused step took ... ms per token, ...× faster than the dense step of its own run (results/engine_e2e_fused.json, recorded on ...); the unfused step ... ms, ...× faster than its run's dense step (results/engine_e2e.json, recorded on ...): the fused step is the slower."
    """

    def at(frame):
        e = _e2e(frame)
        e = e[(e["model"] == model) & (e["prompt"] == prompt)].set_index("engine")["ms_per_token"]
        if not {"sparse", "dense"} <= set(e.index):
            return None
        return e["sparse"], e["dense"] / e["sparse"]

    f, u = at(fused), at(unfused)
    if f is None or u is None:
        return f"The recordings have no fused and unfused step at {model}, prompt {prompt}."
    which = "slower" if f[1] < u[1] else "faster"
    return (f"At the {model} shape, prompt {prompt}, the fused step took {f[0]:.2f} ms per "
            f"token, {f[1]:.2f}× faster than the dense step of its own run "
            "(results/engine_e2e_fused.json, "
            f"{source.origin(fprov, live=False, frame=fused)}); the unfused step {u[0]:.2f} ms, "
            f"{u[1]:.2f}× faster than its run's dense step (results/engine_e2e.json, "
            f"{source.origin(uprov, live=False, frame=unfused)}): the fused step is the {which}.")  # fmt: skip
