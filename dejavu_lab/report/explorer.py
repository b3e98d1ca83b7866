"""The budget explorer: quality and predicted speed of sparsity budgets (Deja Vu §5).

Pick a method — dense, the oracle, static sets, DejaVu's predictors, or the training-free
thresholds CATS, TEAL and WINA — its budget and how many first layers stay dense,
and see perplexity, a sample generation and the ideal decoding speedup. Two forms:

- :func:`budget_grid` + :func:`grid_figure`: a precomputed grid drawn as a plotly figure with a
  method selector and a slider, which works in the static book with no kernel;
- :func:`live_explorer`: ipywidgets that recompute on demand in JupyterLab.

The unit methods (oracle, static, DejaVu) take an MLP budget and a head budget; the threshold
methods one budget of their own (TEAL/WINA: the share of a layer's input entries zeroed,
bytes-weighted over its sites; CATS: the share of MLP neurons). Every point's speed comes from
the same count: the decoder-layer weight bytes the method really read on the text
(:mod:`dejavu_lab.step_bytes`, DejaVu's predictors included), plus the unembedding
and the KV cache read in full (:mod:`dejavu_lab.bytes_model`) — :func:`step_speedup`.
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

from ..bytes_model import bytes_per_token
from ..sparsify import sparse_eval, sparsified
from ..vocab import ALIASES, method_names
from ..vocab import METHODS as VOCAB_METHODS
from .plots import COLORS

__all__ = [
    "METHODS",
    "THRESHOLD_METHODS",
    "UNIT_METHODS",
    "budget_grid",
    "grid_figure",
    "live_explorer",
    "sample",
    "step_speedup",
]

UNIT_METHODS = method_names(family="unit")  # an MLP budget and a head budget
THRESHOLD_METHODS = method_names(family="threshold")  # one budget, calibrated thresholds
METHODS = tuple(VOCAB_METHODS)
X_TITLES = {
    "unit": "MLP sparsity (fraction of neurons removed)",
    "cats": "CATS sparsity (share of MLP neurons below the gate threshold)",
    "teal": "TEAL sparsity (share of each layer's input entries zeroed)",
    "wina": "WINA sparsity (share of each layer's input entries zeroed)",
    "all": "sparsity: MLP neurons removed (oracle, static, DejaVu) or the method's own budget",
}


def step_speedup(arch, vocab: int, layer_fraction: float, context: int = 512) -> float:
    """Ideal speedup of a batch-1 decoding step whose decoder layers read ``layer_fraction`` of
    their dense weight bytes; the unembedding and the KV cache (``context`` tokens) are read in
    full, as our engine does.

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> opt175b = get_arch(PRESETS["opt-175b"].config())
    >>> round(step_speedup(opt175b, 50272, 0.5), 2), step_speedup(opt175b, 50272, 1.0)
    (1.98, 1.0)
    """
    dense = bytes_per_token(arch, vocab, context=context)
    layers = dense.attn_weights + dense.mlp_weights
    return dense.total / (layers * layer_fraction + dense.kv_cache + dense.unembed)


def _kwargs(method, ms, hs, s, n_dense, predictors, static, thresholds, allocation, arch):
    kw = dict(method=method, dense_layers=range(n_dense), arch=arch)
    if method in UNIT_METHODS:
        kw.update(mlp_sparsity=ms, head_sparsity=hs, predictors=predictors, static=static)
    elif method in THRESHOLD_METHODS:
        kw.update(sparsity=s, thresholds=thresholds, allocation=allocation)
    # sparsified refuses what the method does not read (a CATS run has no allocation to choose)
    takes = VOCAB_METHODS[ALIASES.get(method, method)].options
    return {k: v for k, v in kw.items() if k in takes or k in ("method", "dense_layers", "arch")}


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
    thresholds=None,
    sparsity_values=None,
    allocation: str = "uniform",
    progress: bool = True,
) -> pd.DataFrame:
    """Perplexity, bytes and predicted speedup at every (method, budget, dense-first) point.

    ``modes``: methods of :data:`METHODS` (``"predicted"`` is ``"dejavu"``). The unit methods
    sweep ``mlp_values`` × ``head_values``; the threshold methods sweep ``sparsity_values``
    (default ``mlp_values``) with ``thresholds`` (a
    :class:`~dejavu_lab.sparsify.calibration.Calibration`) and ``allocation`` (TEAL/WINA:
    ``"uniform"`` or ``"greedy"``); ``"dense"`` is one row. Column ``sparsity`` is the x of
    :func:`grid_figure`: the MLP sparsity or the method's own budget; threshold rows have no
    head sparsity, the dense row no dense-first count. Budgets with nothing removed are the
    dense model, evaluated once.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import calibrate
    >>> model, _, arch = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    >>> cal = calibrate(model, ids, cache=False, progress=False)
    >>> grid = budget_grid(model, arch, ids, mlp_values=(0.0, 0.5), head_values=(0.0,),
    ...                    dense_first=(0,), modes=("dense", "oracle", "teal"), thresholds=cal,
    ...                    sparsity_values=(0.5,), progress=False)
    >>> grid[["method", "sparsity", "perplexity", "bytes_per_token_fraction", "speedup"]].round(1)
       method  sparsity  perplexity  bytes_per_token_fraction  speedup
    0   dense       0.0       127.2                       1.0      1.0
    1  oracle       0.0       127.2                       1.0      1.0
    2  oracle       0.5       127.2                       0.6      1.5
    3    teal       0.5       125.4                       0.5      1.9
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    context = windows.shape[1]
    methods = [ALIASES.get(m, m) for m in modes]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"modes must be among {', '.join(METHODS)}, got {unknown}.")
    points = []  # (method, mlp, heads, sparsity, dense_first)
    for m in methods:
        if m == "dense":
            points.append((m, 0.0, 0.0, 0.0, None))
        elif m in UNIT_METHODS:
            for nd, hs, ms in itertools.product(dense_first, head_values, mlp_values):
                points.append((m, ms, hs, ms, nd))
        else:
            for nd, s in itertools.product(dense_first, sparsity_values or mlp_values):
                points.append((m, float("nan"), float("nan"), s, nd))
    dense = None
    rows = []
    for m, ms, hs, s, nd in tqdm(points, desc="budget grid", disable=not progress):
        nothing = m == "dense" or (s == 0 and (m in THRESHOLD_METHODS or hs == 0))
        if nothing and dense is not None:
            r = dense
        else:
            kw = _kwargs(m, ms, hs, s, nd or 0, predictors, static, thresholds, allocation, arch)
            r = sparse_eval(model, windows, progress=False, **kw)
            dense = r if nothing else dense
        rows.append({"method": m, "mlp_sparsity": ms, "head_sparsity": hs, "sparsity": s,
                     "dense_first": nd, "perplexity": r.perplexity,
                     "bytes_per_token_fraction": r.bytes_per_token_fraction,
                     "speedup": step_speedup(arch, vocab, r.bytes_per_token_fraction, context)})  # fmt: skip
    return pd.DataFrame(rows)


