"""Speed of 4-bit weights on a GPU: the int4 GEMVs and the int4 engine (the 4-bit chapter).

:func:`load_speed` measures a short run live on a GPU box, else reads the H200 recordings
``kernels/bench_int4.py`` and ``kernels/bench_engine_int4.py`` write (:data:`FILES`), else
says which are missing and how to record them (:func:`missing_sentence`, :data:`COMMANDS`).
:func:`kernel_table` and :func:`engine_table` shape their rows; the quality and bytes side of
the chapter is :mod:`dejavu_lab.report.int4`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

from .. import results
from ..errors import ResultsError
from . import source

__all__ = [
    "COMMANDS",
    "DECODE_FILE",
    "FILES",
    "LIVE_ARGS",
    "decode_sentence",
    "fused_step_sentence",
    "kept_rows_sentence",
    "listed_rows_sentence",
    "engine_table",
    "kernel_table",
    "load_speed",
    "missing_sentence",
    "recorded_ceiling",
    "recorded_gpu",
    "speed_caption",
    "speed_figure",
    "speed_sentence",
]

#: the H200 recordings the chapter draws, by kind (``results/<name>.json``)
FILES = {
    "kernels": ("int4_gemv_g128", "int4_gemv_g32_64"),
    "engine": ("engine_int4_8b", "engine_int4_13b", "engine_int4_70b"),
}
#: the command that records each file on a GPU box (from the repository root)
COMMANDS = {
    "int4_gemv_g128": "python kernels/bench_int4.py --group 128 --batch 1,16 --name int4_gemv_g128",
    "int4_gemv_g32_64": "python kernels/bench_int4.py --group 32,64 --name int4_gemv_g32_64",
    "engine_int4_8b": "python kernels/bench_engine_int4.py --models llama-3-8b --name engine_int4_8b",
    "engine_int4_13b": "python kernels/bench_engine_int4.py --models llama-2-13b "
    "--name engine_int4_13b",
    "engine_int4_70b": "python kernels/bench_engine_int4.py --models '' --int4-only llama-3-70b "
    "--name engine_int4_70b",
}
#: the sweep that compares the two ways of decoding codes at batch 1 (half2 pairs, fp32 floats)
DECODE_FILE = "int4_gemv_g128_b1"
# a live run on a GPU box: one shape, group 128, batch 1, TEAL at 50% (a minute or two)
LIVE_ARGS = {
    "kernels": ["kernels/bench_int4.py", "--group", "128", "--shapes", "llama3-8b up",
                "--no-sweep", "--no-peer"],
    "engine": ["kernels/bench_engine_int4.py", "--models", "llama-3-8b", "--sparsity", "0.5",
               "--methods", "teal", "--new-tokens", "64"],
}  # fmt: skip


def load_speed(kind: str, live: bool | None = None):
    """(time rows, provenance per file, measured live, recordings missing) of ``kind``
    (``"kernels"`` or ``"engine"``): a short live run on a GPU box (``live=None`` and CUDA
    here: :data:`LIVE_ARGS`, written to ``results/int4_<kind>_live.json``), else the recordings
    of :data:`FILES` that exist. With none, the rows are empty and ``missing`` names them all.

    >>> frame, provs, live, missing = load_speed("engine", live=False)
    >>> live, len(frame) == 0 or "ms_per_token" in frame, set(missing) <= set(FILES["engine"])
    (False, True, True)
    """
    if kind not in FILES:
        raise ValueError(f"kind must be one of {sorted(FILES)}, got {kind!r}.")
    live = torch.cuda.is_available() if live is None else live
    names, missing = list(FILES[kind]), []
    if live:
        root = Path(__file__).resolve().parents[2]
        name = f"int4_{kind}_live"
        script, *args = LIVE_ARGS[kind]
        subprocess.run([sys.executable, str(root / script), *args, "--name", name], check=True)
        names = [name]
    row_kind = "time" if kind == "kernels" else "e2e"
    frame, provs, absent = results.load_many(names, lambda df: df["kind"] == row_kind)
    return frame, provs, live, missing + absent


def speed_caption(provs: dict, live: bool, frame: pd.DataFrame | None = None) -> str:
    """The caption of a speed table or figure: where each file's numbers come from.

    >>> speed_caption({"int4_kernels_live": {"gpu": "NVIDIA H200", "date": "2026-12-05"}}, True)
    'Measured live on NVIDIA H200 (2026-12-05).'
    """
    if live:
        return source.caption(next(iter(provs.values())), live=True)
    parts = []
    for name, prov in provs.items():
        rows = frame[frame["file"] == name] if frame is not None and "file" in frame else None
        parts.append(f"results/{name}.json: {source.origin(prov, live=False, frame=rows)}")
    why = "LIVE = False" if torch.cuda.is_available() else "No GPU here"
    return "<br>".join(parts) + f"<br>{why}: drawn from the recordings."


def missing_sentence(kind: str, missing) -> str:
    """One plain sentence saying which recordings are not there yet, or '' when none is missing.

    >>> missing_sentence("engine", ["engine_int4_70b"])
    'There is no H200 recording of the 4-bit engine at results/engine_int4_70b.json yet; on a GPU box, run the command below to record it.'
    """
    if not missing:
        return ""
    what = {"kernels": "the int4 GEMV kernels", "engine": "the 4-bit engine"}[kind]
    files = source.listing([f"results/{m}.json" for m in missing])
    them = "them" if len(missing) > 1 else "it"
    s = "s" if len(missing) > 1 else ""
    return (
        f"There is no H200 recording of {what} at {files} yet; on a GPU box, run the "
        f"command{s} below to record {them}."
    )


def kernel_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per shape, group and batch: µs per call of cuBLAS fp16, our int4 GEMV and our int4
    threshold GEMV at each kept fraction, their TB/s against the copy ceiling, and the ratios
    that matter (int4 over cuBLAS; threshold over int4 dense, and its fraction of the ideal).

    >>> kernel_table(load_speed("kernels", live=False)[0]).shape[1] >= 0  # empty without a run
    True
    """
    if not len(frame):
        return pd.DataFrame()
    f = frame.assign(label=frame["provider"] + frame["kept"].map(
        lambda k: "" if k == 1.0 else f" {k:.0%}"))  # fmt: skip
    keys = ["shape", "group", "batch"]
    us = f.pivot_table(index=keys, columns="label", values="us").add_suffix(" (µs)")
    ceil = f.pivot_table(index=keys, columns="label", values="frac_copy").add_suffix(" of ceiling")
    out = us.join(ceil)
    if {"int4 (µs)", "cublas (µs)"} <= set(out.columns):
        out["int4 vs cuBLAS"] = out["cublas (µs)"] / out["int4 (µs)"]
    for k in sorted(set(f.loc[f["provider"] == "int4_thr", "kept"]), reverse=True):
        col = f"int4_thr {k:.0%} (µs)"
        if {"int4 (µs)", col} <= set(out.columns):
            out[f"int4_thr {k:.0%} vs int4 dense"] = out["int4 (µs)"] / out[col]
            out[f"int4_thr {k:.0%} of ideal"] = out["int4 (µs)"] * k / out[col]
    return out


