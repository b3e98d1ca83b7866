"""The budget explorer: quality and predicted speed of sparsity budgets (Deja Vu §5, Knowl 8, 9).

Pick an MLP budget, a head budget and how many first layers stay dense, and see perplexity,
a sample generation and the ideal decoding speedup from :mod:`dejavu_lab.bytes_model`. Two forms:

- :func:`budget_grid` + :func:`grid_figure`: a precomputed grid drawn as a plotly figure with a
  slider, which works in the static book with no kernel;
- :func:`live_explorer`: ipywidgets that recompute on demand in JupyterLab.
"""

from __future__ import annotations

import itertools

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from tqdm.auto import tqdm

from .bytes_model import predicted_speedup
from .sparsify import sparse_perplexity

__all__ = ["budget_grid", "grid_figure", "live_explorer", "sample"]


def _speedup(arch, vocab, mlp_s, head_s, n_dense, context, predictors=None):
    ranks = {}
    if predictors is not None:
        ranks = {"mlp_rank": predictors.config.mlp_rank, "head_rank": predictors.config.head_rank}
    return predicted_speedup(
        arch,
        vocab,
        mlp_sparsity=mlp_s,
        head_sparsity=head_s,
        dense_layers=range(n_dense),
        context=context,
        **ranks,
    )


def budget_grid(
    model,
    arch,
    windows: torch.Tensor,
    *,
    mlp_values=(0.0, 0.3, 0.5, 0.7, 0.85),
    head_values=(0.0, 0.3, 0.5),
    dense_first=(0, 2),
    mode: str = "predicted",
    predictors=None,
    static=None,
    progress: bool = True,
) -> pd.DataFrame:
    """Perplexity and predicted speedup at every (MLP, head, dense-first-layers) budget."""
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = []
    combos = list(itertools.product(dense_first, head_values, mlp_values))
    for n_dense, hs, ms in tqdm(combos, desc="budget grid", disable=not progress):
        ppl = sparse_perplexity(
            model,
            windows,
            progress=False,
            mlp_sparsity=ms,
            head_sparsity=hs,
            dense_layers=range(n_dense),
            mode=mode,
            predictors=predictors,
            static=static,
            arch=arch,
        )
        rows.append(
            {
                "mlp_sparsity": ms,
                "head_sparsity": hs,
                "dense_first": n_dense,
                "perplexity": ppl,
                "speedup": _speedup(arch, vocab, ms, hs, n_dense, windows.shape[1], predictors),
            }
        )
    return pd.DataFrame(rows)