def _step_label(hs, nd) -> str:
    nd = int(nd)
    if hs is None:
        return "no dense layers" if not nd else f"first {nd} dense"
    return f"{hs:.0%}" + (f" + {nd} dense" if nd else "")


def grid_figure(grid: pd.DataFrame, dense_ppl: float, title: str, caption: str) -> go.Figure:
    """Perplexity (one line per method) above predicted speedup, against the budget; a menu
    picks the method (or all), a slider the head sparsity and how many first layers stay dense.

    ``grid``: :func:`budget_grid`'s table (older tables with a ``sets`` column and no
    ``sparsity`` work too). Methods whose speedups coincide share one speedup line.

    >>> grid = pd.DataFrame({"method": ["oracle"] * 4 + ["teal"] * 2,
    ...                      "mlp_sparsity": [0.0, 0.5, 0.0, 0.5, None, None],
    ...                      "head_sparsity": [0.0, 0.0, 0.3, 0.3, None, None], "dense_first": 0,
    ...                      "sparsity": [0.0, 0.5, 0.0, 0.5, 0.3, 0.5],
    ...                      "perplexity": [10.0, 11.0, 12.0, 14.0, 10.5, 11.5],
    ...                      "speedup": [1, 1.5, 1.2, 1.8, 1.3, 1.6]})
    >>> fig = grid_figure(grid, 10.0, "Budgets", "A hand-made grid.")
    >>> [step.label for step in fig.layout.sliders[0].steps], len(fig.data)
    (['0%', '30%'], 8)
    >>> [b.label for b in fig.layout.updatemenus[0].buttons]
    ['all methods', 'oracle', 'teal']
    """
    col = "method" if "method" in grid else "sets"
    xcol = "sparsity" if "sparsity" in grid else "mlp_sparsity"
    grid = grid.assign(_x=grid[xcol])
    methods = list(dict.fromkeys(grid[col]))
    unit = grid[grid.head_sparsity.notna() & grid.dense_first.notna() & (grid[col] != "dense")]
    if len(unit):
        keys = sorted(
            set(zip(unit.head_sparsity, unit.dense_first, strict=True)), key=lambda k: (k[1], k[0])
        )
    else:
        keys = [(None, nd) for nd in sorted(set(grid.dense_first.dropna()))] or [(None, 0)]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("perplexity (log scale)",
                                        "predicted speedup over dense (bytes moved)"))  # fmt: skip
    traces = []  # per trace: (methods it shows, head sparsity, dense first)
    shown = set()

    def rows_at(name, hs, nd):
        g = grid[grid[col] == name]
        if name == "dense" or g.dense_first.isna().all():
            return g
        g = g[g.dense_first == nd]
        return g if g.head_sparsity.isna().all() else g[g.head_sparsity == hs]

    for hs, nd in keys:
        first = (hs, nd) == keys[0]
        speeds: dict[tuple, list[str]] = {}
        for name in methods:
            g = rows_at(name, hs, nd).sort_values("_x")
            if g.empty:
                continue
            fig.add_trace(
                go.Scatter(x=g._x, y=g.perplexity, mode="lines+markers", name=name,
                           legendgroup=name, showlegend=name not in shown,
                           line=dict(color=COLORS.get(name)), visible=first,
                           hovertemplate=f"{name}: %{{x:.0%}}<br>perplexity %{{y:.1f}}"
                           "<extra></extra>"),
                row=1, col=1,
            )  # fmt: skip
            shown.add(name)
            traces.append(({name}, hs, nd))
            key = (tuple(g._x.round(6)), tuple(g.speedup.round(6)))
            speeds.setdefault(key, []).append(name)
        for (xs, ys), names in speeds.items():
            fig.add_trace(
                go.Scatter(x=list(xs), y=list(ys), mode="lines+markers",
                           name="speedup: " + ", ".join(names), legendgroup=names[0],
                           showlegend=False, line=dict(color=COLORS.get(names[0]), dash="dot"),
                           visible=first,
                           hovertemplate=f"{', '.join(names)}: %{{x:.0%}}<br>%{{y:.2f}}× over "
                           "dense<extra></extra>"),
                row=2, col=1,
            )  # fmt: skip
            traces.append((set(names), hs, nd))
    fig.add_hline(y=dense_ppl, line_dash="dot", line_color="gray", row=1, col=1,
                  annotation_text=f"dense {dense_ppl:.1f}", annotation_position="top left")  # fmt: skip

    def steps_of(sel):
        if any(m in sel for m in unit[col].unique()):
            return keys
        return list(dict.fromkeys((None, nd) for _, nd in keys))

    def visible(sel, hs, nd):
        first_hs = keys[0][0]
        return [bool(ms & sel) and tn == nd and (th == hs or (hs is None and th == first_hs))
                for ms, th, tn in traces]  # fmt: skip

    def slider(sel):
        prefix = ("head sparsity (+ first layers kept dense): "
                  if steps_of(sel)[0][0] is not None else "first layers kept dense: ")  # fmt: skip
        steps = [dict(method="update", label=_step_label(hs, nd),
                      args=[{"visible": visible(sel, hs, nd)}]) for hs, nd in steps_of(sel)]  # fmt: skip
        return dict(active=0, currentvalue=dict(prefix=prefix), pad=dict(t=50),
                    font=dict(size=10), steps=steps)  # fmt: skip

    def x_title(sel):
        if len(sel) == 1 and next(iter(sel)) in X_TITLES:
            return X_TITLES[next(iter(sel))]
        return X_TITLES["unit"] if sel <= set(unit[col].unique()) | {"dense"} else X_TITLES["all"]

    choices = [("all methods", set(methods))] + [(m, {m}) for m in methods]
    buttons = [dict(label=label, method="update",
                    args=[{"visible": visible(sel, *steps_of(sel)[0])},
                          {"sliders": [slider(sel)], "xaxis2.title.text": x_title(sel)}])
               for label, sel in choices]  # fmt: skip
    top = min(float(grid.perplexity.max()), 1e4) * 1.5  # beyond 10k it is noise, not text
    fig.update_layout(
        title=dict(text=title, y=0.98, yanchor="top"),
        height=800,
        margin=dict(t=150, b=190, l=60, r=50),
        sliders=[slider(set(methods))],
        updatemenus=[dict(buttons=buttons, direction="down", x=0, xanchor="left", y=1.16,
                          yanchor="bottom", showactive=True, pad=dict(r=4))],
        legend=dict(orientation="h", y=1.16, yanchor="bottom", x=1, xanchor="right"),
    )  # fmt: skip
    fig.update_xaxes(tickformat=".0%")
    fig.update_xaxes(title_text=x_title(set(methods)), row=2, col=1)
    fig.update_yaxes(type="log", title_text="perplexity", row=1, col=1,
                     range=[math.log10(dense_ppl * 0.8), math.log10(top)])  # fmt: skip
    fig.update_yaxes(title_text="× over dense", row=2, col=1)
    fig.add_annotation(text="<br>".join(textwrap.wrap(caption, 110)), xref="paper",
                       yref="paper", x=0, y=-0.42, showarrow=False, font=dict(size=9),
                       xanchor="left", align="left")  # fmt: skip
    return fig


