"""Tables and figures of the gated-MLP chapter: CATS, TEAL and WINA beside DejaVu.

The quality side comes from :mod:`dejavu_lab.sparsify.frontier` (perplexity against sparsity
and against the decoder-layer weight bytes read per token); this module adds what the chapter
draws around it:

- :func:`cached_frontier` — the study, cached (it is minutes of CPU);
- :func:`frontier_figure` and :func:`crossings` — the curves, each started at the dense point,
  and where they cross given byte fractions (our quality targets: :data:`TARGETS`);
- :func:`threshold_table` and :func:`threshold_heatmap` — the calibrated threshold and the share
  removed per layer and site;
- :class:`TokenKept`, :func:`token_kept` and :func:`token_bytes` — what each token kept: a
  threshold keeps a different number of entries for every token, a top-k the same;
- GPU time per token of every method in our engine: :mod:`dejavu_lab.report.methods`.
"""

from __future__ import annotations

import hashlib
import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..arch import Arch
from ..sparsify.calibration import KINDS, Thresholds
from ..sparsify.core import sparsified
from ..sparsify.frontier import at_bytes, frontier
from ..sparsify.kept import Kept
from ..step_bytes import layer_elements, site_elements
from .plots import COLORS, dash, legend_and_caption_below

__all__ = [
    "TARGETS",
    "TokenKept",
    "cached_frontier",
    "color",
    "crossings",
    "frontier_figure",
    "threshold_heatmap",
    "threshold_table",
    "token_bytes",
    "token_kept",
]

# Our quality targets: bytes per token fraction -> at most this perplexity ratio to dense.
TARGETS = {0.75: 1.02, 0.6: 1.10, 0.5: 1.25}


def color(variant: str) -> str:
    """The chapter's colour of a variant (by its method: the name's first word).

    >>> color("teal (greedy)") == color("teal (uniform)") == COLORS["teal"]
    True
    """
    return COLORS.get(variant.split(" ")[0], "#17becf")


def _wrap(caption: str, width: int = 120) -> str:
    return "<br>".join(textwrap.wrap(caption.replace("<br>", " "), width))


# ---------------------------------------------------------------------------------------------
# the frontier


