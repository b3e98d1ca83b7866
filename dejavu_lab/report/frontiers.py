"""Frontiers of several models side by side: the recorded ``dejavu-lab frontier`` runs.

Every ``results/frontier_<model>.json`` (written by ``dejavu-lab frontier --record``) holds one
model's perplexity against the decoder-layer weight bytes read per token, for each variant it
ran, on chapter 40's cut of the text (calibration on the training text, perplexity on the
windows after it). This module reads whatever such recordings exist — any models, any
variants — and answers the gated-MLP chapter's question, "which method for which model":

- :func:`load_frontiers` — one tidy frame of every recording (one row per model, variant and
  sparsity, the dense row included) and each model's provenance;
- :func:`crossing_table` — each curve read where it crosses given byte fractions
  (:func:`dejavu_lab.report.gated.crossings`, itself :func:`~dejavu_lab.sparsify.frontier.at_bytes`);
- :func:`best_at` — the best variant per model at each byte budget (the sentences built from
  it, saying where the models disagree and whether :data:`TARGETS` are met, are in
  :mod:`~dejavu_lab.report.frontier_sentences`);
- :func:`frontiers_figure` — one panel per model, one colour per method in every panel, a line
  style per kind of variant (:func:`~dejavu_lab.report.plots.dash`: dotted uniform, dashed per
  layer, dash-dot refit, long dash-dot tilted refit).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import results, staleness
from ..errors import ResultsError
from ..vocab import METHODS
from .gated import crossings
from .plots import COLORS, dash, legend_and_caption_below
from .source import listing

__all__ = [
    "PREFIX",
    "QUALITY_PATHS",
    "RERUN",
    "TARGETS",
    "TITLES",
    "best_at",
    "consensus",
    "crossing_table",
    "describe",
    "frontiers_figure",
    "load_frontiers",
    "missing_models",
    "pickable",
    "text_clause",
    "title",
    "variant_colors",
]

PREFIX = "frontier_"  # results/frontier_<model>.json, as `dejavu-lab frontier --record` names them
# results/rerun_<model>_<what>.json: a few points of a model's frontier evaluated again with one
# setting changed (threads, dtype), to show how large a gap the recordings resolve
RERUN = "rerun_"
# Quality targets on the real (0.5B-1.5B) models: fraction of the dense weight bytes read per
# token -> at most this perplexity ratio to dense, for the best method at equal bytes.
TARGETS = {0.75: 1.01, 0.6: 1.05, 0.5: 1.15}
# What a frontier point depends on: a recording's age is counted in commits to these.
QUALITY_PATHS = ("dejavu_lab/sparsify", "dejavu_lab/step_bytes.py", "dejavu_lab/corpus.py",
                 "dejavu_lab/budgets.py")  # fmt: skip
# The checkpoint behind a named model (dejavu_lab.models.NAMED), for captions; other names
# are shown as recorded.
TITLES = {"demo": "SmolLM2-135M-Instruct", "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
          "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}  # fmt: skip
CORPUS_NAMES = {"demo": "Lee news corpus", "wikitext-2": "WikiText-2", "c4": "C4"}
# provenance fields a frontier recording must carry for the chapter's caption
NEEDED = ("model", "dtype", "tokens", "window", "calibration_tokens", "cpu", "git_sha")
_SPARE = ("#e377c2", "#bcbd22", "#393b79", "#637939", "#843c39")


def _size(prov: dict) -> float:
    """A model's size for ordering the panels (layers × width × MLP width), from its
    fingerprint; unknown sizes last."""
    fp = prov.get("model_fingerprint") or {}
    try:
        return float(fp["n_layers"]) * float(fp["d_model"]) * float(fp["d_mlp"])
    except (KeyError, TypeError, ValueError):
        return math.inf


def load_frontiers(folder: str | Path | None = None, prefix: str = PREFIX
                   ) -> tuple[pd.DataFrame, dict[str, dict]]:  # fmt: skip
    """Every frontier recording in ``folder`` (default :func:`dejavu_lab.results.results_dir`)
    whose name starts with ``prefix`` (:data:`RERUN` for the re-evaluations):
    ``(frame, provenance by model)``, models ordered by size.

    The frame has one row per (model, variant, sparsity), each model's dense row included:
    ``model``, ``variant``, ``method``, ``allocation``, ``sparsity``, ``bytes_fraction`` (of
    the dense decoder-layer weight bytes read per token), ``perplexity`` and ``ratio`` (to
    that model's dense perplexity). Each provenance gains ``file`` (its path). A recording
    without a dense row or without the fields of :data:`NEEDED` is a
    :class:`~dejavu_lab.errors.ResultsError`.

    >>> frame, provs = load_frontiers()
    >>> list(provs)[0], bool(frame[frame.variant == "dense"].ratio.eq(1).all())
    ('demo', True)
    """
    folder = Path(folder) if folder is not None else results.results_dir()
    frames, provs = [], {}
    for path in sorted(folder.glob(f"{prefix}*.json")):
        rows, prov = results.load(path)
        missing = [k for k in NEEDED if k not in prov]
        if missing:
            raise ResultsError(
                f"{path} provenance lacks {missing}; record it again with `dejavu-lab frontier "
                "--record`."
            )
        if "variant" not in rows or not (rows.variant == "dense").any():
            raise ResultsError(
                f"{path} has no dense row to measure against; record it again with "
                "`dejavu-lab frontier --record`."
            )
        name = str(prov["model"])
        if name in provs:  # the same model recorded twice (another dtype, say): keep both
            name = f"{name} ({prov['dtype']})"
        if name in provs:
            name = f"{name} ({path.stem})"
        dense = float(rows.loc[rows.variant == "dense", "perplexity"].iloc[0])
        frames.append(
            pd.DataFrame({
                "model": name,
                "variant": rows.variant.astype(str),
                "method": rows.get("method", rows.variant).astype(str),
                "allocation": rows.get("allocation", "").fillna("").astype(str),
                "sparsity": rows.sparsity.astype(float),
                "bytes_fraction": rows.bytes_per_token_fraction.astype(float),
                "perplexity": rows.perplexity.astype(float),
                "ratio": rows.perplexity.astype(float) / dense,
                "tilt": rows.get("tilt", pd.Series(math.nan, index=rows.index)).astype(float),
            })
        )  # fmt: skip
        provs[name] = {**prov, "file": str(path)}
    order = sorted(provs, key=lambda m: (_size(provs[m]), m))
    cols = ["model", "variant", "method", "allocation", "sparsity", "bytes_fraction",
            "perplexity", "ratio", "tilt"]  # fmt: skip
    if not frames:
        return pd.DataFrame(columns=cols), {}
    frame = pd.concat(frames, ignore_index=True)
    frame["model"] = pd.Categorical(frame.model, order)
    frame = frame.sort_values("model", kind="stable").reset_index(drop=True)
    frame["model"] = frame.model.astype(str)
    return frame, {m: provs[m] for m in order}


def missing_models(provs: dict) -> list[str]:
    """The named checkpoints (:data:`dejavu_lab.models.NAMED`) without a frontier recording.

    >>> missing_models({"demo": {}, "qwen2.5-0.5b": {}})
    ['qwen2.5-1.5b']
    """
    from ..models import NAMED

    recorded = {str(p.get("model", m)) for m, p in provs.items()} | set(provs)
    return [m for m in NAMED if m not in recorded]


def title(model: str) -> str:
    """A model's name in captions: its checkpoint (:data:`TITLES`) or the recorded name.

    >>> title("qwen2.5-0.5b"), title("my-model")
    ('Qwen2.5-Coder-0.5B-Instruct', 'my-model')
    """
    return TITLES.get(model, model)


def describe(model: str, prov: dict) -> str:
    """One clause per recording for a caption: checkpoint, dtype, tokens, CPU, commit and age.

    >>> describe("demo", load_frontiers()[1]["demo"])
    'SmolLM2-135M-Instruct (demo), float32, 4,096 held-out tokens, ... CPU, ..., measured at ...'
    """
    shas = list(dict.fromkeys(prov.get("points_git_sha") or [prov["git_sha"]]))
    age = staleness.note({"git_sha": shas[0], "repeats": [{"git_sha": s} for s in shas[1:]]},
                         paths=QUALITY_PATHS, what="the sparsity code")  # fmt: skip
    threads = (
        f", {prov['threads']} thread{'s' * (prov['threads'] != 1)}" if "threads" in prov else ""
    )
    return (f"{title(model)} ({model}), {prov['dtype']}, {int(prov['tokens']):,} held-out tokens, "
            f"{prov['cpu']} CPU{threads}, {str(prov.get('date', ''))[:10]}, {age}")  # fmt: skip


def text_clause(provs: dict) -> str:
    """The text every recording measured, as a caption clause; one per distinct cut when
    the recordings differ (corpus, calibration text and tokens, held-out tokens, window).

    >>> print(text_clause({"a": {"corpus": "demo", "calibration": "demo", "window": 512,
    ...                          "calibration_tokens": 8192, "tokens": 4096}}))
    Lee news corpus (chapter 40's cut): thresholds calibrated on its first 8,192 tokens,
    perplexity on the next 4,096, windows of 512
    """

    def one(p: dict) -> str:
        corpus = CORPUS_NAMES.get(p.get("corpus"), str(p.get("corpus")))
        calib = p.get("calibration", p.get("corpus"))
        n_cal, n = int(p["calibration_tokens"]), int(p["tokens"])
        if calib == p.get("corpus"):
            how = (
                f"thresholds calibrated on its first {n_cal:,} tokens, perplexity on the next {n:,}"
            )
        else:
            how = (
                f"thresholds calibrated on {n_cal:,} tokens of {CORPUS_NAMES.get(calib, calib)}, "
                f"perplexity on {n:,} tokens after its first {int(p.get('train_tokens', 0)):,}"
            )
        return f"{corpus} (chapter 40's cut): {how}, windows of {int(p['window'])}"

    cuts: dict[str, list[str]] = {}
    for model, p in provs.items():
        cuts.setdefault(one(p), []).append(model)
    if len(cuts) == 1:
        return next(iter(cuts))
    return "; ".join(f"{listing(map(title, ms))}: {c}" for c, ms in cuts.items())


def crossing_table(frame: pd.DataFrame, fractions=tuple(TARGETS)) -> pd.DataFrame:
    """Perplexity ratio to dense where each model's curves cross the byte ``fractions``: one
    row per (model, variant, fraction), NaN where a curve does not read that few bytes (each
    curve starts at the dense point; log perplexity, linear between measured points).

    >>> f = pd.DataFrame({"model": "m", "variant": ["dense", "a", "a"], "sparsity": [0, .25, .5],
    ...                   "bytes_fraction": [1, 0.7, 0.5], "perplexity": [10.0, 11.0, 20.0]})
    >>> crossing_table(f, [0.75, 0.4]).round(3).to_dict("records")
    [{'model': 'm', 'variant': 'a', 'fraction': 0.75, 'ratio': 1.083}, {'model': 'm', 'variant': 'a', 'fraction': 0.4, 'ratio': nan}]
    """
    out = []
    for model, g in frame.groupby("model", sort=False):
        df = g.rename(columns={"bytes_fraction": "bytes_per_token_fraction"})
        if "method" not in df:
            df = df.assign(method=df.variant)
        if not (df.variant != "dense").any():
            continue
        c = crossings(df, list(fractions))
        long = c.reset_index().melt(id_vars="variant", var_name="fraction", value_name="ratio")
        out.append(long.assign(model=model))
    if not out:
        return pd.DataFrame(columns=["model", "variant", "fraction", "ratio"])
    res = pd.concat(out, ignore_index=True)[["model", "variant", "fraction", "ratio"]]
    res["fraction"] = res.fraction.astype(float)
    return res.sort_values(["model", "fraction"], key=_keep_order(res), kind="stable",
                           ignore_index=True)  # fmt: skip


def _keep_order(res: pd.DataFrame):
    """Sort key keeping the models in the frame's order and the fractions descending."""
    models = {m: i for i, m in enumerate(dict.fromkeys(res.model))}

    def key(col: pd.Series) -> pd.Series:
        return col.map(models) if col.name == "model" else -col

    return key


def pickable(variant_method: str) -> bool:
    """Whether a method is one a user can deploy: not dense, not the oracle (which needs the
    true activations it saves). Methods this package does not know are counted.

    >>> pickable("teal"), pickable("oracle"), pickable("larosa")
    (True, False, True)
    """
    m = METHODS.get(variant_method)
    return m is None or (m.family != "dense" and m.needs != "nothing")


def best_at(cross: pd.DataFrame, frame: pd.DataFrame | None = None) -> pd.DataFrame:
    """The best deployable variant (:func:`pickable`) per model at each byte fraction of
    :func:`crossing_table`: ``fraction``, ``model``, ``variant`` (None where no variant reads
    that few bytes), ``ratio``, the runner-up and its ratio, and whether :data:`TARGETS` is met.
    ``frame`` maps variants to methods (default: a variant's first word).

    >>> cross = pd.DataFrame({"model": ["m"] * 3, "variant": ["a", "b", "oracle"],
    ...                       "fraction": 0.6, "ratio": [1.2, 1.1, 1.0]})
    >>> best_at(cross)[["model", "variant", "ratio", "runner_up", "meets"]].to_dict("records")
    [{'model': 'm', 'variant': 'b', 'ratio': 1.1, 'runner_up': 'a', 'meets': False}]
    """
    methods = {}
    if frame is not None and "method" in frame:
        methods = dict(zip(frame.variant, frame.method, strict=True))
    ok = cross.variant.map(lambda v: pickable(methods.get(v, v.split(" ")[0])))
    rows = []
    for (f, model), g in cross[ok].groupby(["fraction", "model"], sort=False):
        g = g.dropna(subset=["ratio"]).sort_values("ratio", kind="stable")
        best = g.iloc[0] if len(g) else None
        second = g.iloc[1] if len(g) > 1 else None
        ratio = float(best.ratio) if best is not None else float("nan")
        rows.append({
            "fraction": float(f), "model": model,
            "variant": best.variant if best is not None else None, "ratio": ratio,
            "runner_up": second.variant if second is not None else None,
            "runner_up_ratio": float(second.ratio) if second is not None else float("nan"),
            "target": TARGETS.get(float(f), float("nan")),
            "meets": bool(ratio <= TARGETS.get(float(f), -np.inf)),
        })  # fmt: skip
    return pd.DataFrame(rows)


def consensus(best: pd.DataFrame, fraction: float) -> tuple[list[str], int, int]:
    """``(variants, k, n)``: the variants of :func:`best_at` best on the most models at
    ``fraction`` (several on a tie; none when no variant reaches it), each on k of the n
    models.

    >>> best = pd.DataFrame({"fraction": [0.5] * 3 + [0.6] * 2, "model": ["a", "b", "c", "a", "b"],
    ...                      "variant": ["x", "y", "y", "x", "y"]})
    >>> consensus(best, 0.5), consensus(best, 0.6), consensus(best, 0.75)
    ((['y'], 2, 3), (['x', 'y'], 1, 2), ([], 0, 0))
    """
    g = best[best.fraction == fraction]
    counts = g.variant.dropna().value_counts(sort=False)
    if counts.empty:
        return [], 0, len(g)
    k = int(counts.max())
    return [str(v) for v, c in counts.items() if c == k], k, len(g)


def variant_colors(variants) -> dict[str, str]:
    """A colour per variant, the same in every panel: its method's colour
    (:data:`dejavu_lab.report.plots.COLORS`), or one of a spare palette for a method without
    one (in order of first appearance, so two new methods differ).

    >>> c = variant_colors(["teal (greedy)", "larosa (greedy)", "rsparse (greedy)"])
    >>> c["teal (greedy)"] == COLORS["teal"], c["larosa (greedy)"] != c["rsparse (greedy)"]
    (True, True)
    """
    spare = iter(_SPARE * 4)
    by_method: dict[str, str] = {}
    out = {}
    for v in dict.fromkeys(variants):
        m = v.split(" ")[0]
        if m not in by_method:
            by_method[m] = COLORS.get(m) or next(spare)
        out[v] = by_method[m]
    return out


def frontiers_figure(frame: pd.DataFrame, caption: str, *, ymax: float = 10.0,
                     targets: dict = TARGETS) -> go.Figure:  # fmt: skip
    """Perplexity ratio to dense (log, clipped at ``ymax``) against the fraction of the dense
    weight bytes read per token, one panel per model of :func:`load_frontiers`, one trace per
    (model, variant) starting at the dense point; ``targets`` as crosses.

    >>> f = pd.DataFrame({"model": ["m"] * 3 + ["n"] * 2, "variant": ["dense", "a", "a"] * 1
    ...                   + ["dense", "a"], "sparsity": [0, .3, .6, 0, .3],
    ...                   "bytes_fraction": [1, .8, .6, 1, .7], "ratio": [1, 1.1, 1.5, 1, 1.2]})
    >>> fig = frontiers_figure(f, "A hand-made pair.")
    >>> [(t.meta, list(t.x)) for t in fig.data if t.meta]
    [({'model': 'm', 'variant': 'a'}, [1.0, 0.8, 0.6]), ({'model': 'n', 'variant': 'a'}, [1.0, 0.7])]
    """
    models = list(dict.fromkeys(frame.model))
    variants = [v for v in dict.fromkeys(frame.variant) if v != "dense"]
    colors = variant_colors(variants)
    fig = make_subplots(rows=1, cols=max(1, len(models)), shared_yaxes=True,
                        horizontal_spacing=0.04, subplot_titles=[title(m) for m in models])  # fmt: skip
    shown: set[str] = set()
    for col, model in enumerate(models, start=1):
        g = frame[frame.model == model]
        dense = g[g.variant == "dense"].iloc[:1]
        for v in [v for v in variants if (g.variant == v).any()]:
            curve = pd.concat([dense, g[g.variant == v].sort_values("sparsity")])
            fig.add_trace(
                go.Scatter(
                    x=curve.bytes_fraction.astype(float).tolist(),
                    y=curve.ratio.astype(float).tolist(),
                    mode="lines+markers",
                    name=v,
                    legendgroup=v,
                    showlegend=v not in shown,
                    meta={"model": model, "variant": v},
                    line=dict(color=colors[v], dash=dash(v)),
                    hovertemplate=f"{title(model)}<br>{v}: %{{x:.2f}} of the bytes<br>"
                    "perplexity × %{y:.3f}<extra></extra>",
                ),
                row=1,
                col=col,
            )
            shown.add(v)
        if targets:
            fig.add_trace(
                go.Scatter(x=list(targets), y=list(targets.values()), mode="markers",
                           name="targets", legendgroup="targets", showlegend=col == 1,
                           marker=dict(symbol="x", size=10, color="black"),
                           hovertemplate="target: at most × %{y:.2f} at %{x:.2f} of the bytes"
                           "<extra></extra>"),
                row=1,
                col=col,
            )  # fmt: skip
    fig.update_yaxes(type="log", range=[math.log10(0.98), math.log10(ymax)])
    fig.update_yaxes(title_text=f"perplexity / dense (log, clipped at ×{ymax:g})", row=1, col=1)
    fig.update_xaxes(autorange="reversed", title_text="fraction of dense weight bytes read")
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    return legend_and_caption_below(fig, caption, len(variants) + bool(targets))