def sample(model, tokenizer, prompt: str, n_tokens: int = 20, *, method=None, **budget) -> str:
    """Greedy continuation of ``prompt`` under a budget.

    Without ``method`` (or with ``"dejavu"``/``"static"``): DejaVu-style decoding with deferred
    KV for skipped heads (:func:`dejavu_lab.deferred_kv.generate`, which needs ``predictors=``
    or ``static=``). With any other method of :data:`METHODS`: Hugging Face ``generate`` inside
    :func:`dejavu_lab.sparsify.sparsified` (``budget``: its keyword arguments).

    >>> from dejavu_lab.models import load_model
    >>> from dejavu_lab.sparsify import static_sets
    >>> model, tok, _ = load_model("demo")
    >>> calib = tok("Berlin is the capital of Germany.", return_tensors="pt").input_ids
    >>> static = static_sets(model, calib, progress=False)  # the same units for every token
    >>> sample(model, tok, "The capital of France is", 2, mlp_sparsity=0.3, static=static)
    ' Paris.'
    >>> sample(model, tok, "The capital of France is", 2, head_sparsity=0.3, static=static)
    ' 1'
    >>> sample(model, tok, "The capital of France is", 2, method="oracle", sparsity=0.3)
    ' Paris.'
    """
    enc = tokenizer(prompt, return_tensors="pt")
    ids = enc.input_ids
    if method is None or ALIASES.get(method, method) in ("dejavu", "static"):
        from ..deferred_kv import generate

        gen = generate(model, ids, n_tokens, **budget).tokens
    else:
        cfg = model.generation_config.__class__(
            max_new_tokens=n_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        with torch.no_grad(), sparsified(model, method=method, **budget):
            gen = model.generate(ids, attention_mask=enc.attention_mask, generation_config=cfg)
    return tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)


