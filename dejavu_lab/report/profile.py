"""Inside the decode step's CUDA graph: GPU time per kernel, grouped by what it does.

Reads what ``kernels/profile_engine.py`` recorded (``results/engine_profile.json``: a captured
decode step replayed under ``torch.profiler``, each kernel's time and launch count per step) and
groups the kernels into the parts a reader can act on:

- ``weight GEMVs`` — the reads of the weight matrices: cuBLAS's GEMVs and our gather /
  threshold / fused-MLP kernels (what sparsity shrinks);
- ``lm_head`` — the one GEMV over the vocabulary per step;
- ``attention`` — scores, softmax and the weighted sum over the KV cache (our attention kernels,
  or PyTorch's batched GEMVs and softmax in the dense path);
- ``norms``, ``small ops`` (elementwise adds, activations, RoPE, copies, indexing,
  concatenation, reductions) and ``idle`` (the replay's wall time minus the kernels' time:
  the gaps between launches).

The step's floor is its bytes over the copy ceiling measured in the same run.
"""

from __future__ import annotations

import pandas as pd
import plotly.express as px

from .. import results

__all__ = ["PARTS", "bound_table", "fused_table", "kernel_part", "load_profile", "profile_figure",
           "profile_table"]  # fmt: skip

NAME = "engine_profile"
FUSED = "engine_methods"  # kernels/bench_engine.py --plain: each decoder timed fused and plain
PARTS = ("weight GEMVs", "lm_head", "attention", "norms", "small ops", "idle")
# the tile kernel's finalize is its split-K reduction (with the activation), counted with
# the GEMVs as cuBLAS's splitKreduce is
_OURS_GEMV = ("sparse_mlp_up", "sparse_mlp_down", "threshold_gemv", "threshold_tile",
              "threshold_finalize", "fused_mlp", "cats", "qkv_rope", "rows_sums")  # fmt: skip
_ATTENTION = ("sparse_attention", "softmax", "gemvx", "cutlass::Kernel2", "flash", "fmha")
_GEMM = ("nvjet", "cublas", "gemv", "gemm", "splitKreduce", "cutlass")


def kernel_part(name: str, launches: float) -> str:
    """The part of the step a kernel belongs to, from its name and its launches per step.

    >>> kernel_part("threshold_gemv_kernel", 4.0), kernel_part("anon::softmax_warp_forward", 1.0)
    ('weight GEMVs', 'attention')
    >>> kernel_part("threshold_tile_kernel", 4.0), kernel_part("threshold_finalize_kernel", 4.0)
    ('weight GEMVs', 'weight GEMVs')
    >>> kernel_part("rows_sums_kernel", 1.0)  # CATS's gate: a GEMV, though once per layer
    'weight GEMVs'
    >>> kernel_part("nvjet_sm90_hsh_256x8_64x6_2x1_v_bz_TNT", 1.0)  # once per step
    'lm_head'
    """
    if any(k in name for k in _OURS_GEMV):
        return "weight GEMVs"
    if any(k in name for k in _ATTENTION):
        return "attention"
    if "row_norm" in name or "residual_norm" in name:  # the fused add + norm counts as a norm
        return "norms"
    if any(k in name for k in _GEMM):
        return "lm_head" if launches < 1.5 else "weight GEMVs"
    return "small ops"


def load_profile(name: str = NAME) -> tuple[pd.DataFrame, dict]:
    """The recorded profile as one row per (model, method, kernel), and its provenance.

    >>> df, prov = load_profile()
    >>> {"model", "method", "kernel", "us_per_step", "launches", "part"} <= set(df.columns)
    True
    """
    df, prov = results.load(name)
    kernels = df[df["kind"] == "kernel"].copy()
    pairs = zip(kernels["kernel"], kernels["launches"], strict=True)
    kernels["part"] = [kernel_part(k, p) for k, p in pairs]
    steps = df[df["kind"] == "step"].copy()
    idle = steps.assign(kind="kernel", kernel="(idle between launches)", launches=0.0,
                        us_per_step=steps["idle_us"], per_layer=0.0, part="idle")  # fmt: skip
    cols = ["model", "method", "sparsity", "prompt", "n_layers", "wall_us", "floor_us"]
    kernels = kernels.drop(columns=[c for c in ("wall_us", "floor_us") if c in kernels])
    kernels = kernels.merge(steps[cols], on=["model", "method", "sparsity", "prompt", "n_layers"])
    out = pd.concat([kernels, idle[kernels.columns.intersection(idle.columns)]], ignore_index=True)
    return out, prov


