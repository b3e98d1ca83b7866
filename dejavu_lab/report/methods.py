"""GPU time per token of every sparsity method in our engine (the gated-MLP chapter's speed side).

:func:`load_engine_methods` reads ``results/engine_methods.json`` (recorded by
``kernels/bench_engine.py``) or measures live on a GPU box; :func:`engine_methods_table` puts
each method beside our dense engine, compiled Hugging Face and the bytes' floor;
:func:`engine_figure` draws it. Chapter 42 shows these; the quality side is
:mod:`dejavu_lab.report.gated`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import results
from ..engine.config import DENSE_ENGINES
from ..vocab import METHODS
from .engine import method_table
from .plots import COLORS, wrap_caption

__all__ = ["DENSE_ENGINES", "ENGINE_ARGS", "ENGINE_NAME", "KEEPALL_NAME", "LABELS",
           "engine_figure", "engine_methods_table", "keepall_table", "load_engine_methods",
           "repeat_table"]  # fmt: skip

# results/engine_methods.json: repeat 0 is the run with the HF baselines; repeats 1, 2, ... the
# same run again in fresh processes (new random weights, no HF baselines; bench_engine.py
# --repeat), for the ratios' spread from run to run
ENGINE_NAME = "engine_methods"
# our dense steps: cuBLAS GEMVs, row-gather kernels, TEAL's threshold kernels with every column
# read, the faster of torch and ours per op
KEEPALL_NAME = "engine_keepall"  # dense, and TEAL / CATS at 0% and 50%, in one run
# the recorded run's arguments (its provenance "command"), for a live rerun on a GPU box
ENGINE_ARGS = ["--models", "llama-2-13b,llama-3-8b", "--prompts", "512", "--methods",
               "dense,dense_columns,dense_auto,dejavu,teal,wina,cats", "--sparsity", "0.4,0.5",
               "--baselines", "hf_compiled,hf", "--plain"]  # fmt: skip


def load_engine_methods(live: bool | None = None):
    """(rows, provenance, live) of the engine's per-method run: measured now on a GPU box
    (``live=None`` and CUDA present: ``kernels/bench_engine.py`` with the recorded run's
    arguments, a few minutes), else read from ``results/engine_methods.json``.

    >>> frame, prov, live = load_engine_methods(live=False)
    >>> live, prov["gpu"], sorted(set(frame.loc[frame.kind == "e2e", "model"]))
    (False, 'NVIDIA H200', ['llama-2-13b', 'llama-3-8b'])
    """
    live = torch.cuda.is_available() if live is None else live
    name = ENGINE_NAME
    if live:
        script = Path(__file__).resolve().parents[2] / "kernels" / "bench_engine.py"
        name = ENGINE_NAME + "_live"
        cmd = [sys.executable, str(script), *ENGINE_ARGS, "--no-check", "--name", name]
        subprocess.run(cmd, check=True)
    frame, prov = results.load(name)
    if "repeat" in frame:  # the first run: the one with the HF baselines
        frame = frame[frame["repeat"] == 0].drop(columns="repeat").reset_index(drop=True)
    return frame, prov, live


LABELS = {
    "hf": "HF generate",
    "hf_compiled": "HF generate, compiled",
    "dense": "dense (ours, cuBLAS GEMVs)",
    "dense_triton": "dense (ours, row-gather kernels)",
    "dense_columns": "dense (ours, TEAL's kernels, all kept: the default)",
    "dense_auto": "dense (ours, tuned ops)",
    "sparse": "DejaVu",
    "sparse_untuned": "DejaVu, kernels not timed (torch.topk, split down)",
    "sparse_select_kernel": "DejaVu, kept sets by our select kernel",
    "sparse_torch_topk": "DejaVu, kept sets by torch.topk",
    "sparse_torch_scores": "DejaVu, predictor scores by PyTorch ops",
    "sparse_side_priority_0": "DejaVu, predictors' stream at default priority",
    "sparse_down_tile": "DejaVu, down projections by the one-tile kernel",
    "sparse_fixed_sets": "DejaVu, sets given (no predictors)",
    "sparse_fixed_sets_down_split": "DejaVu, sets given, down projections by the split kernel",
    "sparse_inline_predictors": "DejaVu, predictors inline",
    "teal": "TEAL",
    "wina": "WINA",
    "cats": "CATS",
    "larosa": "LaRoSA (o_in rotated, TEAL's kernels)",
    "rsparse": "R-Sparse (TEAL's kernels + low rank)",
}


def _budget(r) -> str:
    if r.engine.startswith("sparse"):
        return f"MLP {r.mlp_sparsity:.0%} · heads {r.head_sparsity:.0%}"
    if r.engine in METHODS and METHODS[r.engine].input_sparse:
        return f"{r.sparsity:.0%} of every input"
    if r.engine in METHODS and METHODS[r.engine].family == "topk":
        return f"{r.sparsity:.0%} of every input's bytes"
    if r.engine == "cats":
        return f"MLP {r.sparsity:.0%}"
    return "dense"


def _timed(frame: pd.DataFrame) -> pd.DataFrame:
    """The end-to-end rows of a recording that timed without an error."""
    e = frame[frame.kind == "e2e"]
    return e[e.error.isna()] if "error" in e else e


def engine_methods_table(frame: pd.DataFrame, prompt: int = 512) -> pd.DataFrame:
    """Every engine variant per model: ms per token, the ratio to our dense engine (cuBLAS
    GEMVs: what our speed targets are set against) and to the fastest of our dense steps in the run
    (:data:`DENSE_ENGINES`), to compiled Hugging Face ``generate``, the floor ratio (dense bytes
    per step / its bytes: the speedup the bytes allow) and the measured time over its own floor.

    >>> t = engine_methods_table(load_engine_methods(live=False)[0])
    >>> t.columns.tolist()
    ['model', 'engine', 'method', 'budget', 'ms per token', 'vs dense', 'vs best dense', 'vs HF compiled', 'floor ratio', '/ its floor']
    >>> t.loc[(t.model == "llama-3-8b") & (t.engine == "dense"), "vs dense"].item()
    1.0
    >>> bool((t["vs best dense"] <= t["vs dense"] + 1e-12).all())  # the best is never slower
    True
    """
    e = _timed(frame)
    e = e[e.prompt == prompt].copy()
    e["sparsity"] = e["sparsity"].fillna(0.0) if "sparsity" in e else 0.0
    out = []
    for model in dict.fromkeys(e.model):
        t = method_table(frame, model, prompt).reset_index()
        meta = e[e.model == model][["engine", "sparsity", "mlp_sparsity", "head_sparsity"]]
        t = t.merge(meta, on=["engine", "sparsity"], how="left")
        dense_gb = float(t.loc[t.engine == "dense", "GB per step"].iloc[0])
        t["floor ratio"] = dense_gb / t["GB per step"]
        best = float(t.loc[t.engine.isin(DENSE_ENGINES), "ms per token"].min())
        t["vs best dense"] = best / t["ms per token"]
        t["model"] = model
        t["method"] = t.engine.map(LABELS).fillna(t.engine)
        t["budget"] = [_budget(r) for r in t.itertuples()]
        out.append(t)
    cols = ["model", "engine", "method", "budget", "ms per token", "vs dense", "vs best dense",
            "vs HF compiled", "floor ratio", "/ its floor"]  # fmt: skip
    return pd.concat(out, ignore_index=True)[cols]


def engine_figure(table: pd.DataFrame, caption: str, skip=("hf",)) -> go.Figure:
    """ms per token per method (bars, labelled with the ratio to our dense engine) beside each
    one's bytes floor (markers), one panel per model.

    ``skip``: engines left out of the figure (default the eager HF loop, off the scale; the
    table has it).

    >>> t = engine_methods_table(load_engine_methods(live=False)[0])
    >>> fig = engine_figure(t, "Recorded.")
    >>> len(fig.data), fig.data[0].name  # per model: bars and floors
    (4, 'ms per token')
    """
    models = list(dict.fromkeys(table.model))
    fig = make_subplots(
        rows=1, cols=len(models), subplot_titles=models, shared_yaxes=True, horizontal_spacing=0.04
    )
    for c, model in enumerate(models, start=1):
        t = table[(table.model == model) & ~table.engine.isin(skip)]
        labels = [
            f"{m} · {b}" if b != "dense" else m for m, b in zip(t.method, t.budget, strict=True)
        ]
        floor = t["ms per token"] / t["/ its floor"]
        fig.add_trace(
            go.Bar(
                y=labels,
                x=t["ms per token"],
                orientation="h",
                name="ms per token",
                showlegend=c == 1,
                marker_color=[
                    COLORS.get(e.split("_")[0].replace("sparse", "dejavu"), "#17becf")
                    for e in t.engine
                ],
                text=[f"{v:.2f}× dense" for v in t["vs dense"]],
                textposition="outside",
                hovertemplate="%{y}<br>%{x:.2f} ms per token<extra></extra>",
            ),
            row=1,
            col=c,
        )
        fig.add_trace(
            go.Scatter(
                y=labels,
                x=floor,
                mode="markers",
                name="its bytes floor (bytes / copy ceiling)",
                showlegend=c == 1,
                marker=dict(symbol="line-ns-open", size=18, color="black", line=dict(width=2)),
                hovertemplate="floor %{x:.2f} ms<extra></extra>",
            ),
            row=1,
            col=c,
        )
    top = float(table.loc[~table.engine.isin(skip), "ms per token"].max()) * 1.35
    fig.update_xaxes(title_text="ms per generated token", range=[0, top])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=580, margin=dict(t=100, b=170, l=260, r=20), barmode="overlay",
                      legend=dict(orientation="h", y=1.16, x=1, xanchor="right"))  # fmt: skip
    # under the plots, whose left edge sits after the 260-px label margin: lines of 80 characters
    # fit the book's page width (120 ran past the figure's right edge)
    fig.add_annotation(text=wrap_caption(caption.replace("<br>", " "), 80), xref="paper",
                       yref="paper", x=0, y=-0.2, yanchor="top", showarrow=False,
                       font=dict(size=9), xanchor="left", align="left")  # fmt: skip
    return fig


def keepall_table(name: str = KEEPALL_NAME) -> tuple[pd.DataFrame, dict]:
    """(table, provenance): per model, the dense engine (cuBLAS GEMVs), TEAL's and CATS's
    kernels with every entry kept (0%: thresholds below every activation) and at 50%, in ms per
    token from one run, and each sparse step's ratio to the dense engine and to its own kernels
    at 0% — the speedup that the skipped bytes alone buy.

    >>> t, prov = keepall_table()
    >>> bool(t.loc["llama-3-8b", "TEAL 0% (ms)"] < t.loc["llama-3-8b", "dense (ms)"])
    True
    """
    frame, prov = results.load(name)
    e = _timed(frame)
    rows = {}
    for model, g in e.groupby("model", sort=False):
        ms = {
            (r.engine, round(float(r.sparsity or 0.0), 2)): r.ms_per_token for r in g.itertuples()
        }
        dense = ms[("dense", 0.0)]
        row = {"dense (ms)": dense}
        for m, label in (("teal", "TEAL"), ("cats", "CATS")):
            row[f"{label} 0% (ms)"] = ms[(m, 0.0)]
            row[f"{label} 50% (ms)"] = ms[(m, 0.5)]
            row[f"{label} 50% vs dense"] = dense / ms[(m, 0.5)]
            row[f"{label} 50% vs its 0%"] = ms[(m, 0.0)] / ms[(m, 0.5)]
        rows[model] = row
    return pd.DataFrame.from_dict(rows, orient="index"), prov


def repeat_table(name: str = ENGINE_NAME, prompt: int = 512) -> tuple[pd.DataFrame, list[dict]]:
    """(table, provenances): per model and sparse variant, the median, lowest and highest ratio
    to our dense engine and to our fastest dense step over the repeats recorded in
    ``results/{name}.json`` (the same run repeated in fresh processes, each timing its own
    dense steps), and each repeat's provenance. A target that one run meets and another misses
    sits within the noise.

    >>> t, provs = repeat_table()
    >>> list(t.columns)
    ['runs', 'vs dense (median)', 'vs dense (min)', 'vs dense (max)', 'vs best dense (median)']
    >>> bool((t["vs dense (min)"] <= t["vs dense (median)"]).all())
    True
    """
    frame, prov = results.load(name)
    if "repeat" not in frame:
        frame = frame.assign(repeat=0)
    tables = []
    for _, run in frame.groupby("repeat", sort=True):
        t = engine_methods_table(run.drop(columns="repeat"), prompt)
        tables.append(t[~t.engine.isin(DENSE_ENGINES + ("hf", "hf_compiled"))])
    provs = prov.get("repeats") or [prov]
    g = pd.concat(tables).groupby(["model", "method", "budget"], sort=False)
    out = pd.DataFrame({"runs": g.size(), "vs dense (median)": g["vs dense"].median(),
                        "vs dense (min)": g["vs dense"].min(),
                        "vs dense (max)": g["vs dense"].max(),
                        "vs best dense (median)": g["vs best dense"].median()})  # fmt: skip
    return out, provs