def engine_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model, weights, engine and sparsity: ms per token, bytes per token, TB/s against
    the copy ceiling, and the speedups over fp16 dense and over int4 dense.

    >>> engine_table(load_speed("engine", live=False)[0]).shape[1] >= 0  # empty without a run
    True
    """
    if not len(frame):
        return pd.DataFrame()
    cols = {"ms_per_token": "ms/token", "bytes_per_token": "GB/token", "tbps": "TB/s",
            "of_ceiling": "of ceiling", "vs_fp16_dense": "vs fp16 dense",
            "vs_int4_dense": "vs int4 dense"}  # fmt: skip
    out = frame.set_index(["model", "weights", "engine", "sparsity"])
    out = out[[c for c in cols if c in out]].rename(columns=cols)
    out["GB/token"] = out["GB/token"] / 1e9
    return out


def speed_figure(table: pd.DataFrame, kind: str):
    """Bars of the kernel table (µs per call) or the engine table (ms per token).

    >>> speed_figure(pd.DataFrame(), "engine") is None  # nothing recorded, nothing drawn
    True
    """
    import plotly.express as px

    if not len(table):
        return None
    if kind == "engine":
        t = table.reset_index()
        t["run"] = t["weights"] + "<br>" + t["engine"] + t["sparsity"].map(
            lambda s: f"<br>{s:.0%}" if s else "")  # fmt: skip
        fig = px.bar(t, x="run", y="ms/token", color="weights", facet_col="model",
                     title="ms per decoded token (batch 1, CUDA-graph replay)")  # fmt: skip
        return fig.update_xaxes(tickangle=0, title=None)
    us = table[[c for c in table.columns if c.endswith("(µs)")]].rename_axis(columns="kernel")
    t = us.stack().rename("µs").reset_index()
    t["kernel"] = t["kernel"].str.removesuffix(" (µs)")
    # two-line labels, level: rotated one-line labels ran into the caption under the axis
    t["case"] = (t["shape"].str.replace(" ", "<br>") + "<br>g" + t["group"].astype(str) + ", B"
                 + t["batch"].astype(str))  # fmt: skip
    fig = px.bar(t, x="case", y="µs", color="kernel", barmode="group",
                 title="µs per GEMV call (CUDA-graph replay, cold weights)")  # fmt: skip
    return fig.update_xaxes(tickangle=0, title=None)


def _speed(lo: float, hi: float | None = None) -> str:
    """A speed ratio (or range) as words: "1.20–1.30× faster than", "0.95× the speed of".

    >>> _speed(1.2, 1.3), _speed(0.96), _speed(0.9, 1.1)
    ('1.20–1.30× faster than', '0.96× the speed of', '0.90–1.10× the speed of')
    """
    hi = lo if hi is None else hi
    span = f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"
    return f"{span} faster than" if lo > 1 else f"{span} the speed of"


def speed_sentence(kernels: pd.DataFrame, engine: pd.DataFrame) -> str:
    """What the kernel table (:func:`kernel_table`) and the engine table (:func:`engine_table`)
    drawn show, in a sentence or two; or that neither has been recorded.

    >>> speed_sentence(pd.DataFrame(), pd.DataFrame())
    'Neither the int4 kernels nor the 4-bit engine has been timed on a GPU yet, so the speed half of the claim is untested here.'
    """
    parts = []
    if len(kernels) and "int4 vs cuBLAS" in kernels:
        k = (
            kernels.xs(1, level="batch")
            if 1 in kernels.index.get_level_values("batch")
            else kernels
        )
        r = k["int4 vs cuBLAS"]
        parts.append(f"Batch 1, our int4 GEMV runs {_speed(r.min(), r.max())} cuBLAS fp16 over "
                     "the shapes and groups timed")  # fmt: skip
        if "int4_thr 50% vs int4 dense" in k:
            t = k["int4_thr 50% vs int4 dense"]
            parts[-1] += f", and its threshold GEMV at 50% kept {_speed(t.min(), t.max())} " + (
                "the dense int4 one"
            )
    if len(engine):
        e = engine.reset_index()
        for model, m in e.groupby("model", sort=False):
            four = m[(m["weights"] == "int4") & (m["engine"] == "dense")]
            teal = m[(m["weights"] == "int4") & (m["engine"] == "teal")].sort_values("sparsity")
            if not len(four):
                continue
            text = f"at {model} int4 dense takes {four['ms/token'].iloc[0]:.2f} ms per token"
            if "vs fp16 dense" in m and four["vs fp16 dense"].notna().iloc[0]:
                text += f" ({four['vs fp16 dense'].iloc[0]:.2f}× fp16 dense's speed)"
            if len(teal):
                last = teal.iloc[-1]
                text += (f", int4 + TEAL at {last['sparsity']:.0%} {last['ms/token']:.2f} ms "
                         f"({_speed(last['vs int4 dense'])} int4 dense)")  # fmt: skip
            parts.append(text)
    if not parts:
        return ("Neither the int4 kernels nor the 4-bit engine has been timed on a GPU yet, so "
                "the speed half of the claim is untested here.")  # fmt: skip
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


def recorded_ceiling(provs: dict | None = None, fallback: str = "engine_e2e") -> tuple[float, str]:
    """(copy ceiling in TB/s, the file it comes from): the first of ``provs`` (the speed runs
    drawn) that measured one, else the recorded end-to-end run's (``results/<fallback>.json``).

    >>> tbps, name = recorded_ceiling({})
    >>> name, 3.0 < tbps < 5.0  # the H200's device-to-device copy rate
    ('engine_e2e', True)
    """
    for name, prov in (provs or {}).items():
        if prov.get("copy_tbps"):
            return float(prov["copy_tbps"]), name
    return float(results.load(fallback)[1]["copy_tbps"]), fallback


def recorded_gpu(name: str) -> str:
    """The GPU that recorded ``results/<name>.json``, without the vendor prefix.

    >>> recorded_gpu("engine_e2e")
    'H200'
    """
    try:
        gpu = str(results.load(name)[1].get("gpu") or "GPU")
    except ResultsError:
        gpu = "GPU"
    return gpu.removeprefix("NVIDIA ")


def decode_sentence(name: str = DECODE_FILE) -> str:
    """What the batch-1 sweep of ``results/<name>.json`` shows about decoding codes into half2
    pairs (:mod:`dejavu_lab.kernels.int4.half2`) against fp32 floats (the tile kernel) and the
    peer: the fastest dense config of each kind per shape, on the recording's GPU; or that the
    sweep has not been recorded.

    >>> "half2" in decode_sentence()
    True
    >>> decode_sentence("no_such_recording")
    'The sweep of the two decodings has not been recorded (python kernels/bench_int4.py --group 128 --batch 1).'
    """
    try:
        frame, prov = results.load(name)
    except ResultsError:
        return ("The sweep of the two decodings has not been recorded (python "
                "kernels/bench_int4.py --group 128 --batch 1).")  # fmt: skip
    f = frame[(frame["batch"] == 1) & (frame["kept"] == 1.0)]
    mode = f["config"].map(lambda c: c.get("mode") if isinstance(c, dict) else None)
    parts = []
    for shape, g in f.groupby("shape", sort=False):
        m = mode[g.index]
        half2, tile = g.loc[m == "half2", "us"].min(), g.loc[m == "tile", "us"].min()
        peer = g.loc[g["provider"] == "gemlite", "us"].min()
        text = f"{shape} {half2:.1f} µs against {tile:.1f} µs"
        if pd.notna(peer):
            text += f" (gemlite {peer:.1f} µs)"
        parts.append(text)
    return (f"On the {prov.get('gpu', 'GPU')} (code at {str(prov.get('git_sha', '?'))[:7]}), "
            "one token's dense GEMV with the codes decoded two at a time into half2 pairs (the "
            "default) against one fp32 float each (the tile kernel), the fastest config of "
            "each: " + "; ".join(parts) + ".")  # fmt: skip


def listed_rows_sentence(name: str = DECODE_FILE) -> str:
    """What the batch-1 sweep of ``results/<name>.json`` shows about the threshold GEMV walking a
    list of its kept rows (``compact``) against the masked walk: the fastest config of each
    per shape at each kept fraction, and the list's time against the ideal (the fastest dense
    time times the kept fraction); or '' when the sweep holds no listed-rows config.

    >>> s = listed_rows_sentence()
    >>> s == "" or "kept" in s
    True
    >>> listed_rows_sentence("no_such_recording")
    ''
    """
    try:
        frame, prov = results.load(name)
    except ResultsError:
        return ""
    f = frame[(frame["kind"] == "sweep") & (frame["batch"] == 1)]
    cfg = f["config"].map(lambda c: c if isinstance(c, dict) else {})
    half2 = cfg.map(lambda c: c.get("mode") == "half2")
    listed = cfg.map(lambda c: bool(c.get("compact")) and not c.get("fused"))
    masked = half2 & ~listed & ~cfg.map(lambda c: bool(c.get("fused")))
    if not (listed & (f["kept"] < 1)).any():
        return ""
    parts = []
    for shape, g in f.groupby("shape", sort=False):
        dense = g.loc[half2[g.index] & (g["kept"] == 1.0), "us"].min()
        for kept in sorted(g.loc[g["kept"] < 1, "kept"].unique(), reverse=True):
            at = g["kept"] == kept
            lst = g.loc[at & listed[g.index], "us"].min()
            msk = g.loc[at & masked[g.index], "us"].min()
            parts.append(f"{shape} at {kept:.0%} kept {lst:.1f} µs against {msk:.1f} µs "
                         f"({dense * kept / lst:.2f} of the ideal)")  # fmt: skip
    return (f"On the same {prov.get('gpu', 'GPU')} run, the threshold GEMV that first lists its "
            "kept rows and then walks the list, eight rows' loads in flight at a time, against "
            "the masked walk (every row's loads predicated by the kept mask; recordings before "
            "that walk branched past each dropped row instead), the fastest config of each: "
            + "; ".join(parts) + ".")  # fmt: skip


def kept_rows_sentence(kernels: str = "int4_rows_b1", engine: str = "engine_int4_8b_rows",
                       table: str = "engine_int4_8b") -> str:  # fmt: skip
    """What ``results/<kernels>.json`` (``kernels/bench_int4_rows.py``) and ``results/<engine>
    .json`` show about DejaVu's and CATS's MLP on int4 weights at one token: the half2 kept-row
    kernel against the fp32 tile it replaced and the dense int4 up projection, and the engine's
    int4 DejaVu and CATS steps against int4 dense (naming the commit of ``results/<table>.json``
    when the engine table was recorded at another one); or '' when either recording is missing.

    >>> s = kept_rows_sentence()
    >>> s == "" or "kept" in s
    True
    >>> kept_rows_sentence("no_such_recording")
    ''
    """
    try:
        kf, kprov = results.load(kernels)
        ef, eprov = results.load(engine)
    except ResultsError:
        return ""
    k = kf[kf["kind"] == "time"]
    k = k[k["shape"] == k["shape"].iloc[0]]  # the first shape: Llama-3-8B's, as the engine's
    half = k[(k["kept"] == 0.5) | (k["provider"] == "up_columns")]

    def us(provider, path):
        got = half.loc[(half["provider"] == provider) & (half["path"] == path), "us"]
        return float(got.iloc[0]) if len(got) else math.nan

    e = ef[(ef["kind"] == "e2e") & (ef["weights"] == "int4")]
    ms = {r["engine"]: r["ms_per_token"] for _, r in e.iterrows() if r["sparsity"] in (0.0, 0.5)}
    if not {"dense", "dejavu", "cats"} <= set(ms) or not len(half):
        return ""
    shape = half["shape"].iloc[0]
    try:
        older = results.load(table)[1].get("git_sha")
    except ResultsError:
        older = None
    note = ""
    if older and older != eprov.get("git_sha"):
        note = f" (the engine table above is from commit {older}, before these kernels)"
    return (
        f"On an {kprov.get('gpu', 'GPU')} (results/{kernels}.json, commit "
        f"{kprov.get('git_sha', '?')}), DejaVu's up projection over half of the {shape} MLP's "
        f"neurons in int4 takes {us('up_dejavu', 'half2'):.1f} µs with the half2 kept-row kernel, "
        f"against {us('up_dejavu', 'tile'):.1f} µs for the fp32 tile kernel it replaced and "
        f"{us('up_columns', 'half2'):.1f} µs for the dense int4 up projection over every neuron; "
        f"CATS's gate rows and kept up rows take {us('up_cats', 'half2'):.1f} µs, and the down "
        f"projection over the kept rows {us('down_rows', 'scatter'):.1f} µs (the index walk it "
        f"replaced: {us('down_rows', 'walk'):.1f}). End to end ({eprov.get('gpu', 'GPU')}, "
        f"results/{engine}.json, commit {eprov.get('git_sha', '?')}), int4 DejaVu at 50% runs "
        f"{ms['dejavu']:.2f} ms per token and int4 CATS {ms['cats']:.2f}, against "
        f"{ms['dense']:.2f} for int4 dense{note}: "
        + ("on 4-bit weights the kept-row methods do not yet beat the dense step."
           if min(ms["dejavu"], ms["cats"]) >= ms["dense"] else
           "the kept-row methods beat the dense step on 4-bit weights.")
    )  # fmt: skip


def fused_step_sentence(names=FILES["engine"]) -> str:
    """What the engine recordings' ``plain`` rows (``kernels/bench_engine_int4.py --plain``) show:
    the int4 step whose products leave fp32 sums for the rotation and the residual add + norm
    against the same step finishing each product in its own launch; or '' when none has them.

    >>> s = fused_step_sentence()
    >>> s == "" or "launch" in s
    True
    >>> fused_step_sentence(["no_such_recording"])
    ''
    """
    ratios, files, shas, gpus = [], [], set(), set()
    for name in names:
        try:
            frame, prov = results.load(name)
        except ResultsError:
            continue
        if "kind" not in frame or not (frame["kind"] == "plain").any():
            continue
        r = frame.loc[frame["kind"] == "plain", "fused_over_plain"].dropna()
        if not len(r):
            continue
        ratios += list(r)
        files.append(f"results/{name}.json")
        shas.add(prov.get("git_sha", "?"))
        gpus.add(prov.get("gpu", "GPU"))
    if not ratios:
        return ""
    return (f"Leaving each int4 product's fp32 sums for the next launch to finish — the rotation, "
            f"the residual add and norm, or the down projection's loads — makes the int4 dense "
            f"and TEAL steps {_speed(min(ratios), max(ratios))} the same step with a finishing "
            f"launch after each product ({', '.join(sorted(gpus))}, commit "
            f"{', '.join(sorted(shas))}: {', '.join(files)}).")  # fmt: skip
