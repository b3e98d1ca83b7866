"""The quality frontier: perplexity against sparsity and against bytes per token, per method.

Methods sparsify different matrices (neurons and heads; every linear input; the MLP behind a
dense gate), so a sparsity of 50% buys different savings; this study puts them on one axis,
the decoder-layer weight bytes a decoding step reads (:mod:`dejavu_lab.step_bytes`).
The text follows chapter 40: the corpus's first ``train_tokens`` (8192) tokens are training
text — calibration reads its first ``calibration_tokens``, DejaVu's predictors train on all of
it — and perplexity is measured on the ``eval_windows`` windows right after it.

:func:`frontier` returns one row per (variant, sparsity); :func:`at_bytes` reads each curve at
given byte fractions, the form of our quality targets. From a shell::

    python -m dejavu_lab.sparsify.frontier --json > frontier.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..arch import get_arch
from ..corpus import load_text, token_windows
from ..vocab import METHODS
from .calibration import calibrate, greedy_allocates
from .evaluate import sparse_eval

__all__ = [
    "CALIBRATION_TOKENS",
    "SPARSITIES",
    "TRAIN_TOKENS",
    "VARIANTS",
    "at_bytes",
    "frontier",
    "main",
    "study_windows",
]

SPARSITIES = (0.25, 0.4, 0.5, 0.6, 0.7)  # the gated-MLP chapter's range, 25-70%
TRAIN_TOKENS = 8192  # chapter 40's training text: the corpus's first tokens
# the thresholds calibrate on all of it (the CLI's default too). On the demo model, TEAL
# (greedy) at 50% (0.49 of the bytes) calibrated on the first 2048 tokens gave +36% perplexity
# on the 1024 held-out tokens, on all 8192 +31%, on 24k (beyond the held-out text too) +37%:
# the spread of the thresholds' estimate, not a trend
CALIBRATION_TOKENS = TRAIN_TOKENS

# name -> how to run it: sparse_eval's method plus, for the threshold methods, the
# allocation over a layer's sites (and optionally which sites), and dense layers.
VARIANTS: dict[str, dict] = {
    "oracle": {"method": "oracle"},
    "static": {"method": "static"},
    "dejavu": {"method": "dejavu"},
    "cats": {"method": "cats"},
    "teal (uniform)": {"method": "teal", "allocation": "uniform"},
    "teal (greedy)": {"method": "teal", "allocation": "greedy"},
    "wina (greedy)": {"method": "wina", "allocation": "greedy"},
    # the top-k methods (dejavu_lab.sparsify.topk): "search" runs TEAL's greedy search on the
    # method's own transform, "greedy" takes TEAL's shares; the other keys are plan options
    "larosa (search)": {"method": "larosa", "allocation": "search", "basis": "global"},
    # attention's output rotated per K/V group only (folded into W_V and W_O: free)
    "larosa (o_in, threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "none", "rule": "threshold"
    },
    "larosa (o_in, search)": {"method": "larosa", "allocation": "search", "basis": "none"},
    "larosa (threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "global", "rule": "threshold"
    },
    "larosa (layer basis, threshold, search)": {
        "method": "larosa", "allocation": "search", "basis": "layer", "rule": "threshold"
    },
    "topk (search)": {  # LaRoSA without its rotation: what the rotation adds
        "method": "larosa", "allocation": "search", "basis": "none", "rotate_o": False
    },
    "rsparse (search)": {
        "method": "rsparse", "allocation": "search", "lowrank": 0.1, "scaling": "plain"
    },
    "rsparse (threshold, search)": {
        "method": "rsparse", "allocation": "search", "lowrank": 0.1, "scaling": "plain",
        "rule": "threshold",
    },
}  # fmt: skip
_RUN_KEYS = ("method", "allocation", "sites", "dense_layers", "mlp_sparsity", "head_sparsity")
# methods that need no trained predictor (but static sets or a calibration)
TRAINING_FREE = tuple(m.name for m in METHODS.values() if m.needs in ("static sets", "calibration"))


def study_windows(
    tokenizer,
    corpus: str = "demo",
    window: int = 512,
    eval_windows: int = 2,
    train_tokens: int = TRAIN_TOKENS,
    calibration_tokens: int = CALIBRATION_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration windows, held-out windows) of the study, as chapter 40 cuts the corpus.

    >>> from dejavu_lab.models import load_model
    >>> calib, held_out = study_windows(load_model("demo").tokenizer)
    >>> tuple(calib.shape), tuple(held_out.shape)  # windows 0-15 and 16-17 of 512 tokens
    ((16, 512), (2, 512))
    """
    skip = math.ceil(train_tokens / window)
    n_calib = max(1, math.ceil(calibration_tokens / window))
    if n_calib > skip:
        raise ValueError("calibration_tokens must not exceed train_tokens.")
    w = token_windows(tokenizer, load_text(corpus), window, skip + eval_windows)
    if w.shape[0] <= skip:
        raise ValueError(f"{corpus} has no {window}-token window after {train_tokens} tokens.")
    return w[:n_calib], w[skip:]


