"""Tables and figures of the batched-decoding chapter (Deja Vu Appendix C.1; Polar Sparsity).

Reads what ``kernels/bench_engine.py --batch`` recorded (``results/engine_batch.json``) and
shapes it: tokens/s against the batch size, dense vs sparse, beside our speed targets; the
realised MLP and head unions beside what independent uniform sets predict; where a step's time
goes as the batch grows; and the CPU measurements of :mod:`dejavu_lab.engine.batch_quality`
(:func:`batch_quality`, :func:`batch_unions`) and the engine's union log
(:func:`union_sizes_table`) as tables.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import plotly.express as px

from .. import results
from ..engine.batch_quality import quality_rows, union_rows
from . import source

__all__ = [
    "PAPER",
    "TARGETS",
    "attention_sentence",
    "batch_quality",
    "batch_unions",
    "breakdown_figure",
    "columns_sentence",
    "load",
    "quality_sentence",
    "ratios_sentence",
    "targets_sentence",
    "uncapped_sentence",
    "union_sentence",
    "quality_table",
    "targets",
    "throughput_figure",
    "throughput_table",
    "time_shares",
    "union_figure",
    "union_sizes_table",
    "union_table",
]

NAME = "engine_batch"
#: the recording of the batched dense step over the columns layout beside cuBLAS's
COLUMNS_FILE = "engine_batch_columns_h100"
# Polar Sparsity (Shrestha et al. 2025): up to 2.2x end to end across batch sizes; Deja Vu
# Appendix C.1: union sparsity shrinks with B but stays sub-linear on OPT-175B.
PAPER = {"Polar Sparsity, across batch sizes": "up to 2.2x"}
# our speed targets: (model, prompt, batch) -> sparse / dense tokens per second at least
TARGETS = {("llama-3-8b", 2048, 16): 1.5, ("llama-3-8b", 2048, 32): 1.3,
           ("opt-30b", 512, 1): 2.0, ("opt-30b", 512, 4): 1.5}  # fmt: skip


def load(live: bool | None = None, *, models: str = "llama-3-8b,opt-30b",
         prompts: str = "512,2048", batches: str = "1,4,16,32", new_tokens: int = 16,
         name: str = NAME):  # fmt: skip
    """(rows, provenance, live): measure now when a GPU is here (``live=None``), with
    ``kernels/bench_engine.py --batch`` over ``models`` x ``prompts`` x ``batches`` (written to
    ``results/{name}_live.json``), else read the recorded run ``results/{name}.json``.

    >>> frame, prov, live = load(live=False)  # the recorded run, whatever machine this is
    >>> live, "gpu" in prov, {"batch", "check"} <= set(frame["kind"])
    (False, True, True)
    """
    import torch

    live = torch.cuda.is_available() if live is None else live
    if live:
        script = Path(__file__).resolve().parents[2] / "kernels" / "bench_engine.py"
        name += "_live"
        cmd = [sys.executable, str(script), "--batch", batches, "--models", models,
               "--prompts", prompts, "--new-tokens", str(new_tokens), "--no-check",
               "--name", name]  # fmt: skip
        subprocess.run(cmd, check=True)
    frame, prov = results.load(name)
    return frame, prov, live


def _runs(frame: pd.DataFrame) -> pd.DataFrame:
    r = frame[frame["kind"] == "batch"]
    if "error" in r:
        r = r[r["error"].isna()]
    return r.astype({"prompt": int, "batch": int})


def throughput_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Tokens/s per (model, prompt, batch): dense, sparse (capped, and the whole union where
    recorded), their ratios, dense over the columns layout against dense over the rows (cuBLAS)
    where recorded, and the GB each step reads.

    >>> frame = load(live=False)[0]
    >>> t = throughput_table(frame)
    >>> list(t.columns)[:3]
    ['dense tok/s', 'sparse tok/s', 'sparse / dense']
    >>> cols = frame[frame["engine"] == "dense"].assign(engine="dense_columns")
    >>> cols["tokens_per_s"] *= 1.1  # a dense step 1.1x faster over the columns
    >>> throughput_table(pd.concat([frame, cols]))["columns / dense"].round(6).unique().tolist()
    [1.1]
    """
    r = _runs(frame)
    tps = r.pivot_table(index=["model", "prompt", "batch"], columns="engine", values="tokens_per_s")
    gb = r.pivot_table(index=["model", "prompt", "batch"], columns="engine", values="bytes_total")
    out = pd.DataFrame(index=tps.index)
    out["dense tok/s"] = tps["dense"]
    out["sparse tok/s"] = tps["sparse"]
    out["sparse / dense"] = tps["sparse"] / tps["dense"]
    if "sparse_uncapped" in tps:
        out["whole union / dense"] = tps["sparse_uncapped"] / tps["dense"]
    if "dense_columns" in tps:  # the batch-1 engine's default dense step, batched
        out["columns / dense"] = tps["dense_columns"] / tps["dense"]
    out["dense GB/step"] = gb["dense"] / 1e9
    out["sparse GB/step"] = gb["sparse"] / 1e9
    out["bytes ratio"] = gb["dense"] / gb["sparse"]
    return out