def live_explorer(
    model,
    tokenizer,
    arch,
    windows,
    predictors=None,
    static=None,
    prompt="The",
    *,
    thresholds=None,
    allocation: str = "uniform",
):
    """ipywidgets: a method menu, its budget sliders, and a button that recomputes perplexity,
    the bytes read, the predicted speedup and a sample.

    The menu offers dense and the oracle, plus static with ``static=``, DejaVu with
    ``predictors=``, and CATS, TEAL, WINA with ``thresholds=`` (a
    :class:`~dejavu_lab.sparsify.calibration.Calibration`; ``allocation`` is the default of
    TEAL's and WINA's allocation menu).

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import load_model, random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> tok = load_model("demo").tokenizer
    >>> model, _, arch = random_model("tiny-llama", vocab_size=len(tok))  # the demo's vocabulary
    >>> pred = Predictors(fingerprint(model, arch), PredictorConfig())  # untrained
    >>> ui = live_explorer(model, tok, arch, torch.randint(0, len(tok), (1, 16)), pred)
    >>> ui.children[0].children[0].options, ui.children[2].value[:17]
    (('dense', 'oracle', 'dejavu'), '<b>perplexity</b>')
    >>> [s.description for s in ui.children[1].children if s.layout.display != "none"]
    ['MLP sparsity', 'head sparsity']
    """
    import html

    import ipywidgets as w

    vocab = model.get_output_embeddings().weight.shape[0]
    style = {"description_width": "110px"}
    available = ["dense", "oracle"]
    available += ["static"] if static is not None else []
    available += ["dejavu"] if predictors is not None else []
    available += list(THRESHOLD_METHODS) if thresholds is not None else []
    method = w.Dropdown(options=available, value="dejavu" if predictors is not None else "oracle",
                        description="method", style=style)  # fmt: skip
    dense = w.IntSlider(
        value=0, min=0, max=arch.n_layers - 1, description="dense first", style=style
    )
    button = w.Button(description="Recompute", button_style="primary")
    mlp = w.FloatSlider(value=0.5, min=0, max=0.95, step=0.05, description="MLP sparsity",
                        readout_format=".0%", style=style)  # fmt: skip
    heads = w.FloatSlider(value=0.3, min=0, max=0.9, step=0.1, description="head sparsity",
                          readout_format=".0%", style=style)  # fmt: skip
    sparsity = w.FloatSlider(value=0.5, min=0, max=0.8, step=0.05, description="sparsity",
                             readout_format=".0%", style=style)  # fmt: skip
    alloc = w.Dropdown(
        options=["uniform", "greedy"], value=allocation, description="allocation", style=style
    )
    out = w.HTML()

    def show(_=None):
        m = method.value
        for widget, on in (
            (mlp, m in UNIT_METHODS),
            (heads, m in UNIT_METHODS),
            (sparsity, m in THRESHOLD_METHODS),
            (alloc, VOCAB_METHODS[m].allocation == "greedy"),
        ):
            widget.layout.display = None if on else "none"

    def run(_=None):
        button.disabled = True
        out.value = "<i>computing…</i>"
        m = method.value
        kw = _kwargs(m, mlp.value, heads.value, sparsity.value, dense.value, predictors, static,
                     thresholds, alloc.value, arch)  # fmt: skip
        try:
            r = sparse_eval(model, windows, progress=False, **kw)
            gen_kw = {k: v for k, v in kw.items() if k != "method"}
            if m in ("dejavu", "static"):  # DejaVu-style decoding, deferred KV for skipped heads
                gen_kw = dict(mlp_sparsity=mlp.value, head_sparsity=heads.value,
                              dense_layers=range(dense.value),
                              predictors=predictors if m == "dejavu" else None,
                              static=static if m == "static" else None)  # fmt: skip
            text = sample(model, tokenizer, prompt, method=m, **gen_kw)
            speed = step_speedup(arch, vocab, r.bytes_per_token_fraction, windows.shape[1])
            out.value = (
                f"<b>perplexity</b> {r.perplexity:.2f} ({m}, {windows.numel():,} tokens) · "
                f"<b>weight bytes read</b> {r.bytes_per_token_fraction:.2f} of dense · "
                f"<b>predicted speedup</b> {speed:.2f}× (bytes moved, batch 1)<br>"
                f"<b>sample</b>: <i>{html.escape(prompt)}</i>{html.escape(text)}"
            )
        except ValueError as e:  # e.g. a greedy allocation the calibration does not have
            out.value = f"<b>cannot run this budget</b>: {html.escape(str(e))}"
        finally:
            button.disabled = False

    method.observe(show, names="value")
    button.on_click(run)
    show()
    run()
    return w.VBox([w.HBox([method, dense, button]), w.HBox([mlp, heads, sparsity, alloc]), out])