def frontier(
    model,
    tokenizer,
    variants: dict[str, dict] | Sequence[str] | None = None,
    sparsities: Sequence[float] = SPARSITIES,
    *,
    corpus: str = "demo",
    window: int = 512,
    eval_windows: int = 2,
    train_tokens: int = TRAIN_TOKENS,
    calibration_tokens: int = CALIBRATION_TOKENS,
    predictors=None,
    progress: bool = False,
) -> pd.DataFrame:
    """Perplexity and bytes per token for each variant at each sparsity, plus the dense row.

    ``variants``: names of :data:`VARIANTS` or a dict name -> spec (``method``, and optionally
    ``allocation``, ``sites``, ``dense_layers``, ``head_sparsity``). ``predictors``: DejaVu
    predictors for ``"dejavu"`` (default: :func:`dejavu_lab.predictors.get_or_train` on the
    training text, cached). Calibrations are cached (:func:`calibrate`).

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> df = frontier(model, tok, ["oracle", "cats"], [0.5], window=32, eval_windows=1,
    ...               train_tokens=64, calibration_tokens=64)
    >>> df[["variant", "sparsity", "bytes_per_token_fraction"]].round(2)
      variant  sparsity  bytes_per_token_fraction
    0   dense       0.0                      1.00
    1  oracle       0.5                      0.53
    2    cats       0.5                      0.75
    """
    specs = _specs(variants)
    arch = get_arch(model)
    calib, held_out = study_windows(
        tokenizer, corpus, window, eval_windows, train_tokens, calibration_tokens
    )
    needs = {METHODS[m].needs for m in (s["method"] for s in specs.values()) if m in METHODS}
    greedy = sorted(
        {
            s["method"]
            for s in specs.values()
            if s.get("allocation") == "greedy" and greedy_allocates(s["method"])
        }
    )
    topk = [
        s
        for s in specs.values()
        if s["method"] in METHODS and METHODS[s["method"]].family == "topk"
    ]
    if any(s.get("allocation") == "greedy" for s in topk) and "teal" not in greedy:
        greedy.append("teal")  # the top-k methods spread a budget as TEAL's greedy search does
    cal = moments = None
    if "calibration" in needs:
        cal = calibrate(model, calib, greedy=greedy, arch=arch, progress=progress)
    if topk:
        from .moments import calibrate_moments

        moments = calibrate_moments(model, calib, arch=arch, progress=progress)
    static = None
    if "static sets" in needs:
        from .static import static_sets

        static = static_sets(model, calib, arch=arch, progress=progress)
    if "predictors" in needs and predictors is None:
        predictors = _predictors(model, tokenizer, corpus, window, train_tokens, progress)
    rows = []
    t0 = time.perf_counter()
    r = sparse_eval(model, held_out, method="dense", progress=progress)
    rows.append(_row("dense", {"method": "dense"}, 0.0, r, time.perf_counter() - t0))
    for name, spec in specs.items():
        for s in sparsities:
            t0 = time.perf_counter()
            kw = _kwargs(spec, s, cal, static, predictors, model=model, moments=moments)
            r = sparse_eval(model, held_out, progress=progress, **kw)
            rows.append(_row(name, spec, s, r, time.perf_counter() - t0))
    df = pd.DataFrame(rows)
    df["ppl_ratio"] = df["perplexity"] / df["perplexity"].iloc[0]
    df.attrs.update(tokens=int(held_out.numel()), calibration_tokens=int(calib.numel()))
    return df


