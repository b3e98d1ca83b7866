"""The budget explorer: quality and predicted speed of sparsity budgets (Deja Vu §5, Knowl 8, 9).

Pick an MLP budget, a head budget and how many first layers stay dense, and see perplexity,
a sample generation and the ideal decoding speedup from :mod:`dejavu_lab.bytes_model`. Two forms:

- :func:`budget_grid` + :func:`grid_figure`: a precomputed grid drawn as a plotly figure with a
  slider, which works in the static book with no kernel;
- :func:`live_explorer`: ipywidgets that recompute on demand in JupyterLab.
"""

from __future__ import annotations

import itertools
import math
import textwrap

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
    modes=("oracle", "predicted"),
    predictors=None,
    static=None,
    progress: bool = True,
) -> pd.DataFrame:
    """Perplexity and predicted speedup at every (sets, MLP, heads, dense-first) budget.

    ``modes``: how the sets are chosen (:func:`dejavu_lab.sparsify.sparsified`'s ``mode``).
    Budgets with nothing removed are evaluated once (they are the dense model).

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-llama")
    >>> grid = budget_grid(model, arch, torch.randint(0, 128, (2, 16)), mlp_values=(0.0, 0.5),
    ...                    head_values=(0.0,), dense_first=(0,), modes=("oracle",), progress=False)
    >>> grid[["sets", "mlp_sparsity", "perplexity", "speedup"]].round(1)
         sets  mlp_sparsity  perplexity  speedup
    0  oracle           0.0       128.4      1.0
    1  oracle           0.5       128.5      1.5
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = []
    dense_ppl = None
    combos = list(itertools.product(modes, dense_first, head_values, mlp_values))
    for mode, n_dense, hs, ms in tqdm(combos, desc="budget grid", disable=not progress):
        if ms == 0 and hs == 0 and dense_ppl is not None:
            ppl = dense_ppl
        else:
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
            if ms == 0 and hs == 0:
                dense_ppl = ppl
        uses_predictors = predictors if mode == "predicted" else None
        rows.append(
            {
                "sets": mode,
                "mlp_sparsity": ms,
                "head_sparsity": hs,
                "dense_first": n_dense,
                "perplexity": ppl,
                "speedup": _speedup(
                    arch, vocab, ms, hs, n_dense, windows.shape[1], uses_predictors
                ),
            }
        )
    return pd.DataFrame(rows)


def grid_figure(grid: pd.DataFrame, dense_ppl: float, title: str, caption: str) -> go.Figure:
    """Perplexity (one line per way of choosing sets) above predicted speedup, against MLP
    sparsity; a slider picks the head sparsity and how many first layers stay dense.

    >>> grid = pd.DataFrame({"sets": "oracle", "mlp_sparsity": [0.0, 0.5, 0.0, 0.5],
    ...                      "head_sparsity": [0.0, 0.0, 0.3, 0.3], "dense_first": 0,
    ...                      "perplexity": [10.0, 11.0, 12.0, 14.0], "speedup": [1, 1.5, 1.2, 1.8]})
    >>> fig = grid_figure(grid, 10.0, "Budgets", "A hand-made grid.")
    >>> [step.label for step in fig.layout.sliders[0].steps], len(fig.data)
    (['0%', '30%'], 4)
    """
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("perplexity (log scale)", "predicted speedup over dense (bytes moved)"),
    )
    keys = sorted(
        set(zip(grid.head_sparsity, grid.dense_first, strict=True)), key=lambda k: (k[1], k[0])
    )
    sets = list(dict.fromkeys(grid.sets))
    colors = {"oracle": "#2ca02c", "predicted": "#d62728", "static": "#7f7f7f"}
    traces_per_step = []
    for hs, nd in keys:
        ids = []
        first = (hs, nd) == keys[0]
        cell = grid[(grid.head_sparsity == hs) & (grid.dense_first == nd)]
        for name in sets:
            g = cell[cell.sets == name].sort_values("mlp_sparsity")
            fig.add_trace(
                go.Scatter(
                    x=g.mlp_sparsity,
                    y=g.perplexity,
                    mode="lines+markers",
                    name=f"{name} sets",
                    legendgroup=name,
                    line=dict(color=colors.get(name)),
                    visible=first,
                    hovertemplate=f"{name}: MLP %{{x:.0%}}, heads {hs:.0%}"
                    "<br>perplexity %{y:.1f}<extra></extra>",
                ),
                row=1,
                col=1,
            )
            ids.append(len(fig.data) - 1)
        g = cell[cell.sets == sets[-1]].sort_values("mlp_sparsity")
        fig.add_trace(
            go.Scatter(
                x=g.mlp_sparsity,
                y=g.speedup,
                mode="lines+markers",
                name="bytes-moved speedup",
                line=dict(color="#1f77b4"),
                visible=first,
                hovertemplate="MLP %{x:.0%}<br>%{y:.2f}× over dense<extra></extra>",
            ),
            row=2,
            col=1,
        )
        ids.append(len(fig.data) - 1)
        traces_per_step.append(ids)
    n = len(fig.data)
    fig.add_hline(
        y=dense_ppl,
        line_dash="dot",
        line_color="gray",
        row=1,
        col=1,
        annotation_text=f"dense {dense_ppl:.1f}",
        annotation_position="top left",
    )
    steps = [
        dict(
            method="update",
            label=f"{hs:.0%}" + (f" + {nd} dense" if nd else ""),
            args=[{"visible": [i in ids for i in range(n)]}],
        )
        for (hs, nd), ids in zip(keys, traces_per_step, strict=True)
    ]
    top = min(float(grid.perplexity.max()), 1e4) * 1.5  # beyond 10k it is noise, not text
    fig.update_layout(
        title=title,
        height=760,
        margin=dict(t=110, b=190, l=60, r=20),
        sliders=[
            dict(
                active=0,
                currentvalue=dict(prefix="head sparsity (+ first layers kept dense): "),
                pad=dict(t=50),
                font=dict(size=10),
                steps=steps,
            )
        ],
        legend=dict(orientation="h", y=1.1, x=0.5, xanchor="center"),
    )
    fig.update_xaxes(tickformat=".0%")
    fig.update_xaxes(title_text="MLP sparsity (fraction of neurons removed)", row=2, col=1)
    fig.update_yaxes(
        type="log",
        title_text="perplexity",
        row=1,
        col=1,
        range=[math.log10(dense_ppl * 0.8), math.log10(top)],
    )
    fig.update_yaxes(title_text="× over dense", row=2, col=1)
    fig.add_annotation(
        text="<br>".join(textwrap.wrap(caption, 110)),
        xref="paper",
        yref="paper",
        x=0,
        y=-0.42,
        showarrow=False,
        font=dict(size=9),
        xanchor="left",
        align="left",
    )
    return fig


def sample(model, tokenizer, prompt: str, n_tokens: int = 20, **budget) -> str:
    """Greedy continuation of ``prompt`` under a budget (deferred KV when heads are sparse).

    ``budget``: keyword arguments of :func:`dejavu_lab.deferred_kv.generate`, which needs
    ``predictors=`` or ``static=``.

    >>> from dejavu_lab.models import load_model
    >>> from dejavu_lab.sparsify import static_sets
    >>> model, tok, _ = load_model("demo")
    >>> calib = tok("Berlin is the capital of Germany.", return_tensors="pt").input_ids
    >>> static = static_sets(model, calib, progress=False)  # the same units for every token
    >>> sample(model, tok, "The capital of France is", 2, mlp_sparsity=0.3, static=static)
    ' Paris.'
    >>> sample(model, tok, "The capital of France is", 2, head_sparsity=0.3, static=static)
    ' 1'
    """
    from .deferred_kv import generate

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = generate(model, ids, n_tokens, **budget)
    return tokenizer.decode(gen.tokens[0, ids.shape[1] :], skip_special_tokens=True)


def live_explorer(model, tokenizer, arch, windows, predictors, static=None, prompt="The"):
    """ipywidgets: sliders for the budgets, a button that recomputes perplexity and a sample.

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import load_model, random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> tok = load_model("demo").tokenizer
    >>> model, _, arch = random_model("tiny-llama", vocab_size=len(tok))  # the demo's vocabulary
    >>> pred = Predictors(fingerprint(model, arch), PredictorConfig())  # untrained
    >>> ui = live_explorer(model, tok, arch, torch.randint(0, len(tok), (1, 16)), pred)
    >>> [slider.description for slider in ui.children[0].children], ui.children[2].value[:17]
    (['MLP sparsity', 'head sparsity'], '<b>perplexity</b>')
    """
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
