"""Tables and figures for the sparse-kernel chapter (Deja Vu §4.4, Appendix E).

:func:`load` measures live on a GPU (a reduced grid, same harness as ``kernels/bench_*.py``)
and otherwise reads the recorded ``results/sparse_mlp.json`` and ``results/sparse_attention.json``
with their provenance, so every figure can say which GPU and date its numbers come from.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch

from .. import results
from ..kernels import tuning

__all__ = [
    "attention_sentence",
    "bandwidth_figure",
    "decode_bytes_table",
    "down_tile_sentence",
    "fit_sentence",
    "frac_table",
    "gather_sentence",
    "load",
    "overhead_fit",
    "speedup_figure",
    "threshold_table",
    "transactions_table",
    "union_sentence",
]

NAMES = {"dense": "dense cuBLAS", "torch": "torch index_select + matmul", "triton": "ours (Triton)"}


def load(*, live: bool | None = None, dims=(12288,), kept=(0.5, 0.2, 0.1, 0.05), batches=(1, 16)):
    """(mlp rows, attention rows, provenance, measured_live) as DataFrames; a recording's
    provenance is the MLP file's, with the attention file's under ``"attention"``.

    ``live`` defaults to "a CUDA GPU is present"; live runs measure ``dims`` x ``kept`` x
    ``batches`` for both projections and OPT-175B attention at 50% of heads at each of
    ``batches``.

    >>> mlp, attn, prov, live = load(live=False)  # the recorded run, whatever machine this is
    >>> live, "gpu" in prov, list(mlp.columns[:5])
    (False, True, ['op', 'd', 'hidden', 'kept', 'k'])
    >>> sorted(set(attn.provider))
    ['dense', 'torch', 'triton']
    """
    live = torch.cuda.is_available() if live is None else live
    if not live:
        mlp, prov = results.load("sparse_mlp")
        attn, aprov = results.load("sparse_attention")
        prov = {**prov, "attention": aprov}  # a run of its own: its own commit and date
        if "tuning" in attn:  # the tile sweep's rows; the table rows have no flag
            attn = attn[attn["tuning"].isna()]
        return mlp, attn, prov, False
    from ..bench.kernels import AttentionCase, MlpCase, attention_row, mlp_row
    from ..bench.timing import copy_ceiling

    prov = results.provenance("notebooks/60_sparse_kernels.md (live)")
    prov["copy_tbps"] = copy_ceiling()
    rows, dense = [], {}
    for d in dims:
        case = MlpCase(d, min_kept=min(kept))
        for op in ("up", "down"):
            for b in batches:
                for k in kept:
                    for p in ("dense", "torch", "triton"):
                        rows.append(mlp_row(case, op, k, b, p, dense_cache=dense))
        del case
        torch.cuda.empty_cache()
    attn_rows, adense = [], {}
    for b in batches:
        acase = AttentionCase(batch=b)
        for p in ("dense", "torch", "triton"):
            attn_rows.append(attention_row(acase, 0.5, p, dense_cache=adense))
        del acase
        torch.cuda.empty_cache()
    return pd.DataFrame(rows), pd.DataFrame(attn_rows), prov, True


def decode_bytes_table(dims=(4096, 8192, 12288), tbps: float = 4.27) -> pd.DataFrame:
    """Bytes one decoded token reads per MLP (fc1 + fc2, fp16) and the time at ``tbps``.

    >>> t = decode_bytes_table()  # OPT-6.7B, -30B and -175B widths
    >>> t.loc[12288].round(1).tolist()  # MB, FLOPs per byte, us per layer at 4.27 TB/s
    [2415.9, 1.0, 565.8]
    """
    rows = []
    for d in dims:
        weights = 2 * (4 * d * d) * 2  # two [4d, d] matrices, 2 bytes each
        rows.append({
            "d": d,
            "MLP weights per layer (MB)": weights / 1e6,
            "FLOPs per byte at batch 1": 2 * (2 * 4 * d * d) / weights,
            "time per layer at the copy ceiling (us)": weights / (tbps * 1e12) * 1e6,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("d")


def transactions_table(d: int = 12288, line: int = 128, esize: int = 2) -> pd.DataFrame:
    """128-byte memory transactions to read one selected neuron's fc2 weights, by layout.

    >>> transactions_table()  # OPT-175B, d = 12288, fp16
                                       transactions  bytes fetched  bytes used
    layout
    W2 (nn.Linear, [d, 4d]): a column         12288        1572864       24576
    W2^T ([4d, d]): a row                       192          24576       24576
    """
    row_major = -(-d * esize // line)  # W2^T: the neuron's d weights are one contiguous row
    column = d  # W2 as nn.Linear stores it: one weight per row of d, each in its own line
    return pd.DataFrame(
        {
            "layout": ["W2 (nn.Linear, [d, 4d]): a column", "W2^T ([4d, d]): a row"],
            "transactions": [column, row_major],
            "bytes fetched": [column * line, row_major * line],
            "bytes used": [d * esize, d * esize],
        }
    ).set_index("layout")


def frac_table(mlp: pd.DataFrame, col: str = "frac_ideal_graph") -> pd.DataFrame:
    """Our speedup over dense as a fraction of the ideal 1/kept, by (op, batch) x (d, kept).

    >>> t = frac_table(load(live=False)[0])
    >>> list(t.index.names), list(t.columns.names)
    (['op', 'batch'], ['d', 'kept'])
    """
    ours = mlp[mlp.provider == "triton"]
    return ours.pivot_table(index=["op", "batch"], columns=["d", "kept"], values=col).round(2)


def overhead_fit(mlp: pd.DataFrame) -> pd.DataFrame:
    """Per (op, d, batch): fit graph time = fixed + bytes / bandwidth over the kept fractions.

    The fixed part (launch, first loads, tail) does not shrink with the kept fraction, so it
    caps the fraction of ideal at small budgets: cap = t_ideal / (t_ideal + fixed).

    >>> fit = overhead_fit(load(live=False)[0])
    >>> list(fit.columns)
    ['op', 'd', 'batch', 'kept', 'streaming TB/s', 'fixed us', 'cap (fraction of ideal)', 'measured']
    """
    rows = []
    for (op, d, b), g in mlp[mlp.provider == "triton"].groupby(["op", "d", "batch"]):
        slope, fixed = np.polyfit(g["bytes"] / 1e6, g["graph_ms"] * 1e3, 1)  # us per MB, us
        dense = mlp[(mlp.provider == "dense") & (mlp.op == op) & (mlp.d == d) & (mlp.batch == b)]
        t_dense = dense["graph_ms"].iloc[0] * 1e3
        for kept in sorted(g["kept"]):
            t_ideal = t_dense * kept
            rows.append({"op": op, "d": d, "batch": b, "kept": kept,
                         "streaming TB/s": 1e6 / slope / 1e12 * 1e6, "fixed us": fixed,
                         "cap (fraction of ideal)": t_ideal / (t_ideal + max(fixed, 0.0)),
                         "measured": float(g[g.kept == kept]["frac_ideal_graph"].iloc[0])})  # fmt: skip
    return pd.DataFrame(rows)


def speedup_figure(mlp: pd.DataFrame, *, d: int = 12288, batch: int = 1):
    """Speedup over dense (graph replay) vs kept fraction, ours and torch, with the ideal.

    >>> fig = speedup_figure(load(live=False)[0])
    >>> fig.layout.title.text
    'Sparse MLP projections, d = 12288, batch 1 (CUDA-graph replay)'
    """
    import plotly.express as px
    import plotly.graph_objects as go

    sub = mlp[(mlp.d == d) & (mlp.batch == batch) & (mlp.provider != "dense")].copy()
    sub["method"] = sub.provider.map(NAMES)
    fig = px.line(sub.sort_values("kept"), x="kept", y="speedup_graph", color="method",
                  facet_col="op", markers=True, log_x=True, log_y=True,
                  labels={"kept": "kept fraction", "speedup_graph": "speedup over dense"},
                  title=f"Sparse MLP projections, d = {d}, batch {batch} (CUDA-graph replay)")  # fmt: skip
    ks = np.geomspace(sub.kept.min(), sub.kept.max(), 20)
    for col in (1, 2):
        fig.add_trace(go.Scatter(x=ks, y=1 / ks, mode="lines", line=dict(dash="dash", color="grey"),
                                 name="ideal 1 / kept", showlegend=col == 1), row=1, col=col)  # fmt: skip
    fig.for_each_annotation(lambda a: a.update(text=a.text.replace("op=", "projection: ")))
    fig.update_xaxes(tickvals=[0.05, 0.1, 0.2, 0.5, 1.0])
    fig.update_yaxes(tickvals=[0.5, 1, 2, 5, 10, 20])
    return fig


def bandwidth_figure(mlp: pd.DataFrame, ceiling: float, *, d: int = 12288, batch: int = 1):
    """Achieved TB/s over the bytes that must move, against the measured copy ceiling.

    >>> mlp, _, prov, _ = load(live=False)
    >>> fig = bandwidth_figure(mlp, prov["copy_tbps"])
    >>> fig.layout.annotations[-1].text  # the recorded ceiling, drawn as a dotted line
    'copy ceiling ... TB/s'
    """
    import plotly.express as px

    sub = mlp[(mlp.d == d) & (mlp.batch == batch)].copy()
    sub["method"] = sub.provider.map(NAMES)
    sub.loc[sub.provider == "dense", "kept"] = 1.0
    sub = sub.drop_duplicates(["op", "method", "kept"]).sort_values("kept")
    fig = px.line(sub, x="kept", y="graph_tbps", color="method", facet_col="op", markers=True,
                  log_x=True, labels={"kept": "kept fraction", "graph_tbps": "TB/s"},
                  title=f"Achieved bandwidth, d = {d}, batch {batch} (dense drawn at kept = 1)")  # fmt: skip
    if ceiling == ceiling:  # not NaN
        fig.add_hline(y=ceiling, line_dash="dot", line_color="black",
                      annotation_text=f"copy ceiling {ceiling:.2f} TB/s")  # fmt: skip
    fig.for_each_annotation(lambda a: a.update(text=a.text.replace("op=", "projection: ")))
    fig.update_xaxes(tickvals=[0.05, 0.1, 0.2, 0.5, 1.0])
    return fig


def threshold_table(name: str = "threshold_gemv") -> tuple[pd.DataFrame, dict]:
    """The recorded threshold GEMV (TEAL/WINA's input-sparse layer) against dense cuBLAS, the
    compacting kernel and TEAL's published kernel, one row per (shape, batch, kept), and the
    run's provenance. ``ours`` is what the wrapper runs: the tile kernel for one token
    (:mod:`dejavu_lab.kernels.threshold.tile`), the compacting kernel for a union batch.

    >>> t, prov = threshold_table()
    >>> list(t.columns[:4]), "gpu" in prov
    (['dense (µs)', 'ours (µs)', 'compacting (µs)', "TEAL's kernel (µs)"], True)
    >>> bool((t["ours (µs)"] > 0).all())
    True
    """
    df, prov = results.load(name)
    if "compact_us" not in df:  # recorded before the tile kernel: ours was the compacting one
        df = df.assign(compact_us=np.nan)
    # a union batch's "ours" is the compacting kernel
    df = df.assign(compact_us=df["compact_us"].fillna(df["ours_us"].where(df["batch"] > 1)))
    out = pd.DataFrame({
        "shape": df["shape"], "batch": df["batch"], "kept": df["kept"],
        "dense (µs)": df["dense_us"], "ours (µs)": df["ours_us"],
        "compacting (µs)": df["compact_us"],
        "TEAL's kernel (µs)": df["teal_us"] if "teal_us" in df else np.nan,
        "of ideal": df["frac_ideal"], "TB/s": df["ours_tbps"],
    })  # fmt: skip
    return out.set_index(["shape", "batch", "kept"]), prov


def _ratio_range(lo: float, hi: float) -> str:
    return f"{lo:.1f}×" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}×"


def gather_sentence(mlp: pd.DataFrame, d: int, batch: int = 1) -> str:
    """What the index_select + matmul baseline costs in the run drawn (batch 1, width ``d``):
    its time against the dense layer at the largest kept fraction and against our kernel.

    >>> gather_sentence(load(live=False)[0], 12288)
    "At d = 12288 it takes ...× the dense layer's time at 50% kept, and ...× our kernel's across the budgets."
    """
    b = mlp[(mlp.d == d) & (mlp.batch == batch)]
    t = b.pivot_table(index=["op", "kept"], columns="provider", values="graph_ms")
    if not {"dense", "torch", "triton"} <= set(t.columns):
        return f"This run has no baseline at d = {d}."
    top = t.index.get_level_values("kept").max()
    vs_dense = (t["torch"] / t["dense"]).xs(top, level="kept")
    vs_ours = t["torch"] / t["triton"]
    return (f"At d = {d} it takes {_ratio_range(vs_dense.min(), vs_dense.max())} the dense "
            f"layer's time at {top:.0%} kept, and {_ratio_range(vs_ours.min(), vs_ours.max())} "
            "our kernel's across the budgets.")  # fmt: skip


def fit_sentence(fit: pd.DataFrame, d: int, batch: int = 1) -> str:
    """How the fitted cap (:func:`overhead_fit`) compares with the measured fraction of ideal,
    per projection, in the run drawn.

    >>> fit_sentence(overhead_fit(load(live=False)[0]), 12288)
    "At batch 1 the up-projection's fixed cost is ~... µs and ...; the down-projection's fixed cost is ~... µs and ..."
    """
    f = fit[(fit.d == d) & (fit.batch == batch)]
    parts, why = [], False
    for op in ("up", "down"):
        g = f[f.op == op]
        if not len(g):
            continue
        gap = g["measured"] - g["cap (fraction of ideal)"]
        fixed = f"the {op}-projection's fixed cost is ~{g['fixed us'].iloc[0]:.0f} µs"
        if gap.abs().max() < 0.015:
            parts.append(f"{fixed} and its cap matches its measured fraction within "
                         f"{gap.abs().max():.2f}")  # fmt: skip
        elif gap.max() > 0:
            parts.append(f"{fixed} and it beats its cap by up to {gap.max():.2f}"
                         + ("" if why else " (it streams faster than cuBLAS's dense GEMV, the "
                            "ideal's denominator)"))  # fmt: skip
            why = True
        else:
            parts.append(f"{fixed} and it stays up to {-gap.min():.2f} under its cap")
    if not parts:
        return f"This run has no fit at d = {d}, batch {batch}."
    return f"At batch {batch} " + "; ".join(parts) + "."


def union_sentence(mlp: pd.DataFrame, d: int, batch: int = 16) -> str:
    """Our kernels' fraction of ideal for a union batch at the two largest kept fractions, or
    one sentence saying the run has no such batch.

    >>> union_sentence(load(live=False)[0], 12288)
    'At batch 16 our kernels reach ... (up) and ... (down) of the ideal at 50% union and ... / ... at 20%.'
    >>> union_sentence(load(live=False)[0].query("batch == 1"), 12288)
    'This run measured no batch of 16 tokens.'
    """
    ours = mlp[(mlp.provider == "triton") & (mlp.d == d) & (mlp.batch == batch)]
    if not len(ours):
        return f"This run measured no batch of {batch} tokens."
    frac = ours.pivot_table(index="kept", columns="op", values="frac_ideal_graph")
    kept = sorted(frac.index, reverse=True)[:2]
    text = (f"At batch {batch} our kernels reach {frac.loc[kept[0], 'up']:.2f} (up) and "
            f"{frac.loc[kept[0], 'down']:.2f} (down) of the ideal at {kept[0]:.0%} union")  # fmt: skip
    if len(kept) > 1:
        text += (f" and {frac.loc[kept[1], 'up']:.2f} / {frac.loc[kept[1], 'down']:.2f} "
                 f"at {kept[1]:.0%}")  # fmt: skip
    return text + "."


def attention_sentence(attn: pd.DataFrame, kept: float = 0.5) -> str:
    """Our sparse attention's fraction of ideal at ``kept`` of the heads, for each batch the
    run measured.

    >>> m, a, _, _ = load(live=False)
    >>> attention_sentence(a)
    '... of the ideal at batch 1 (... at batch 16).'
    >>> attention_sentence(a[a.batch == 1])  # a run that timed one batch says only that one
    '... of the ideal at batch 1.'
    """
    ours = attn[(attn.provider == "triton") & (attn.kept == kept)].sort_values("batch")
    if not len(ours):
        return f"not measured at {kept:.0%} of the heads in this run."
    first, rest = ours.iloc[0], ours.iloc[1:]
    text = f"{first.frac_ideal_graph:.2f} of the ideal at batch {int(first.batch)}"
    if len(rest):
        text += " (" + ", ".join(f"{r.frac_ideal_graph:.2f} at batch {int(r.batch)}"
                                 for r in rest.itertuples()) + ")"  # fmt: skip
    return text + "."


def down_tile_sentence() -> str:
    """The batch-1 down projection's two kernels at DejaVu's points, from each GPU's tuning
    table (``kernels/bench_sparse_mlp.py --tune-dejavu``): the best one-tile configuration's
    share of the bytes floor against the best split one's, over the points.

    >>> print(down_tile_sentence())
    At batch 1 the engine now runs ... of the bytes floor against ... for the best split configuration ...
    """
    parts = []
    for path in sorted(tuning.TUNED_DIR.glob("tuning_sparse_mlp_down_*.json")):
        data = json.loads(path.read_text())
        best: dict = {}
        for r in data["rows"]:
            mode = "tile" if r["config"].get("mode") == "tile" else "split"
            key = (r["d_in"], r["d_out"], mode)
            best[key] = max(best.get(key, 0.0), float(r["frac_ideal"]))
        tile = [v for (_, _, m), v in best.items() if m == "tile"]
        split = [v for (_, _, m), v in best.items() if m == "split"]
        if tile and split:
            parts.append(f"on the {data['provenance']['gpu']}, at {len(tile)} points from OPT-13B "
                         f"to OPT-66B and Llama-3-8B, its best tile reached {min(tile):.2f}-"
                         f"{max(tile):.2f} of the bytes floor against {min(split):.2f}-"
                         f"{max(split):.2f} for the best split configuration "
                         f"(dejavu_lab/kernels/tuned/{path.name})")  # fmt: skip
    if not parts:
        return "No GPU has recorded the down projection's tiles yet."
    return ("At batch 1 the engine now runs the down projection on TEAL's grid instead (one tile "
            "of kept rows by output columns per program, fp32 atomics, "
            "`dejavu_lab.kernels.mlp.down_tile`): " + "; ".join(parts) + ".")  # fmt: skip