def _specs(variants) -> dict[str, dict]:
    if variants is None:
        return dict(VARIANTS)
    if isinstance(variants, dict):
        return dict(variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}.")
    return {v: VARIANTS[v] for v in variants}


def _kwargs(spec: dict, s: float, cal, static, predictors, *, model=None, moments=None) -> dict:
    m = METHODS.get(spec["method"])  # None for a name outside the table: refused below
    kw = {"method": spec["method"], "dense_layers": tuple(spec.get("dense_layers", ()))}
    if m is not None and m.family == "topk":  # a plan of fixed counts (dejavu_lab.sparsify.topk)
        from . import larosa, rsparse

        build = {"larosa": larosa.plan, "rsparse": rsparse.plan}[m.name]
        opts = {k: v for k, v in spec.items() if k not in _RUN_KEYS}
        alloc = spec.get("allocation", "uniform")
        kw["thresholds"] = build(
            model, moments, s, allocation=alloc, teal=cal, dense_layers=kw["dense_layers"], **opts
        )
    elif m is not None and m.family == "unit":
        kw["sparsity"] = s
        for k in ("mlp_sparsity", "head_sparsity"):
            if k in spec:
                kw[k] = spec[k]
        if m.needs == "static sets":
            kw["static"] = static
        if m.needs == "predictors":
            kw["predictors"] = predictors
    else:
        kw["thresholds"] = cal.thresholds(
            spec["method"],
            s,
            allocation=spec.get("allocation", "uniform"),
            dense_layers=kw["dense_layers"],
            sites=spec.get("sites"),
        )
    return kw


def _row(name: str, spec: dict, s: float, r, seconds: float) -> dict:
    return {
        "variant": name,
        "method": spec["method"],
        "allocation": spec.get("allocation", ""),
        "sparsity": s,
        "perplexity": r.perplexity,
        "bytes_per_token_fraction": r.bytes_per_token_fraction,
        "kept": json.dumps(r.kept),
        "seconds": round(seconds, 1),
    }


def _predictors(model, tokenizer, corpus, window, train_tokens, progress):
    from ..collect import CollectConfig
    from ..predictors import PredictorConfig, get_or_train

    cfg = CollectConfig(corpus=corpus, window=window, max_tokens=train_tokens)
    return get_or_train(model, tokenizer, PredictorConfig(), cfg, progress=progress)


