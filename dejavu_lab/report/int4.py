"""Tables and figures of the 4-bit chapter: activation sparsity on group-wise int4 weights.

Deja Vu §5.3 reports that contextual sparsity and 4-bit weights (W4A16) compose on OPT-175B
without compounding their errors. This module puts the chapter's three questions into tables:

- **bytes** — what a decode step reads in fp16 and in int4, dense and with TEAL's input
  sparsity (:func:`bytes_table`, computed by :func:`dejavu_lab.step_bytes.step_bytes`);
- **quality** — perplexity of each weight format, dense and sparse, from the CPU recordings of
  :mod:`dejavu_lab.measure.quant_quality` (:func:`load_quality`, :func:`quality_table`), and a
  small live check on the demo model (:func:`live_perplexity`);
- **speed** — the int4 GEMVs and the int4 engine on an H200, in
  :mod:`dejavu_lab.report.int4_speed`;

and closes with :mod:`dejavu_lab.report.int4_budget`: for each quality budget, the combination
that reads the fewest bytes, chosen from the recordings shown.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from .. import results
from ..arch import get_arch
from ..models import PRESETS
from ..quant import GROUPS
from ..step_bytes import step_bytes

__all__ = [
    "PAPER",
    "QUALITY_FILES",
    "bytes_figure",
    "bytes_sentence",
    "bytes_table",
    "compound_sentence",
    "fitting_group",
    "format_label",
    "gguf_types",
    "live_perplexity",
    "live_sentence",
    "load_quality",
    "quality_caption",
    "quality_figure",
    "quality_table",
]

TEAL_SITES = ("attn_in", "o_in", "mlp_in", "down_in")  # the inputs TEAL and WINA threshold
#: Deja Vu §5.3 (OPT-175B, zero-shot accuracy, 75% overall sparsity, W4A16), as reported
PAPER = {
    "tasks": ["CB", "COPA", "OpenBookQA", "PIQA", "RTE", "Winogrande", "Lambada"],
    "OPT-175B": [0.352, 0.86, 0.446, 0.809, 0.602, 0.726, 0.758],
    "DejaVu (75% sparse)": [0.402, 0.85, 0.450, 0.802, 0.592, 0.726, 0.753],
    "W4A16": [0.356, 0.85, 0.440, 0.806, 0.574, 0.714, 0.757],
    "DejaVu + W4A16": [0.365, 0.86, 0.452, 0.805, 0.592, 0.726, 0.754],
}
# what each weight format of the quality study is, in words
FORMATS = {
    "fp": "16-bit (as loaded)",
    "gguf": "int4 from the GGUF file",
    "rtn-g32": "int4 RTN, group 32",
    "rtn-g64": "int4 RTN, group 64",
    "rtn-g128": "int4 RTN, group 128",
    "mse-g32": "int4 MSE-refined, group 32",
    "mse-g64": "int4 MSE-refined, group 64",
    "mse-g128": "int4 MSE-refined, group 128",
    "act-g32": "int4 activation-weighted, group 32",
    "act-g64": "int4 activation-weighted, group 64",
    "act-g128": "int4 activation-weighted, group 128",
}
# an interaction (sparse rise on int4 over the same rise on fp) within this many percent reads
# as "the errors multiply, no more": the recordings evaluate 2,048 tokens, and two runs of the
# same configuration on other windows move perplexity by a few percent
INDEPENDENT_PCT = 5.0


def format_label(fmt: str, groups: str = "") -> str:
    """A format in words; a mixed-group RTN names its groups (the demo's 'group 128/64').

    >>> format_label("rtn-g32"), format_label("rtn-g128", "128/64")
    ('int4 RTN, group 32', 'int4 RTN, group 128/64')
    """
    if fmt.startswith("rtn-") and "/" in str(groups):
        return f"int4 RTN, group {groups}"
    return FORMATS.get(fmt, fmt)


def _arch(model: str):
    return get_arch(PRESETS[model].config())


def fitting_group(arch, group: int = 128) -> int:
    """The largest int4 group of :data:`~dejavu_lab.quant.GROUPS`, at most ``group``, that
    divides every layer input of ``arch`` (what
    :func:`~dejavu_lab.measure.quant_quality.format_weights` falls back to).

    >>> fitting_group(_arch("llama-3-8b")), fitting_group(_arch("smollm2-135m"))  # 576 wide
    (128, 64)
    """
    widths = (arch.d_model, arch.n_heads * arch.d_head, arch.d_mlp)
    fits = [g for g in GROUPS if g <= group and all(w % g == 0 for w in widths)]
    if not fits:
        raise ValueError(f"no int4 group of {GROUPS} divides the layer inputs {widths}.")
    return max(fits)


def bytes_table(models=("llama-3-8b", "smollm2-135m"), kept=(1.0, 0.75, 0.6, 0.5, 0.4, 0.25),
                *, group: int = 128, context: int = 512) -> pd.DataFrame:  # fmt: skip
    """Bytes one decode step reads (batch 1, ``context`` cached positions) per model preset,
    weight format and kept fraction of TEAL's four inputs, by part, in MB.

    int4 is group-wise (:func:`fitting_group`, fp16 scales and mins) on the decoder layers; the
    KV cache and the unembedding stay fp16. ``vs fp16 dense``: the total against the same
    model's dense fp16 step.

    >>> t = bytes_table(kept=(1.0, 0.5))
    >>> t.query("model == 'llama-3-8b'")[["format", "kept", "layers MB", "vs fp16 dense"]].round(3)
                 format  kept  layers MB  vs fp16 dense
    0              fp16   1.0  13958.644          1.000
    1              fp16   0.5   6979.322          0.537
    2  int4 (group 128)   1.0   3707.765          0.320
    3  int4 (group 128)   0.5   1962.934          0.204
    """
    rows = []
    for model in models:
        arch, vocab = _arch(model), PRESETS[model].vocab
        g = fitting_group(arch, group)
        dense = step_bytes(arch, vocab=vocab, context=context)["total"]
        for fmt, kw in (("fp16", {}), (f"int4 (group {g})", {"int4_group": g})):
            for k in kept:
                site = dict.fromkeys(TEAL_SITES, k)
                b = step_bytes(arch, vocab=vocab, context=context, site_kept=site, **kw)
                rows.append({"model": model, "format": fmt, "group": g if kw else 0, "kept": k,
                             "layers MB": (b["attention"] + b["mlp"]) / 1e6,
                             "KV cache MB": b["kv_cache"] / 1e6, "lm_head MB": b["lm_head"] / 1e6,
                             "total MB": b["total"] / 1e6, "vs fp16 dense": b["total"] / dense})  # fmt: skip
    return pd.DataFrame(rows)


def bytes_figure(table: pd.DataFrame):
    """MB per token against the kept fraction: one panel per model, fp16 and int4, with the
    bytes no activation sparsity skips (the unembedding and the KV cache) dotted.

    >>> fig = bytes_figure(bytes_table())
    >>> [t.name for t in fig.data][:3], fig.layout.annotations[1].text
    (['fp16', 'int4', 'lm_head + KV cache (not skipped)'], 'smollm2-135m<br>(int4: group 64)')
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    models = list(dict.fromkeys(table["model"]))
    groups = {m: int(table.loc[table["model"] == m, "group"].max()) for m in models}
    titles = [f"{m}<br>(int4: group {groups[m]})" for m in models]  # two lines: no overlap
    fig = make_subplots(rows=1, cols=len(models), subplot_titles=titles, horizontal_spacing=0.12)
    colors = ["#444444", "#d62728", "#1f77b4"]
    for col, model in enumerate(models, start=1):
        t = table[table["model"] == model]
        for i, (fmt, f) in enumerate(t.groupby("format", sort=False)):
            name = fmt.split(" (")[0]  # "int4": each panel's title names its group
            fig.add_trace(go.Scatter(x=f["kept"], y=f["total MB"], name=name, mode="lines+markers",
                                     line=dict(color=colors[i % 3]), legendgroup=name,
                                     showlegend=col == 1), row=1, col=col)  # fmt: skip
        floor = t["KV cache MB"] + t["lm_head MB"]
        fig.add_trace(go.Scatter(x=t["kept"], y=floor, name="lm_head + KV cache (not skipped)",
                                 mode="lines", line=dict(color="grey", dash="dot"),
                                 legendgroup="floor", showlegend=col == 1), row=1, col=col)  # fmt: skip
        fig.update_yaxes(rangemode="tozero", row=1, col=col)
    fig.update_xaxes(title_text="kept fraction", autorange="reversed")
    fig.update_yaxes(title_text="MB per token", row=1, col=1)
    # room above the panels' two-line titles for the figure's own
    fig.update_layout(title="Bytes one decode step reads (batch 1, context 512)",
                      margin=dict(t=130))  # fmt: skip
    return fig


def bytes_sentence(table: pd.DataFrame, model: str = "llama-3-8b", kept: float = 0.5) -> str:
    """The bytes table's lesson for ``model`` in one sentence: what int4, sparsity and both cut.

    >>> bytes_sentence(bytes_table())
    "At llama-3-8b shape a dense fp16 token reads 15.08 GB; int4 (group 128) cuts it 3.1×, TEAL at 50% kept 1.9× and both together 4.9× — not the 8× of the payload alone, since ..."
    """
    t = table[table["model"] == model].set_index(["format", "kept"])
    fp16 = t.loc[("fp16", 1.0)]
    q4 = next(f for f in t.index.get_level_values("format") if f.startswith("int4"))
    cut = {k: fp16["total MB"] / t.loc[k, "total MB"]
           for k in (("fp16", kept), (q4, 1.0), (q4, kept))}  # fmt: skip
    ideal = 4 / kept
    rest = (fp16["lm_head MB"] + fp16["KV cache MB"]) / fp16["total MB"]
    return (f"At {model} shape a dense fp16 token reads {fp16['total MB'] / 1e3:.2f} GB; {q4} "
            f"cuts it {cut[(q4, 1.0)]:.1f}×, TEAL at {kept:.0%} kept {cut[('fp16', kept)]:.1f}× "
            f"and both together {cut[(q4, kept)]:.1f}× — not the {ideal:.0f}× of the payload "
            f"alone, since the unembedding and the KV cache ({rest:.0%} of the dense step) stay "
            "fp16 and every group's scales are read as soon as one of its channels is kept.")  # fmt: skip


QUALITY_FILES = ("quant_quality_demo", "quant_quality_qwen2.5-0.5b", "quant_quality_qwen2.5-1.5b")


def load_quality(names=QUALITY_FILES):
    """(rows of the recorded quality studies stacked, with the recording's ``model`` and
    ``file``; provenance per file).

    >>> frame, provs = load_quality()
    >>> sorted(set(frame["file"])), frame.groupby("file").size().tolist()
    (['quant_quality_demo', 'quant_quality_qwen2.5-0.5b', 'quant_quality_qwen2.5-1.5b'], [23, 31, 30])
    """
    frames, provs = [], {}
    for name in names:
        df, prov = results.load(name)
        frames.append(df.assign(model=prov.get("model", name), file=name))
        provs[name] = prov
    return pd.concat(frames, ignore_index=True), provs


def gguf_types(frame: pd.DataFrame, file: str = "quant_quality_qwen2.5-0.5b") -> str:
    """The GGUF block types (and tensor counts) of a recording's ``"gguf"`` format, in words.

    >>> gguf_types(load_quality()[0])
    'Q4_K (12 tensors), Q5_0 (132), Q6_K (12) and Q8_0 (12)'
    """
    text = frame.loc[(frame["file"] == file) & (frame["format"] == "gguf"), "gguf_types"].iloc[0]
    counts = [f"{t} ({n})" for t, n in json.loads(text).items()]
    counts[0] = counts[0].replace(")", " tensors)")
    return counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " and " + counts[-1]


def quality_caption(prov: dict) -> str:
    """A quality figure's caption from a recording's provenance: model, text, hardware, commit.

    >>> quality_caption(load_quality()[1]["quant_quality_demo"])
    "Model: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32). Text: ..., 2,048 held-out tokens; ... Perplexity recorded on CPU, 1 thread, 2026-12-04, at commit 41b0917."
    """
    cpu = f"CPU ({prov['cpu']})" if prov.get("cpu") else "CPU"
    threads = prov.get("threads", "?")
    return (f"Model: {prov.get('model')}. Text: {prov.get('text')}, {prov.get('tokens', 0):,} "
            f"held-out tokens; thresholds calibrated on {prov.get('calibration_tokens', 0):,} "
            f"tokens. Perplexity recorded on {cpu}, {threads} thread{'' if threads == 1 else 's'}, "
            f"{str(prov.get('date', ''))[:10]}, at commit {str(prov.get('git_sha'))[:7]}.")  # fmt: skip


def quality_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model, format, variant and sparsity: perplexity, its rise over the model's fp dense
    and over the format's own dense, the same variant's rise on fp, and the *interaction* —
    how much more (or less) the sparsity costs on this format than on fp, in percent:
    ``ppl(q, s) · ppl(fp, 0) / (ppl(q, 0) · ppl(fp, s)) − 1``. Zero: the errors multiply,
    no more; positive: the format compounds the sparsity's error.

    >>> t = quality_table(load_quality()[0])
    >>> t.loc[("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)", "rtn-g128",
    ...        "teal (uniform)", 0.5)].drop("groups").astype(float).round(1).tolist()
    [104.2, 162.3, 84.4, 61.3, 14.3, 0.1]
    """
    rows = []
    for (model, _file), m in frame.groupby(["model", "file"], sort=False):
        base = {fmt: float(g.loc[g.variant == "dense", "perplexity"].iloc[0])
                for fmt, g in m.groupby("format") if (g.variant == "dense").any()}  # fmt: skip
        fp = m[m["format"] == "fp"].set_index(["variant", "sparsity"])["perplexity"]
        for r in m.itertuples():
            own = r.perplexity / base[r.format] - 1
            fp_rise = fp.get((r.variant, r.sparsity), math.nan) / base["fp"] - 1
            rows.append({"model": model, "format": r.format, "variant": r.variant,
                         "sparsity": r.sparsity, "perplexity": r.perplexity,
                         "rise over fp dense %": 100 * (r.perplexity / base["fp"] - 1),
                         "rise over own dense %": 100 * own,
                         "same on fp %": 100 * fp_rise,
                         "interaction %": 100 * ((1 + own) / (1 + fp_rise) - 1),
                         "layer bytes vs fp16": r.bytes_vs_fp16, "groups": r.groups})  # fmt: skip
    return pd.DataFrame(rows).set_index(["model", "format", "variant", "sparsity"])


def quality_figure(table: pd.DataFrame, model: str):
    """Perplexity against the decoder layers' bytes per token (vs dense fp16) for one model's
    recording: one colour per variant, one symbol per format, the fp dense line dashed.

    >>> t = quality_table(load_quality()[0])
    >>> fig = quality_figure(t, "Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)")
    >>> sorted({tr.legendgroup for tr in fig.data})
    ['cats', 'dense', 'teal (uniform)', 'wina (uniform)']
    """
    import plotly.graph_objects as go

    from .plots import COLORS

    t = table.reset_index()
    t = t[t["model"] == model]
    fig = go.Figure()
    marks = ["circle", "diamond", "square", "triangle-up", "x", "square-open", "triangle-down",
             "x-open", "star", "hexagon", "cross"]  # fmt: skip
    symbols = dict(zip(FORMATS, marks, strict=True))
    for (fmt, variant), g in t.groupby(["format", "variant"], sort=False):
        g = g.sort_values("layer bytes vs fp16")
        color = COLORS.get(variant.split(" ")[0], "#444444")
        fig.add_trace(go.Scatter(
            x=g["layer bytes vs fp16"], y=g["perplexity"], mode="lines+markers",
            name=f"{variant}, {format_label(fmt, g['groups'].iloc[0])}", legendgroup=variant,
            marker=dict(symbol=symbols.get(fmt, "circle"), size=9, color=color),
            line=dict(color=color, dash="solid" if fmt == "fp" else "dot"),
            text=[f"{s:.0%} sparse" for s in g["sparsity"]],
            hovertemplate="%{text}: ppl %{y:.1f} at %{x:.3f} of fp16's bytes"))  # fmt: skip
    fp = float(t[(t["format"] == "fp") & (t["variant"] == "dense")]["perplexity"].iloc[0])
    fig.add_hline(y=fp, line_dash="dash", line_color="grey", annotation_text="fp dense")
    fig.update_layout(title=f"Perplexity against bytes read: {model.split(' (')[0]}",
                      xaxis_title="decoder-layer bytes per token (dense fp16 = 1)",
                      yaxis_title="perplexity", yaxis_rangemode="tozero")  # fmt: skip
    return fig


def compound_sentence(table: pd.DataFrame, model: str, fmt: str, variant: str = "teal (uniform)"):
    """Whether ``fmt`` compounds ``variant``'s error on ``model``, at each recorded sparsity.

    >>> t = quality_table(load_quality()[0])
    >>> compound_sentence(t, "Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)", "rtn-g32")
    'On Qwen2.5 Coder 0.5B Instruct AWQ, int4 RTN, group 32 costs +5.6% dense; teal (uniform) adds +5.3% / +18.4% / +39.6% over that (25% / 40% / 50% sparse), against +4.6% / +19.5% / +41.8% on fp: interaction +0.7% / -1.0% / -1.6%, the errors multiply, no more.'
    >>> compound_sentence(t, "Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)", "rtn-g128")
    "On Qwen2.5 Coder 0.5B Instruct AWQ, int4 RTN, group 128 has no recorded teal (uniform) points beside its dense one, so whether it compounds the sparsity's error is not measured."
    """
    flat = table.reset_index()
    mine = flat[(flat["model"] == model) & (flat["format"] == fmt)]
    t = mine[mine["variant"] == variant].set_index("sparsity").sort_index()
    label = format_label(fmt, mine["groups"].iloc[0]) if len(mine) else fmt
    name = model.split(" (")[0]
    if t.empty or mine[mine["variant"] == "dense"].empty:
        return (f"On {name}, {label} has no recorded {variant} points beside its dense one, so "
                "whether it compounds the sparsity's error is not measured.")  # fmt: skip
    dense = float(mine.loc[mine["variant"] == "dense", "rise over fp dense %"].iloc[0])
    inter = t["interaction %"]
    if inter.abs().max() <= INDEPENDENT_PCT:
        verdict = "the errors multiply, no more"
    elif (inter > INDEPENDENT_PCT).any():
        verdict = "the format compounds the sparsity's error" + (
            "" if (inter > 0).all() else " at the larger sparsities"
        )
    else:
        verdict = "the sparse rise is smaller on the 4-bit weights"
    pct = " / ".join(f"{s:.0%}" for s in t.index)
    return (f"On {name}, {label} costs {dense:+.1f}% dense; "
            f"{variant} adds {' / '.join(f'{v:+.1f}%' for v in t['rise over own dense %'])} over "
            f"that ({pct} sparse), against "
            f"{' / '.join(f'{v:+.1f}%' for v in t['same on fp %'])} on fp: interaction "
            f"{' / '.join(f'{v:+.1f}%' for v in inter)}, {verdict}.")  # fmt: skip


def live_perplexity(model, tokenizer, formats=("fp", "rtn-g32", "rtn-g64"), *,
                    eval_windows: int = 2, window: int = 512) -> pd.DataFrame:  # fmt: skip
    """Dense perplexity of ``model`` on each weight format, measured now on the quality study's
    first held-out windows (:func:`~dejavu_lab.sparsify.windows.study_windows`), and its rise
    over the first format's.

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")  # Q4_1: group 32 gives its weights back exactly
    >>> t = live_perplexity(model, tok, ("fp", "rtn-g32", "rtn-g64"), eval_windows=1, window=64)
    >>> t[["format", "groups", "rise over fp %"]].round(3).values.tolist()
    [['fp', '', 0.0], ['rtn-g32', '32', 0.0], ['rtn-g64', '64', ...]]
    """
    from contextlib import nullcontext

    from ..corpus import perplexity
    from ..measure.quant_quality import format_weights
    from ..quant.swap import dequantized
    from ..sparsify.frontier import study_windows

    arch = get_arch(model)
    _, held_out = study_windows(tokenizer, window=window, eval_windows=eval_windows)
    rows = []
    for fmt in formats:
        weights, info = format_weights(model, fmt, arch=arch)
        with dequantized(model, weights) if weights is not None else nullcontext():
            ppl = perplexity(model, held_out, progress=False)
        rows.append({"format": fmt, "groups": info["groups"], "perplexity": float(ppl),
                     "tokens": int(held_out.numel())})  # fmt: skip
    out = pd.DataFrame(rows)
    out["rise over fp %"] = 100 * (out["perplexity"] / out["perplexity"].iloc[0] - 1)
    return out


def live_sentence(table: pd.DataFrame | None) -> str:
    """What :func:`live_perplexity`'s table shows about groups 32 and 64, or that the check did
    not run (the demo model could not be loaded).

    >>> live_sentence(pd.DataFrame({"format": ["fp", "rtn-g32", "rtn-g64"],
    ...                             "rise over fp %": [0.0, 0.0, 1.234]}))
    "Group 32 is the file's own format (+0.0% perplexity); group 64 costs +1.2% on these windows."
    >>> live_sentence(None)
    'The live check did not run here (no demo model on this machine); the recorded study below still holds.'
    """
    if table is None:
        return ("The live check did not run here (no demo model on this machine); the recorded "
                "study below still holds.")  # fmt: skip
    rise = table.set_index("format")["rise over fp %"]
    return (f"Group 32 is the file's own format ({rise['rtn-g32']:+.1f}% perplexity); group 64 "
            f"costs {rise['rtn-g64']:+.1f}% on these windows.")  # fmt: skip