def _source_hash() -> str:
    """Hash of the code a frontier point depends on: the sparsify package and its budgets."""
    root = Path(__file__).resolve().parents[1]  # dejavu_lab/
    h = hashlib.sha256()
    for f in sorted((root / "sparsify").glob("*.py")) + [root / "budgets.py", root / "corpus.py"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cached_frontier(
    model, tokenizer, variants: dict, sparsities, *, predictors=None, cache: bool = True, **kwargs
) -> pd.DataFrame:
    """:func:`~dejavu_lab.sparsify.frontier.frontier`, read from or written to
    ``cache_dir()/frontier`` (JSON). The key: the model fingerprint, the variants, sparsities and
    other arguments, the predictors' configurations, and a hash of the sparsify code, so a
    change to any method computes the study again.

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> kw = dict(window=16, eval_windows=1, train_tokens=32, calibration_tokens=32)
    >>> with mock.patch.dict(os.environ, DEJAVU_LAB_CACHE=tempfile.mkdtemp()):  # not ~/.cache
    ...     runs = [cached_frontier(model, tok, {"cats": {"method": "cats"}}, [0.5], **kw)
    ...             for _ in range(2)]
    >>> runs[0].attrs["cached"], runs[1].attrs["cached"], runs[1].equals(runs[0])
    (False, True, True)
    """
    from ..assets import cache_dir
    from ..atomic import write_text
    from ..collect import fingerprint, fingerprint_id

    fp = fingerprint(model)
    pred_key = None
    if predictors is not None:
        pred_key = [predictors.config.key(), predictors.collection.get("key")]
    what = {"fingerprint": fp, "variants": variants, "sparsities": list(sparsities),
            "kwargs": kwargs, "predictors": pred_key, "code": _source_hash()}  # fmt: skip
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_dir() / "frontier" / f"{fingerprint_id(fp)}-{key}.json"
    if cache and path.exists():
        saved = json.loads(path.read_text())
        df = pd.DataFrame(saved["rows"])
        df.attrs.update(saved["attrs"], cached=True)
        return df
    df = frontier(model, tokenizer, variants, sparsities, predictors=predictors, **kwargs)
    if cache:
        rows = df.astype(object).where(df.notna(), None).to_dict("records")
        write_text(path, json.dumps({"rows": rows, "attrs": df.attrs, "key": what}, default=str))
    df.attrs["cached"] = False
    return df


def _with_dense_start(df: pd.DataFrame) -> pd.DataFrame:
    """Every variant's curve with the dense point (sparsity 0, bytes 1) prepended."""
    dense = df[df.variant == "dense"].iloc[0]
    starts = [
        dense.to_frame().T.assign(variant=v, method=g.method.iloc[0])
        for v, g in df[df.variant != "dense"].groupby("variant", sort=False)
    ]
    out = pd.concat([*starts, df[df.variant != "dense"]], ignore_index=True)
    out["variant"] = pd.Categorical(
        out.variant, list(dict.fromkeys(df.variant[df.variant != "dense"]))
    )
    out = out.sort_values(["variant", "sparsity"], kind="stable").reset_index(drop=True)
    out["variant"] = out.variant.astype(str)
    for col in ("sparsity", "perplexity", "bytes_per_token_fraction"):
        out[col] = out[col].astype(float)
    return out


def crossings(df: pd.DataFrame, fractions=tuple(TARGETS), window: float = 0.0) -> pd.DataFrame:
    """Perplexity ratio to dense where each curve of :func:`~dejavu_lab.sparsify.frontier.frontier`
    crosses these byte fractions (:func:`~dejavu_lab.sparsify.frontier.at_bytes`, with every
    curve started at the dense point, so a first measured point below a fraction still
    counts). ``window``: read the curves by a local line fit through the points within it
    (:func:`~dejavu_lab.sparsify.frontier.at_bytes`). NaN where a method cannot read that few
    bytes.

    >>> df = pd.DataFrame({"variant": ["dense", "a", "a"], "method": ["dense", "teal", "teal"],
    ...                    "sparsity": [0.0, 0.25, 0.5], "bytes_per_token_fraction": [1, 0.7, 0.5],
    ...                    "perplexity": [10.0, 11.0, 20.0]})
    >>> crossings(df, [0.75, 0.4]).round(3)  # 0.75 lies between dense and the first point
              0.75  0.40
    variant
    a        1.083   NaN
    """
    full = _with_dense_start(df)
    dense = df[df.variant == "dense"]
    return at_bytes(pd.concat([dense, full], ignore_index=True), list(fractions), window)


def frontier_figure(
    df: pd.DataFrame, caption: str, *, ymax: float | None = None, targets: dict = TARGETS
) -> go.Figure:
    """Perplexity ratio to dense against each method's sparsity (left) and against the weight
    bytes read per token (right), one line per variant, with our quality targets on the right.

    ``ymax``: top of the (log) ratio axis, to zoom in near dense; default: the largest ratio
    measured, capped at 1000.

    >>> df = pd.DataFrame({"variant": ["dense", "cats", "cats"], "method": ["dense", "cats", "cats"],
    ...                    "sparsity": [0.0, 0.3, 0.6], "bytes_per_token_fraction": [1, 0.8, 0.6],
    ...                    "perplexity": [10.0, 11.0, 14.0]})
    >>> fig = frontier_figure(df, "A hand-made frontier.")
    >>> [t.name for t in fig.data], list(fig.data[1].x)  # each curve starts at dense
    (['cats', 'cats', 'our targets'], [1.0, 0.8, 0.6])
    """
    full = _with_dense_start(df)
    full["ratio"] = full.perplexity / float(df.loc[df.variant == "dense", "perplexity"].iloc[0])
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.06,
        subplot_titles=("against the method's sparsity", "against weight bytes read per token"),
    )
    for col, x in ((1, "sparsity"), (2, "bytes_per_token_fraction")):
        for v, g in full.groupby("variant", sort=False):
            fig.add_trace(
                go.Scatter(
                    x=g[x].tolist(),
                    y=g.ratio.tolist(),
                    mode="lines+markers",
                    name=v,
                    legendgroup=v,
                    showlegend=col == 1,
                    line=dict(color=color(v), dash=dash(v)),
                    hovertemplate=f"{v}: %{{x:.2f}}<br>perplexity × %{{y:.3f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    if targets:
        fig.add_trace(
            go.Scatter(
                x=list(targets),
                y=list(targets.values()),
                mode="markers",
                name="our targets",
                marker=dict(symbol="x", size=11, color="black"),
                hovertemplate="target: at most × %{y:.2f} at %{x:.2f} of the bytes<extra></extra>",
            ),
            row=1,
            col=2,
        )
    top = ymax if ymax is not None else min(float(full.ratio.max()), 1000.0) * 1.3
    fig.update_yaxes(type="log", range=[math.log10(0.97), math.log10(top)])  # both panels
    fig.update_yaxes(title_text="perplexity / dense (log)", row=1, col=1)
    fig.update_xaxes(title_text="sparsity (the method's own budget)", row=1, col=1)
    fig.update_xaxes(title_text="fraction of dense weight bytes read (fewer →)",
                     autorange="reversed", row=1, col=2)  # fmt: skip
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    entries = full.variant.nunique() + bool(targets)
    return legend_and_caption_below(fig, caption, entries)


# ---------------------------------------------------------------------------------------------
# thresholds


def threshold_table(thresholds: dict[str, Thresholds], n_layers: int) -> pd.DataFrame:
    """One row per (name, layer, site): the calibrated threshold and the share it removes.

    ``thresholds``: name -> :class:`~dejavu_lab.sparsify.calibration.Thresholds`. Sites a
    method did not sparsify (dense layers, sites the greedy allocation left alone) get share 0
    and no threshold.

    >>> thr = Thresholds("cats", {(0, "gate"): 0.05}, {(0, "gate"): 0.5}, {})
    >>> threshold_table({"cats": thr}, n_layers=2)
       name  layer  site  threshold  sparsity
    0  cats      0  gate       0.05       0.5
    1  cats      1  gate        NaN       0.0
    """
    rows = []
    for name, thr in thresholds.items():
        for i in range(n_layers):
            for site in KINDS[thr.method]:
                rows.append({"name": name, "layer": i, "site": site,
                             "threshold": thr.values.get((i, site), float("nan")),
                             "sparsity": thr.sparsity.get((i, site), 0.0)})  # fmt: skip
    return pd.DataFrame(rows)


def threshold_heatmap(table: pd.DataFrame, caption: str) -> go.Figure:
    """Heatmaps per name of :func:`threshold_table`: share removed (left) and log10 of the
    threshold (right), layers across, sites down.

    >>> thr = Thresholds("teal", {(0, "mlp_in"): 0.2}, {(0, "mlp_in"): 0.4}, {})
    >>> fig = threshold_heatmap(threshold_table({"teal": thr}, 2), "A hand-made table.")
    >>> len(fig.data), fig.data[0].y  # one heatmap per panel, TEAL's four sites
    (2, ('attn_in', 'o_in', 'mlp_in', 'down_in'))
    """
    names = list(dict.fromkeys(table.name))
    fig = make_subplots(
        rows=len(names),
        cols=2,
        horizontal_spacing=0.16,
        vertical_spacing=0.12 if len(names) > 1 else 0.1,
        subplot_titles=[f"{n}: {what}" for n in names
                        for what in ("share removed", "log10 threshold on its score")],
    )  # fmt: skip
    for r, name in enumerate(names, start=1):
        t = table[table.name == name]
        sites = list(dict.fromkeys(t.site))
        for c, (col, axis) in enumerate((("sparsity", "coloraxis"), ("threshold", "coloraxis2")),
                                        start=1):  # fmt: skip
            z = t.pivot(index="site", columns="layer", values=col).loc[sites]
            if col == "threshold":
                z = np.log10(z.where(z > 0))
            fig.add_trace(
                go.Heatmap(
                    z=z.to_numpy(),
                    x=list(z.columns),
                    y=sites,
                    coloraxis=axis,
                    hovertemplate=f"{name}<br>layer %{{x}}, %{{y}}<br>{col} %{{z:.3f}}<extra></extra>",
                ),
                row=r,
                col=c,
            )
    fig.update_layout(
        height=170 * len(names) + 170,
        margin=dict(t=60, b=110, l=70, r=20),
        coloraxis=dict(colorscale="Viridis", cmin=0, cmax=1,
                       colorbar=dict(title="share", x=0.43, len=0.8, thickness=12)),
        coloraxis2=dict(colorscale="Magma", colorbar=dict(title="log10 t", x=1.0, len=0.8,
                                                          thickness=12)),
    )  # fmt: skip
    fig.update_xaxes(title_text="layer", row=len(names))
    fig.add_annotation(text=_wrap(caption), xref="paper", yref="paper", x=0, y=-0.1,
                       yanchor="top", showarrow=False, font=dict(size=9), xanchor="left",
                       align="left")  # fmt: skip
    return fig


# ---------------------------------------------------------------------------------------------
# what each token kept


class TokenKept(Kept):
    """A :class:`~dejavu_lab.sparsify.kept.Kept` that also keeps each token's kept
    fraction per (layer, site), as the sparsity hooks report them.

    >>> k = TokenKept()
    >>> k.add(0, "mlp_in", torch.tensor([[[True, False], [True, True]]]))  # [b=1, p=2, d=2]
    >>> k.fractions(), k.per_token[(0, "mlp_in")]
    ({(0, 'mlp_in'): 0.75}, [tensor([[0.5000, 1.0000]])])
    """

    def __init__(self):
        super().__init__()
        self.per_token: dict[tuple[int, str], list[torch.Tensor]] = defaultdict(list)

    def add(self, layer: int, site: str, keep: torch.Tensor) -> None:
        super().add(layer, site, keep)
        self.per_token[(layer, site)].append(keep.float().mean(-1).cpu())  # [b, p]


@torch.no_grad()
def token_kept(model, windows: torch.Tensor, **sparsified_kwargs) -> pd.DataFrame:
    """Each token's kept fraction at every (layer, site) under a sparsity method.

    ``windows``: [n, window] token ids; ``sparsified_kwargs``: what
    :func:`dejavu_lab.sparsify.sparsified` takes (``method``, ``sparsity``, ``thresholds``…).
    Returns one row per (window, position, layer, site). The fractions are those the method's
    own hooks realised, with every earlier layer already sparse.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> m = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> cal = calibrate(m.model, ids, cache=False, progress=False)
    >>> df = token_kept(m.model, ids, method="cats", sparsity=0.5, thresholds=cal)
    >>> len(df), sorted(df.site.unique()), round(float(df.kept.mean()), 1)  # 2 × 16 tokens × 2 layers
    (64, ['gate'], 0.5)
    >>> bool(df.kept.std() > 0)  # a threshold keeps a different share for each token
    True
    """
    kept = TokenKept()
    device = next(model.parameters()).device
    with sparsified(model, kept=kept, **sparsified_kwargs):
        for w in windows:
            model(input_ids=w[None].to(device), use_cache=False)
    frames = []
    for (layer, site), parts in sorted(kept.per_token.items()):
        v = torch.cat(parts)  # [n, window]
        n, p = v.shape
        frames.append(pd.DataFrame({"window": np.repeat(np.arange(n), p),
                                    "position": np.tile(np.arange(p), n), "layer": layer,
                                    "site": site, "kept": v.flatten().numpy()}))  # fmt: skip
    cols = ["window", "position", "layer", "site", "kept"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


def token_bytes(kept: pd.DataFrame, arch: Arch) -> pd.DataFrame:
    """Decoder-layer weight bytes each token reads against dense, from :func:`token_kept`.

    The per-token form of :func:`~dejavu_lab.step_bytes.bytes_per_token_fraction`
    (its mean over tokens is that function's value); predictors are not counted.

    >>> from dejavu_lab.models import random_model
    >>> arch = random_model("tiny-llama").arch
    >>> kept = pd.DataFrame({"window": 0, "position": [0, 1], "layer": 0, "site": "mlp",
    ...                      "kept": [0.5, 1.0]})
    >>> token_bytes(kept, arch).bytes_per_token_fraction.tolist()  # MLP: 3/4 of layer 0 of 2
    [0.8125, 1.0]
    """
    e = site_elements(arch)
    saved = kept.site.map(e) * (1.0 - kept.kept)
    total = arch.n_layers * layer_elements(arch)
    per = saved.groupby([kept.window, kept.position]).sum()
    return (1.0 - per / total).rename("bytes_per_token_fraction").reset_index()