def grid_figure(grid: pd.DataFrame, dense_ppl: float, title: str, caption: str) -> go.Figure:
    """Perplexity and speedup against MLP sparsity; a slider picks the head sparsity."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("perplexity (lower is better)", "predicted speedup")
    )
    heads = sorted(grid.head_sparsity.unique())
    denses = sorted(grid.dense_first.unique())
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    traces_per_step = []
    for hs in heads:
        ids = []
        for j, nd in enumerate(denses):
            g = grid[(grid.head_sparsity == hs) & (grid.dense_first == nd)].sort_values(
                "mlp_sparsity"
            )
            label = "all layers sparse" if nd == 0 else f"first {nd} layers dense"
            for col, metric in ((1, "perplexity"), (2, "speedup")):
                fig.add_trace(
                    go.Scatter(
                        x=g.mlp_sparsity,
                        y=g[metric],
                        mode="lines+markers",
                        name=label,
                        legendgroup=label,
                        showlegend=col == 1,
                        line=dict(color=colors[j % len(colors)]),
                        visible=hs == heads[0],
                        hovertemplate=f"MLP %{{x:.0%}} · heads {hs:.0%}<br>{metric} %{{y:.2f}}",
                    ),
                    row=1,
                    col=col,
                )
                ids.append(len(fig.data) - 1)
        traces_per_step.append(ids)
    n = len(fig.data)
    fig.add_hline(y=dense_ppl, line_dash="dot", line_color="gray", row=1, col=1)
    fig.add_annotation(
        text=f"dense {dense_ppl:.1f}",
        x=0,
        y=dense_ppl,
        xref="x1",
        yref="y1",
        showarrow=False,
        yshift=10,
        xanchor="left",
        font=dict(color="gray"),
    )
    steps = []
    for hs, ids in zip(heads, traces_per_step, strict=True):
        vis = [i in ids for i in range(n)]
        steps.append(dict(method="update", label=f"{hs:.0%}", args=[{"visible": vis}]))
    fig.update_layout(
        title=title,
        height=460,
        margin=dict(t=70, b=150),
        sliders=[
            dict(active=0, currentvalue=dict(prefix="head sparsity: "), pad=dict(t=50), steps=steps)
        ],
        legend=dict(orientation="h", y=1.12, x=0.5, xanchor="center"),
    )
    fig.update_xaxes(title_text="MLP sparsity (fraction of neurons removed)", tickformat=".0%")
    fig.update_yaxes(title_text="perplexity", row=1, col=1)
    fig.update_yaxes(title_text="× over dense (bytes moved)", row=1, col=2)
    fig.add_annotation(
        text=caption,
        xref="paper",
        yref="paper",
        x=0,
        y=-0.55,
        showarrow=False,
        font=dict(size=10),
        xanchor="left",
    )
    return fig


def sample(model, tokenizer, prompt: str, n_tokens: int = 20, **budget) -> str:
    """Greedy continuation of ``prompt`` under a budget (deferred KV when heads are sparse)."""
    from .deferred_kv import generate

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = generate(model, ids, n_tokens, **budget)
    return tokenizer.decode(gen.tokens[0, ids.shape[1] :], skip_special_tokens=True)


def live_explorer(model, tokenizer, arch, windows, predictors, static=None, prompt="The"):
    """ipywidgets: sliders for the budgets, a button that recomputes perplexity and a sample."""
    import html

    import ipywidgets as w

    vocab = model.get_output_embeddings().weight.shape[0]
    mlp = w.FloatSlider(
        value=0.5,
        min=0,
        max=0.95,
        step=0.05,
        description="MLP sparsity",
        readout_format=".0%",
        style={"description_width": "110px"},
    )
    heads = w.FloatSlider(
        value=0.3,
        min=0,
        max=0.9,
        step=0.1,
        description="head sparsity",
        readout_format=".0%",
        style={"description_width": "110px"},
    )
    dense = w.IntSlider(
        value=0,
        min=0,
        max=arch.n_layers - 1,
        description="dense first",
        style={"description_width": "110px"},
    )
    modes = ["predicted", "oracle"] + (["static"] if static is not None else [])
    mode = w.Dropdown(
        options=modes,
        value="predicted",
        description="sets from",
        style={"description_width": "110px"},
    )
    button = w.Button(description="Recompute", button_style="primary")
    out = w.HTML()

    def run(_=None):
        button.disabled = True
        out.value = "<i>computing…</i>"
        kw = dict(
            mlp_sparsity=mlp.value, head_sparsity=heads.value, dense_layers=range(dense.value)
        )
        ppl = sparse_perplexity(
            model,
            windows,
            progress=False,
            mode=mode.value,
            predictors=predictors,
            static=static,
            **kw,
        )
        gen_kw = dict(
            kw,
            predictors=predictors if mode.value != "static" else None,
            static=static if mode.value == "static" else None,
        )
        if mode.value == "oracle":  # the oracle cannot pick heads before attention runs
            gen_kw["head_sparsity"] = 0.0
        text = sample(model, tokenizer, prompt, **gen_kw)
        speed = _speedup(
            arch,
            vocab,
            mlp.value,
            heads.value,
            dense.value,
            windows.shape[1],
            predictors if mode.value == "predicted" else None,
        )
        out.value = (
            f"<b>perplexity</b> {ppl:.2f} ({mode.value} sets, {windows.numel():,} tokens) · "
            f"<b>predicted speedup</b> {speed:.2f}× (bytes moved, batch 1)<br>"
            f"<b>sample</b>: <i>{html.escape(prompt)}</i>{html.escape(text)}"
        )
        button.disabled = False

    button.on_click(run)
    run()
    return w.VBox([w.HBox([mlp, heads]), w.HBox([dense, mode, button]), out])