def profile_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and method: step time, its floor, launches per layer, and µs per part.

    >>> t = profile_table(load_profile()[0])
    >>> list(t.columns[:4])
    ['step (us)', 'floor (us)', 'step / floor', 'launches / layer']
    """
    rows = []
    for (model, method), g in df.groupby(["model", "method"], sort=False):
        r = {"model": model, "method": method, "step (us)": g["wall_us"].iloc[0],
             "floor (us)": g["floor_us"].iloc[0]}  # fmt: skip
        r["step / floor"] = r["step (us)"] / r["floor (us)"]
        r["launches / layer"] = g["launches"].sum() / g["n_layers"].iloc[0]
        by = g.groupby("part")["us_per_step"].sum()
        r.update({f"{p} (us)": float(by.get(p, 0.0)) for p in PARTS})
        rows.append(r)
    return pd.DataFrame(rows).set_index(["model", "method"])


def bound_table(table: pd.DataFrame) -> pd.DataFrame:
    """How far each method could go if its weight reads alone got faster.

    ``table`` is :func:`profile_table`'s. Per model and method: the *fixed* work that sparsity
    does not shrink (attention, norms, small ops, idle, as measured), the step with every byte
    read at the copy ceiling and that fixed work left as it is (``floor + fixed``; the cache's
    bytes count in both, a few percent of the floor at prompt 512, so this errs on the slow
    side), and the speedup over the model's measured dense step that such a step would give.

    >>> b = bound_table(profile_table(load_profile()[0]))
    >>> list(b.columns)
    ['step (us)', 'fixed (us)', 'ceiling step (us)', 'speedup now', 'speedup bound']
    """
    fixed = table[[f"{p} (us)" for p in ("attention", "norms", "small ops", "idle")]].sum(axis=1)
    out = pd.DataFrame({"step (us)": table["step (us)"], "fixed (us)": fixed,
                        "ceiling step (us)": table["floor (us)"] + fixed})  # fmt: skip
    dense = table.xs("dense", level="method")["step (us)"]
    models = out.index.get_level_values("model")
    out["speedup now"] = dense.reindex(models).to_numpy() / out["step (us)"]
    out["speedup bound"] = dense.reindex(models).to_numpy() / out["ceiling step (us)"]
    return out


def profile_figure(df: pd.DataFrame):
    """Stacked bars: µs per step by part, one bar per method, one panel per model, floor marked.

    >>> fig = profile_figure(load_profile()[0])
    >>> list(dict.fromkeys(trace.name for trace in fig.data))  # one trace per part and panel
    ['weight GEMVs', 'lm_head', 'attention', 'norms', 'small ops', 'idle', 'bytes floor']
    """
    parts = df.groupby(["model", "method", "part"], sort=False)["us_per_step"].sum().reset_index()
    fig = px.bar(parts, x="method", y="us_per_step", color="part", facet_col="model",
                 barmode="stack", category_orders={"part": list(PARTS)},
                 labels={"us_per_step": "µs per decode step", "method": ""})  # fmt: skip
    floors = df.groupby(["model", "method"], sort=False)["floor_us"].first().reset_index()
    for i, model in enumerate(floors["model"].unique(), start=1):
        f = floors[floors["model"] == model]
        fig.add_scatter(x=f["method"], y=f["floor_us"], mode="markers", name="bytes floor",
                        marker={"symbol": "line-ew-open", "size": 28, "color": "black"},
                        showlegend=i == 1, row=1, col=i)  # fmt: skip
    fig.update_yaxes(matches=None, showticklabels=True)
    return fig


def fused_table(name: str = FUSED) -> tuple[pd.DataFrame, dict]:
    """ms per token of each decoder with its epilogues fused (:mod:`dejavu_lab.engine.fused_step`)
    and plain, timed in one run (``bench_engine.py --plain``), and the speedup over the dense
    decoder either way; with the recording's provenance. Where the recording has them, also the
    fused step with TEAL's and WINA's hidden activations finished in their own launch, and
    without programmatic dependent launch (:mod:`dejavu_lab.kernels.pdl`), and CATS with
    cuBLAS's gate in place of the split-K one (:mod:`dejavu_lab.kernels.cats.sums`).

    >>> t, prov = fused_table()
    >>> list(t.columns)  # doctest: +NORMALIZE_WHITESPACE
    ['plain (ms)', 'fused, hidden apart (ms)', 'fused, cuBLAS gate (ms)', 'fused, no PDL (ms)',
     'fused (ms)', 'saved (ms)', 'vs dense, plain', 'vs dense, fused']
    >>> bool((t["saved (ms)"] > 0).all())
    True
    """
    df, prov = results.load(name)
    e2e = df[(df["kind"] == "e2e") & df["plain_ms_per_token"].notna()].copy()
    e2e["variant"] = [
        e if s == 0 else f"{e} {s:.0%}" for e, s in zip(e2e["engine"], e2e["sparsity"], strict=True)
    ]
    t = e2e.set_index(["model", "variant"])[["plain_ms_per_token", "ms_per_token"]]
    t.columns = ["plain (ms)", "fused (ms)"]
    t["saved (ms)"] = t["plain (ms)"] - t["fused (ms)"]
    if "hidden_unfused_ms_per_token" in e2e:  # TEAL/WINA: fused, but their own hidden launch
        t.insert(1, "fused, hidden apart (ms)", e2e["hidden_unfused_ms_per_token"].to_numpy())
    if "cublas_gate_ms_per_token" in e2e:  # CATS: its gate through cuBLAS
        t.insert(t.columns.get_loc("fused (ms)"), "fused, cuBLAS gate (ms)",
                 e2e["cublas_gate_ms_per_token"].to_numpy())  # fmt: skip
    if "no_pdl_ms_per_token" in e2e:  # fused, each kernel launched after the last one ended
        t.insert(t.columns.get_loc("fused (ms)"), "fused, no PDL (ms)",
                 e2e["no_pdl_ms_per_token"].to_numpy())  # fmt: skip
    dense = t.xs("dense", level="variant")
    models = t.index.get_level_values("model")
    t["vs dense, plain"] = dense["plain (ms)"].reindex(models).to_numpy() / t["plain (ms)"]
    t["vs dense, fused"] = dense["fused (ms)"].reindex(models).to_numpy() / t["fused (ms)"]
    return t, prov