def at_bytes(
    df: pd.DataFrame, fractions: Sequence[float] = (0.75, 0.6, 0.5), window: float = 0.0
) -> pd.DataFrame:
    """Each variant's perplexity ratio to dense where its curve crosses these byte fractions.

    ``window = 0``: linear interpolation of log-perplexity between the two measured points
    around a fraction. ``window > 0``: a least-squares line of log-perplexity against bytes
    through every point within ``window`` of the fraction, when at least three lie there on
    both sides of it (else the interpolation). Near 50% of the bytes a 135M model's perplexity
    moves by a few percent between budgets 0.005 apart (a few tokens flip), so one point is a
    noisy reading of the curve; the fit averages over the points measured near it. NaN where
    the curve does not reach the fraction.

    >>> df = pd.DataFrame({"variant": ["dense"] + ["a"] * 4, "method": ["dense"] + ["teal"] * 4,
    ...                    "bytes_per_token_fraction": [1.0, 0.8, 0.62, 0.58, 0.4],
    ...                    "perplexity": [10.0, 11.0, 15.0, 14.0, 20.0]})
    >>> at_bytes(df, [0.6]).round(3)  # between the two nearest points
              0.6
    variant
    a        1.449
    >>> round(float(at_bytes(df, [0.6], window=0.25).loc["a", 0.6]), 3)  # a line through all 4
    1.466
    """
    if not 0 <= window < 1:
        raise ValueError(f"window must be in [0, 1) (a share of the dense bytes), got {window!r}.")
    dense = float(df.loc[df.variant == "dense", "perplexity"].iloc[0])
    out = {}
    for name, g in df[df.variant != "dense"].groupby("variant", sort=False):
        g = g.sort_values("bytes_per_token_fraction")
        x = g["bytes_per_token_fraction"].to_numpy(dtype=float)
        y = np.log(g["perplexity"].to_numpy(dtype=float) / dense)
        out[name] = {f: _read(x, y, f, window) for f in fractions}
    res = pd.DataFrame(out).T
    res.index.name = "variant"
    return res


def _read(x: np.ndarray, y: np.ndarray, f: float, window: float) -> float:
    """exp of the log ratio at bytes ``f``: a local line fit or the interpolation (see at_bytes)."""
    if not x[0] <= f <= x[-1]:
        return float("nan")
    near = np.abs(x - f) <= window
    if window > 0 and near.sum() >= 3 and (x[near] < f).any() and (x[near] > f).any():
        slope, icept = np.polyfit(x[near], y[near], 1)
        return float(np.exp(slope * f + icept))
    return float(np.exp(np.interp(f, x, y)))


def main(argv: list[str] | None = None) -> int:
    """``python -m dejavu_lab.sparsify.frontier``: run the study, print a table or JSON.

    >>> import contextlib, io, json
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     rc = main(["--variants", "oracle", "--sparsities", "0.5", "--window", "32",
    ...                "--eval-windows", "1", "--train-tokens", "64", "--json"])
    >>> rc, [r["variant"] for r in json.loads(out.getvalue())["rows"]]
    (0, ['dense', 'oracle'])
    """
    ap = argparse.ArgumentParser(prog="python -m dejavu_lab.sparsify.frontier")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--corpus", default="demo")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    ap.add_argument("--sparsities", nargs="+", type=float, default=list(SPARSITIES))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--calibration-tokens", type=int, default=None)
    ap.add_argument(
        "--fit-window",
        type=float,
        default=0.0,
        help="also read the curves at the targets by a local line fit (see at_bytes)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not 0 <= args.fit_window < 1:
        ap.error(f"--fit-window must be in [0, 1), got {args.fit_window}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from ..models import load_model

    model, tok, _ = load_model(args.model)
    calib_tokens = args.calibration_tokens or min(CALIBRATION_TOKENS, args.train_tokens)
    df = frontier(
        model,
        tok,
        args.variants,
        args.sparsities,
        corpus=args.corpus,
        window=args.window,
        eval_windows=args.eval_windows,
        train_tokens=args.train_tokens,
        calibration_tokens=calib_tokens,
    )
    if args.json:
        out = {**df.attrs, "rows": df.to_dict("records"), "at_bytes": _records(at_bytes(df))}
        if args.fit_window > 0:
            out["at_bytes_fit"] = _records(at_bytes(df, window=args.fit_window))
            out["fit_window"] = args.fit_window
        print(json.dumps(out))
    else:
        cols = ["variant", "sparsity", "perplexity", "ppl_ratio", "bytes_per_token_fraction"]
        print(df[cols].to_string(index=False, float_format="%.3f"))
    return 0


def _records(crossing: pd.DataFrame) -> list[dict]:
    crossing = crossing.reset_index()
    return crossing.astype(object).where(crossing.notna(), None).to_dict("records")


if __name__ == "__main__":
    sys.exit(main())