def targets(frame: pd.DataFrame) -> pd.DataFrame:
    """Our speed targets beside the recorded ratios (NaN where the run has no such row).

    >>> targets(load(live=False)[0]).columns.tolist()
    ['target', 'measured', 'met']
    """
    t = throughput_table(frame)["sparse / dense"]
    rows = {k: {"target": v, "measured": t.get(k, float("nan"))} for k, v in TARGETS.items()}
    out = pd.DataFrame(rows).T
    out.index.names = ["model", "prompt", "batch"]
    out["met"] = out["measured"] >= out["target"]
    return out


def throughput_figure(frame: pd.DataFrame):
    """Tokens/s against the batch size, one panel per model, a line per engine and prompt.

    >>> throughput_figure(load(live=False)[0]).layout.xaxis.type
    'log'
    """
    r = _runs(frame).copy()
    # legend-sized names
    short = {
        "sparse": "capped union",
        "sparse_uncapped": "whole union",
        "dense_columns": "dense, columns",
    }
    r["engine"] = r["engine"].map(short).fillna(r["engine"])
    r["prompt"] = r["prompt"].astype(str)
    fig = px.line(r.sort_values("batch"), x="batch", y="tokens_per_s", color="engine",
                  line_dash="prompt", facet_col="model", markers=True, log_x=True,
                  labels={"batch": "batch size B", "tokens_per_s": "tokens / s"},
                  title="Decoding throughput against the batch size")  # fmt: skip
    fig.update_xaxes(tickvals=sorted(r["batch"].unique()))
    fig.update_yaxes(matches=None, showticklabels=True)
    # inside the first panel's empty upper left: beside the panels it is cut at the page width
    fig.update_layout(legend=dict(x=0.01, y=0.99, xanchor="left", yanchor="top", font_size=10,
                                  bgcolor="rgba(255,255,255,0.7)"))  # fmt: skip
    return fig


def union_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The realised unions of the sparse runs (mean over layers and steps) beside independent
    uniform sets of the same size, ``1 - (1 - p)^B``, and what the capped buffer reads.

    >>> t = union_table(load(live=False)[0])
    >>> "MLP union (measured)" in t.columns
    True
    """
    r = _runs(frame)
    r = r[r["engine"] == "sparse"].set_index(["model", "prompt", "batch"])
    keep_mlp, keep_heads = 1 - r["mlp_sparsity"], 1 - r["head_sparsity"]
    b = r.index.get_level_values("batch")
    return pd.DataFrame({
        "MLP union (measured)": r["mlp_union"],
        "MLP union (uniform sets)": 1 - (1 - keep_mlp) ** b,
        "MLP read (union budget)": r["mlp_read"],
        "heads union (measured)": r["heads_union"],
        "heads union (uniform sets)": 1 - (1 - keep_heads) ** b,
    })  # fmt: skip


def breakdown_figure(frame: pd.DataFrame, model: str, prompt: int):
    """ms of each part of the step over every layer (timed alone, CUDA graphs) per batch size,
    dense beside sparse: attention (projections and each sequence's cache), MLP, the unions.

    >>> fig = breakdown_figure(load(live=False)[0], "llama-3-8b", 2048)
    >>> sorted({t.name for t in fig.data}) == sorted({"attention", "MLP", "unions", "lm_head"})
    True
    """
    r = _runs(frame)
    r = r[(r["model"] == model) & (r["prompt"] == prompt) & r["engine"].isin(["dense", "sparse"])]
    parts = {"part_attention_ms": "attention", "part_mlp_ms": "MLP", "part_unions_ms": "unions",
             "part_lm_head_ms": "lm_head"}  # fmt: skip
    long = r.melt(id_vars=["engine", "batch"], value_vars=[p for p in parts if p in r],
                  var_name="part", value_name="ms").dropna()  # fmt: skip
    long["part"] = long["part"].map(parts)
    long["batch"] = "B = " + long["batch"].astype(str)
    fig = px.bar(long, x="batch", y="ms", color="part", facet_col="engine", barmode="stack",
                 title=f"Where a step's time goes ({model} shape, prompt {prompt})",
                 labels={"ms": "ms per step (parts timed alone)", "batch": ""})  # fmt: skip
    return fig


def union_sizes_table(rows: list[dict]) -> pd.DataFrame:
    """:meth:`BatchDecoder.union_sizes <dejavu_lab.engine.BatchDecoder.union_sizes>`'s rows as
    a table: ``step, layer, block, union, read, total, batch, live``.

    >>> t = union_sizes_table([{"step": 0, "layer": 0, "block": "mlp", "union": 96, "read": 128,
    ...                         "total": 256, "batch": 2, "live": 2}])
    >>> t[["block", "union", "read", "total"]].values.tolist()
    [['mlp', 96, 128, 256]]
    """
    return pd.DataFrame(rows)


def batch_quality(model, predictors, windows, **kwargs) -> pd.DataFrame:
    """Teacher-forced perplexity of each window decoded alone and in one batch of all windows,
    one row per (window, run): :func:`~dejavu_lab.engine.batch_quality.quality_rows` (same
    arguments) as a table.

    >>> import os
    >>> from unittest import mock
    >>> import torch
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> lm = random_model("tiny-llama", seed=0)
    >>> pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    >>> windows = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    >>> with mock.patch.dict(os.environ, TRITON_INTERPRET="0"):  # the kernels' references
    ...     t = batch_quality(lm.model, pred, windows, union_budgets=(None, 0.5))
    >>> sorted(t.run.unique())
    ['batch 1', 'batch 3', 'batch 3, union <= 50%', 'dense']
    >>> t.groupby("run").tokens.sum().tolist()  # 3 windows x 5 decode steps each
    [15, 15, 15, 15]
    """
    return pd.DataFrame(quality_rows(model, predictors, windows, **kwargs))


def batch_unions(model, predictors, windows, batch_sizes=(1, 2, 4, 8), **kwargs) -> pd.DataFrame:
    """The union the engine realises with DejaVu's predictors per batch size, one row per
    (batch_size, block, layer): :func:`~dejavu_lab.engine.batch_quality.union_rows` (same
    arguments) as a table.

    >>> import os
    >>> from unittest import mock
    >>> import torch
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> lm = random_model("tiny-llama", seed=0)
    >>> pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    >>> windows = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(0))
    >>> with mock.patch.dict(os.environ, TRITON_INTERPRET="0"):  # the kernels' references
    ...     u = batch_unions(lm.model, pred, windows, (1, 4), steps=2)
    >>> u.groupby(["block", "batch_size"]).union.mean().round(2).tolist()  # heads (3 of 4 at B = 1), MLP
    [0.75, ..., 0.5, ...]
    """
    rows = union_rows(model, predictors, windows, batch_sizes, **kwargs)
    return pd.DataFrame(rows, columns=["batch_size", "block", "layer", "union"])


def quality_table(quality: pd.DataFrame) -> pd.DataFrame:
    """Perplexity per window (rows) and run (columns), with the mean over windows; from
    :func:`batch_quality`.

    >>> q = pd.DataFrame({"window": [0, 0, 1, 1], "run": ["batch 1", "batch 2"] * 2,
    ...                   "perplexity": [30.0, 28.0, 40.0, 41.0]})
    >>> quality_table(q).loc["mean"].tolist()
    [35.0, 34.5]
    """
    t = quality.pivot(index="window", columns="run", values="perplexity")
    t.loc["mean"] = t.mean()
    order = sorted(t.columns, key=lambda c: (c != "dense", c != "batch 1", c))
    return t[order]


def time_shares(frame: pd.DataFrame, model: str, prompt: int) -> pd.DataFrame:
    """Each part's share of the parts' total (attention, MLP, unions, lm_head) per engine and
    batch size, and the attention part's bandwidth on what it reads (weights + KV cache).

    >>> t = time_shares(load(live=False)[0], "llama-3-8b", 2048)
    >>> t.columns.tolist()
    ['attention', 'MLP', 'unions', 'lm_head', 'attention TB/s']
    """
    r = _runs(frame)
    r = r[(r["model"] == model) & (r["prompt"] == prompt)].set_index(["engine", "batch"])
    parts = r[[c for c in ("part_attention_ms", "part_mlp_ms", "part_unions_ms",
                           "part_lm_head_ms") if c in r]].fillna(0.0)  # fmt: skip
    out = parts.div(parts.sum(axis=1), axis=0)
    out.columns = ["attention", "MLP", "unions", "lm_head"][: len(out.columns)]
    attn_bytes = r["bytes_attention"] + r["bytes_kv_cache"]
    out["attention TB/s"] = attn_bytes / (r["part_attention_ms"] * 1e-3) / 1e12
    return out


def union_figure(measured: pd.DataFrame, predicted: pd.DataFrame):
    """The MLP union the engine realised with DejaVu's predictors (:func:`batch_unions`) beside
    chapter 35's measurement on oracle sets (:func:`dejavu_lab.measure.union_sparsity`) and
    uniform random sets, mean over layers, as fractions of the layer's neurons.

    >>> m = pd.DataFrame({"batch_size": [1, 2], "block": "mlp", "layer": 0, "union": [0.5, 0.7]})
    >>> p = pd.DataFrame({"batch_size": [1, 2], "block": "mlp", "layer": 0,
    ...                   "union_sparsity": [0.5, 0.4], "uniform": [0.5, 0.25]})
    >>> sorted({t.name for t in union_figure(m, p).data})
    ['engine, predicted sets', 'oracle top-k sets (chapter 35)', 'uniform random sets']
    """
    m = measured[measured["block"] == "mlp"].groupby("batch_size")["union"].mean()
    p = predicted[predicted["block"] == "mlp"].groupby("batch_size")[["union_sparsity",
                                                                        "uniform"]].mean()  # fmt: skip
    long = pd.concat([
        pd.DataFrame({"batch_size": m.index, "union": m.values, "sets": "engine, predicted sets"}),
        pd.DataFrame({"batch_size": p.index, "union": 1 - p["union_sparsity"].values,
                      "sets": "oracle top-k sets (chapter 35)"}),
        pd.DataFrame({"batch_size": p.index, "union": 1 - p["uniform"].values,
                      "sets": "uniform random sets"}),
    ])  # fmt: skip
    fig = px.line(long, x="batch_size", y="union", color="sets", markers=True,
                  labels={"batch_size": "batch size B", "union": "MLP union (share of neurons)"},
                  title="The MLP union a batch asks for")  # fmt: skip
    fig.update_xaxes(tickvals=sorted(long["batch_size"].unique()))
    return fig


def _at(ratios: list[tuple[int, float]]) -> str:
    return source.listing([f"{r:.2f}× at B = {b}" for b, r in ratios])


def ratios_sentence(frame: pd.DataFrame, model: str, prompt: int, batches=(1, 16, 32)) -> str:
    """Sparse over dense tokens/s at ``model`` and ``prompt`` for the ``batches`` the run has.

    >>> ratios_sentence(load(live=False)[0], "llama-3-8b", 2048)
    'llama-3-8b shape, prompt 2048: ...× at B = 1, ...× at B = 16 and ...× at B = 32'
    >>> ratios_sentence(load(live=False)[0], "llama-3-8b", 999)
    'llama-3-8b shape, prompt 999: not in this run'
    """
    t = throughput_table(frame)
    have = [(b, float(t.loc[(model, prompt, b), "sparse / dense"])) for b in batches
            if (model, prompt, b) in t.index]  # fmt: skip
    return f"{model} shape, prompt {prompt}: " + (_at(have) if have else "not in this run")


def columns_sentence(name: str = COLUMNS_FILE) -> str:
    """The batched dense step over the columns layout through our kernels (the batch-1
    engine's default) against cuBLAS over the rows, at each batch size of the recording
    ``results/<name>.json``, and which one the batched engine therefore runs.

    >>> columns_sentence()
    "In results/engine_batch_columns_h100.json (recorded on NVIDIA H100 80GB HBM3, ..., measured at cab3d3e, ...): at the llama-3-8b shape, prompt 2048, dense over the columns through our kernels runs at ...× cuBLAS's tokens per second at B = 1 and ...× at B = 16: ..."
    >>> columns_sentence("no_such_recording")
    'The dense batch over the columns layout has no recording yet (results/no_such_recording.json).'
    """
    try:
        frame, prov = results.load(name)
    except results.ResultsError:
        return (
            f"The dense batch over the columns layout has no recording yet (results/{name}.json)."
        )
    t = throughput_table(frame)
    if "columns / dense" not in t:
        return f"results/{name}.json holds no dense_columns rows."
    parts = []
    for (model, prompt), g in t.groupby(level=["model", "prompt"], sort=False):
        r = {b: v for (_, _, b), v in g["columns / dense"].dropna().items()}
        lead = " cuBLAS's tokens per second"  # said once, at the first ratio
        ratios = source.listing([f"{v:.2f}×{lead if i == 0 else ''} at B = {b}"
                                 for i, (b, v) in enumerate(r.items())])  # fmt: skip
        slower = [b for b, v in r.items() if v <= 1]
        verdict = "faster at every batch size recorded" if not slower else (
            f"slower from B = {min(slower)}, so the batched engine keeps cuBLAS"
            + (" (one sequence alone decodes through the batch-1 Decoder, which takes our "
               "kernels)" if len(slower) < len(r) else ""))  # fmt: skip
        parts.append(f"at the {model} shape, prompt {prompt}, dense over the columns through "
                     f"our kernels runs at {ratios}: {verdict}")  # fmt: skip
    where = source.origin(prov, live=False, frame=frame)
    return f"In results/{name}.json ({where}): " + "; ".join(parts) + "."


def targets_sentence(frame: pd.DataFrame) -> str:
    """Each speed target the run has a row for: the measured ratio, met or missed, and what
    the bytes allow there.

    >>> targets_sentence(load(live=False)[0])
    'llama-3-8b, prompt 2048: ...× at B = 16 (target 1.5×, missed; the bytes allow ...×) and ...'
    """
    t, tt = targets(frame).dropna(subset=["measured"]), throughput_table(frame)
    if not len(t):
        return "This run has none of the targets' rows."
    parts = []
    for (model, prompt), g in t.groupby(level=["model", "prompt"], sort=False):
        each = []
        for (_, _, b), r in g.iterrows():
            allow = tt.loc[(model, prompt, b), "bytes ratio"]
            each.append(f"{r['measured']:.2f}× at B = {b} (target {r['target']:g}×, "
                        f"{'met' if r['met'] else 'missed'}; the bytes allow {allow:.2f}×)")  # fmt: skip
        parts.append(f"{model}, prompt {prompt}: " + source.listing(each))
    return "; ".join(parts) + "."


def uncapped_sentence(frame: pd.DataFrame) -> str:
    """The whole union (no cap) against dense at the largest batch of each model that ran it.

    >>> uncapped_sentence(load(live=False)[0])
    'Without the cap the step is ...× the dense one at B = 32 (llama-3-8b, prompt 2048) and ...'
    """
    tt = throughput_table(frame)
    if "whole union / dense" not in tt:
        return "This run has no uncapped rows."
    u = tt["whole union / dense"].dropna()
    if not len(u):
        return "This run has no uncapped rows."
    each = []
    for (model, prompt), g in u.groupby(level=["model", "prompt"], sort=False):
        b = g.index.get_level_values("batch").max()
        each.append(f"{g.loc[(model, prompt, b)]:.2f}× the dense one at B = {b} ({model}, "
                    f"prompt {prompt})")  # fmt: skip
    return "Without the cap the step is " + source.listing(each) + "."


def attention_sentence(shares: pd.DataFrame) -> str:
    """How the attention block's share of the sparse step and its bandwidth change from the
    smallest to the largest batch of :func:`time_shares`.

    >>> attention_sentence(time_shares(load(live=False)[0], "llama-3-8b", 2048))
    'The attention block grows from ...% of the sparse step at B = 1 to ...% at B = 32. At B = 32 it moves ... TB/s in the dense engine and ... TB/s in the sparse one.'
    """
    if "sparse" not in shares.index.get_level_values("engine"):
        return "This run has no timed parts of the sparse step."
    sp = shares.loc["sparse"]
    lo, hi = sp.index.min(), sp.index.max()
    text = (f"The attention block grows from {100 * sp.loc[lo, 'attention']:.0f}% of the sparse "
            f"step at B = {lo} to {100 * sp.loc[hi, 'attention']:.0f}% at B = {hi}.")  # fmt: skip
    if ("dense", hi) in shares.index:
        text += (f" At B = {hi} it moves {shares.loc[('dense', hi), 'attention TB/s']:.2f} TB/s in "
                 f"the dense engine and {sp.loc[hi, 'attention TB/s']:.2f} TB/s in the sparse one.")  # fmt: skip
    return text


def union_sentence(measured: pd.DataFrame | None, predicted: pd.DataFrame | None) -> str:
    """The demo model's MLP union at the largest batch: the engine's predicted sets beside
    oracle and random sets (:func:`union_figure`'s inputs), or why there is none.

    >>> m = pd.DataFrame({"batch_size": [1, 8], "block": "mlp", "layer": 0, "union": [0.5, 0.9]})
    >>> p = pd.DataFrame({"batch_size": [1, 8], "block": "mlp", "layer": 0,
    ...                   "union_sparsity": [0.5, 0.2], "uniform": [0.5, 0.004]})
    >>> union_sentence(m, p)
    'At B = 8 the union holds 90.0% of the neurons with the predicted sets, 80.0% with oracle sets and 99.6% with random sets.'
    >>> union_sentence(None, None)
    'The demo model did not load here, so its union was not measured.'
    """
    if measured is None or predicted is None:
        return "The demo model did not load here, so its union was not measured."
    um = measured[measured.block == "mlp"].groupby("batch_size").union.mean()
    pm = predicted[predicted.block == "mlp"].groupby("batch_size")[["union_sparsity",
                                                                    "uniform"]].mean()  # fmt: skip
    return (f"At B = {int(um.index[-1])} the union holds {100 * um.iloc[-1]:.1f}% of the neurons "
            f"with the predicted sets, {100 * (1 - pm['union_sparsity'].iloc[-1]):.1f}% with "
            f"oracle sets and {100 * (1 - pm['uniform'].iloc[-1]):.1f}% with random sets.")  # fmt: skip


def quality_sentence(quality: pd.DataFrame | None, heads_only: pd.DataFrame | None,
                     union_budget: float) -> str:  # fmt: skip
    """Mean perplexity alone, in the batch (whole union, capped union) and dense, and with
    only the heads sparse (:func:`batch_quality`'s tables), or why there is none.

    >>> q = pd.DataFrame({"window": [0] * 4, "perplexity": [30.0, 33.0, 32.0, 36.0],
    ...                   "run": ["dense", "batch 1", "batch 2", "batch 2, union <= 50%"]})
    >>> h = pd.DataFrame({"window": [0] * 2, "perplexity": [31.0, 31.0],
    ...                   "run": ["batch 1", "batch 2"]})
    >>> quality_sentence(q, h, 0.5)
    'Over 1 held-out windows, the mean perplexity is 33.0 alone and 32.0 in a batch of 2 with the whole union (dense: 30.0); with the union capped at the per-token budget it is 36.0. With only the heads sparse, the batch gives 31.00 against 31.00 alone.'
    """
    if quality is None or heads_only is None:
        return "The demo model did not load here, so the quality runs did not run."
    q, h = quality_table(quality).loc["mean"], quality_table(heads_only).loc["mean"]
    n = quality["window"].nunique()
    b = next(c for c in q.index if c.startswith("batch ") and c != "batch 1" and "," not in c)
    capped = f"{b}, union <= {union_budget:.0%}"
    text = (f"Over {n} held-out windows, the mean perplexity is {q['batch 1']:.1f} alone and "
            f"{q[b]:.1f} in a {b.replace('batch', 'batch of')} with the whole union (dense: "
            f"{q['dense']:.1f})")  # fmt: skip
    if capped in q:
        text += f"; with the union capped at the per-token budget it is {q[capped]:.1f}"
    return text + (f". With only the heads sparse, the batch gives {h[b]:.2f} against "
                   f"{h['batch 1']:.2f} alone.")  # fmt: skip
