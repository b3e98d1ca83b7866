"""The quality frontier: perplexity against sparsity and against bytes per token, per method.

Methods sparsify different matrices (neurons and heads; every linear input; the MLP behind a
dense gate), so a sparsity of 50% buys different savings; this study puts them on one axis,
the decoder-layer weight bytes a decoding step reads (:mod:`dejavu_lab.step_bytes`).
The text follows chapter 40 (:mod:`~dejavu_lab.sparsify.windows`): calibration on the corpus's
first tokens, perplexity on the windows right after them.

:func:`frontier` returns one row per (variant, sparsity); it is :func:`prepare` once per
variant (a calibration, static sets or predictors, each cached) and :func:`evaluate_point` per
sparsity, the steps ``dejavu-lab frontier`` runs one at a time so that a killed run resumes
(:mod:`dejavu_lab.sparsify.frontier_state`). :func:`at_bytes` reads each curve at given byte
fractions, the form of our quality targets. The variants are every non-dense row of
:data:`dejavu_lab.vocab.METHODS`, with both allocations for the methods that have TEAL's
greedy one, and TEAL, WINA and LaRoSA with their budgets spread over the layers by each
layer's measured sensitivity (``"… layers)"``, :mod:`~dejavu_lab.sparsify.layers`)
(:data:`VARIANTS`), named on the command line as :func:`parse_variant` reads them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..arch import get_arch
from ..vocab import CORPORA, METHODS, SITES, method
from .calibration import calibrate, greedy_allocates, text_hash
from .evaluate import sparse_eval
from .layers import allocate, cached_sensitivity
from .topk import DEFAULT_DESIGN, DESIGNS
from .windows import CALIBRATION_TOKENS, TRAIN_TOKENS, overlapping, study_windows

__all__ = [
    "CALIBRATION_TOKENS",
    "SPARSITIES",
    "TRAIN_TOKENS",
    "METHOD_VARIANTS",
    "TRAINING_FREE",
    "VARIANTS",
    "allocations",
    "at_bytes",
    "crossing_records",
    "evaluate_point",
    "frontier",
    "overlapping",
    "parse_variant",
    "prepare",
    "study_windows",
]

SPARSITIES = (0.25, 0.4, 0.5, 0.6, 0.7)  # the gated-MLP chapter's range, 25-70%


def allocations(name: str) -> tuple[str, ...]:
    """The ways a method's budget can be spread over a layer's sites: ``uniform`` or TEAL's
    ``greedy`` search for the methods sparsifying every linear input of a layer (those without
    their own search borrow TEAL's); none for the others (one site, or neurons and heads).

    >>> allocations("teal"), allocations("cats"), allocations("oracle")
    (('uniform', 'greedy'), (), ())
    """
    m = method(name)
    if m.family in ("unit", "topk"):  # neurons and heads; the top-k methods' own designs
        return ()
    return ("uniform", "greedy") if set(m.sites) == set(SITES) else ()


def _variants() -> dict[str, dict]:
    """name -> how to run it, for every non-dense method of the table: sparse_eval's method
    and, for the methods with a choice of allocation, one variant per allocation."""
    out: dict[str, dict] = {}
    for m in METHODS.values():
        if m.family == "dense":
            continue
        if m.family == "topk":  # named designs (topk.DESIGNS); its own name: the best
            out[m.name] = dict(DESIGNS[DEFAULT_DESIGN[m.name]])
            continue
        if allocations(m.name):
            for a in ("uniform", "greedy"):
                out[f"{m.name} ({a})"] = {"method": m.name, "allocation": a}
        else:
            out[m.name] = {"method": m.name}
    return out


_RUN_KEYS = ("method", "allocation", "sites", "dense_layers", "mlp_sparsity", "head_sparsity",
             "layers", "refit", "tilt")  # fmt: skip


def _layered(name: str, spec: dict) -> tuple[str, dict]:
    """The variant with its budget spread over the layers by their measured sensitivity."""
    return (f"{name[:-1]}, layers)" if name.endswith(")") else f"{name} (layers)",
            {**spec, "layers": "sensitivity"})  # fmt: skip


def _refitted(name: str, spec: dict) -> tuple[str, dict]:
    """The variant read through least-squares weights (:mod:`~dejavu_lab.sparsify.refit`)."""
    if not method(spec["method"]).input_sparse:
        raise ValueError(f"refit applies to teal and wina, not {spec['method']}.")
    return (f"{name[:-1]}, refit)" if name.endswith(")") else f"{name} (refit)",
            {**spec, "refit": True})  # fmt: skip


def _tilted(name: str, spec: dict) -> tuple[str, dict]:
    """The refit variant with its site shares tilted toward ``down_in`` by a tilt chosen on the
    calibration text (:mod:`~dejavu_lab.sparsify.refit_shares`)."""
    if not spec.get("refit"):
        raise ValueError(f"the tilt moves sparsity for a refit; write {spec['method']}+refit+tilt.")
    return f"{name[:-1]}, tilted)", {**spec, "tilt": True}


# name -> spec: sparse_eval's method plus, for the threshold methods, the allocation over a
# layer's sites (and optionally which sites, and dense layers). A spec may also carry
# ``sites``, ``dense_layers``, ``mlp_sparsity`` or ``head_sparsity``.
# one or two variants per method (its allocations), what 'all' and 'training-free' run
METHOD_VARIANTS: dict[str, dict] = _variants()
VARIANTS: dict[str, dict] = {**METHOD_VARIANTS, **DESIGNS}  # and the top-k methods' designs
# per-layer budgets from each layer's sensitivity (:mod:`~dejavu_lab.sparsify.layers`)
VARIANTS.update(_layered(n, VARIANTS[n]) for n in ("teal (greedy)", "wina (greedy)", "larosa"))
VARIANTS.update(
    _refitted(n, VARIANTS[n]) for n in ("teal (greedy, layers)", "wina (greedy, layers)")
)
VARIANTS.update(
    _tilted(n, VARIANTS[n])
    for n in ("teal (greedy, layers, refit)", "wina (greedy, layers, refit)")
)
# methods that need no trained predictor (but static sets or a calibration)
TRAINING_FREE = tuple(m.name for m in METHODS.values() if m.needs in ("static sets", "calibration"))


def parse_variant(text: str) -> tuple[str, dict]:
    """``(variant name, spec)`` of a method as users write it: ``teal`` (its default
    allocation), ``teal:uniform``, ``wina:greedy``, ``cats``, ``oracle``, or a name of
    :data:`VARIANTS` such as ``"teal (greedy)"``. ``KeyError``/``ValueError``: one sentence.

    >>> parse_variant("teal"), parse_variant("cats")
    (('teal (greedy)', {'method': 'teal', 'allocation': 'greedy'}), ('cats', {'method': 'cats'}))
    >>> parse_variant("wina:uniform")[0], parse_variant("predicted")[0]  # an older name
    ('wina (uniform)', 'dejavu')
    >>> parse_variant("cats:greedy")
    Traceback (most recent call last):
    ...
    ValueError: cats has no greedy allocation (only teal and wina have); write cats.
    """
    text = text.strip()
    if text in VARIANTS:
        return text, dict(VARIANTS[text])
    if text.endswith("+tilt"):  # e.g. wina+layers+refit+tilt: shares tilted for the refit
        return _tilted(*parse_variant(text[: -len("+tilt")]))
    if text.endswith("+refit"):  # e.g. wina+layers+refit: least-squares weights
        return _refitted(*parse_variant(text[: -len("+refit")]))
    if text.endswith("+layers"):  # e.g. teal+layers: per-layer budgets by sensitivity
        return _layered(*parse_variant(text[: -len("+layers")]))
    name, _, allocation = text.partition(":")
    m = method(name)  # KeyError naming the methods
    if m.family == "dense":
        raise ValueError("dense is always measured (the reference row); leave it out.")
    if not allocations(m.name):
        if allocation not in ("", "uniform"):
            some = " and ".join(n for n in METHODS if n != "dense" and allocations(n))
            raise ValueError(
                f"{m.name} has no {allocation} allocation (only {some} have); write {m.name}."
            )
        return m.name, dict(VARIANTS[m.name])
    allocation = allocation or m.allocation
    if allocation not in ("uniform", "greedy"):
        raise ValueError(
            f"unknown allocation {allocation!r} in {text!r}; write {m.name}:uniform or "
            f"{m.name}:greedy."
        )
    variant = f"{m.name} ({allocation})"
    return variant, dict(VARIANTS[variant])


def prepare(model, tokenizer, spec: dict, calib: torch.Tensor, *, arch=None, progress=False,
            **kw) -> dict:  # fmt: skip
    """What the variant ``spec`` needs before it runs, built from the calibration windows
    ``calib`` [n, window] as its row of :data:`~dejavu_lab.vocab.METHODS` says: ``{"cal": ...}``
    (a :class:`~dejavu_lab.sparsify.calibration.Calibration`, cached, with TEAL's greedy path
    for a greedy variant), ``{"static": ...}``, ``{"predictors": ...}`` (``predictors``, or
    trained once on the corpus's training text, cached), ``{"moments": ...}`` for LaRoSA and
    R-Sparse, or ``{}``; for a variant with ``"layers"`` also its layers' sensitivity
    (``ready["layers"]``, :func:`~dejavu_lab.sparsify.layers.cached_sensitivity` on the first
    calibration window), from which :func:`evaluate_point` spreads each budget over the layers.
    Keywords: ``corpus``, ``window``, ``train_tokens``, ``predictors`` (for DejaVu).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> calib = torch.randint(0, 128, (1, 16))
    >>> sorted(prepare(m.model, None, {"method": "cats"}, calib)), prepare(m.model, None,
    ...     {"method": "oracle"}, calib)
    (['cal'], {})
    """
    arch = arch or get_arch(model)
    ready = _prepare_method(model, tokenizer, spec, calib, arch=arch, progress=progress, **kw)
    if spec.get("refit"):
        ready["calib"] = calib  # each budget's refit is fitted under its own thresholds
    if spec.get("layers"):
        base = {k: v for k, v in spec.items() if k not in ("layers", "refit", "tilt")}
        ready["layers"] = cached_sensitivity(
            model, calib[:1], lambda b: _kwargs(base, b, ready, model),
            {"spec": base, "calibration": text_hash(calib)}, arch=arch, progress=progress,
        )  # fmt: skip
    return ready


def _prepare_method(
    model,
    tokenizer,
    spec: dict,
    calib: torch.Tensor,
    *,
    corpus: str = "demo",
    window: int = 512,
    train_tokens: int = TRAIN_TOKENS,
    predictors=None,
    arch=None,
    progress: bool = False,
) -> dict:
    """What the variant ``spec`` needs (:func:`prepare`) but the layers' sensitivity."""
    arch = arch or get_arch(model)
    m = method(spec["method"])
    if m.needs == "nothing":
        return {}
    if m.family == "topk":  # second moments for its bases; TEAL's greedy path for its shares
        from .moments import calibrate_moments

        ready = {"moments": calibrate_moments(model, calib, arch=arch, progress=progress)}
        if spec.get("allocation") == "greedy":
            ready["cal"] = calibrate(model, calib, greedy=["teal"], arch=arch, progress=progress)
        return ready
    if m.needs == "calibration":
        greedy = []
        if spec.get("allocation") == "greedy":  # its own greedy search, or TEAL's shares
            greedy = [m.name if greedy_allocates(m.name) else "teal"]
        return {"cal": calibrate(model, calib, greedy=greedy, arch=arch, progress=progress)}
    if m.needs == "static sets":
        from .static import static_sets

        return {"static": static_sets(model, calib, arch=arch, progress=progress)}
    if m.needs == "predictors":
        if predictors is None:
            predictors = _predictors(model, tokenizer, corpus, window, train_tokens, progress)
        return {"predictors": predictors}
    raise ValueError(
        f"the frontier does not know how to prepare what {m.name} needs ({m.needs!r}); "
        "run it through dejavu_lab.sparsify.sparsified with what it needs."
    )


def evaluate_point(
    model, held_out: torch.Tensor, name: str, spec: dict, sparsity: float, ready: dict,
    *, progress: bool = False,
) -> dict:  # fmt: skip
    """One row of the frontier: the variant ``name`` (``spec``) at ``sparsity`` on the held-out
    windows [n, window], with what :func:`prepare` built (``ready``; ``{}`` for dense).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> row = evaluate_point(m.model, torch.randint(0, 128, (1, 16)), "oracle",
    ...                      {"method": "oracle"}, 0.5, {})
    >>> row["variant"], row["sparsity"], round(row["bytes_per_token_fraction"], 2)
    ('oracle', 0.5, 0.51)
    """
    t0 = time.perf_counter()
    if spec["method"] == "dense":
        r = sparse_eval(model, held_out, method="dense", progress=progress)
    else:
        kw = _kwargs(spec, sparsity, ready, model)
        r = sparse_eval(model, held_out, progress=progress, **kw)
    row = _row(name, spec, sparsity, r, time.perf_counter() - t0)
    if spec.get("tilt"):  # the one chosen for this budget
        row["tilt"] = kw["thresholds"].info["tilt"]
    return row


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
    calibration: str | None = None,
    predictors=None,
    progress: bool = False,
) -> pd.DataFrame:
    """Perplexity and bytes per token for each variant at each sparsity, plus the dense row.

    ``variants``: names of :data:`VARIANTS` (or as :func:`parse_variant` reads them) or a dict
    name -> spec (``method``, and optionally ``allocation``, ``sites``, ``dense_layers``,
    ``head_sparsity``). ``predictors``: DejaVu predictors for ``"dejavu"`` (default:
    :func:`dejavu_lab.predictors.get_or_train <dejavu_lab.predictors.cache.get_or_train>` on
    the training text, cached). Calibrations are cached (:func:`calibrate`).

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
        tokenizer, corpus, window, eval_windows, train_tokens, calibration_tokens, calibration
    )
    rows = [
        evaluate_point(model, held_out, "dense", {"method": "dense"}, 0.0, {}, progress=progress)
    ]
    for name, spec in specs.items():
        ready = prepare(model, tokenizer, spec, calib, corpus=corpus, window=window,
                        train_tokens=train_tokens, predictors=predictors, arch=arch,
                        progress=progress)  # fmt: skip
        for s in sparsities:
            rows.append(evaluate_point(model, held_out, name, spec, s, ready, progress=progress))
    df = pd.DataFrame(rows)
    df["ppl_ratio"] = df["perplexity"] / df["perplexity"].iloc[0]
    df.attrs.update(tokens=int(held_out.numel()), calibration_tokens=int(calib.numel()))
    return df


def _specs(variants) -> dict[str, dict]:
    if variants is None:
        return dict(VARIANTS)
    if isinstance(variants, dict):
        return dict(variants)
    return dict(parse_variant(v) for v in variants)


def _kwargs(spec: dict, s: float, ready: dict, model) -> dict:
    """sparse_eval's keywords for ``spec`` at ``s``, from what :func:`prepare` built."""
    m = METHODS.get(spec["method"])  # None for a name outside the table: refused below
    kw = {"method": spec["method"], "dense_layers": tuple(spec.get("dense_layers", ()))}
    if spec.get("layers") and not isinstance(s, (list, tuple)):
        s = allocate(ready["layers"], s)  # one budget per layer, by sensitivity
    if m is not None and m.family == "topk":  # a plan of fixed counts (dejavu_lab.sparsify.topk)
        from . import larosa, rsparse

        build = {"larosa": larosa.plan, "rsparse": rsparse.plan}[m.name]
        opts = {k: v for k, v in spec.items() if k not in _RUN_KEYS}
        alloc = spec.get("allocation", "uniform")
        kw["thresholds"] = build(
            model, ready["moments"], s, allocation=alloc, teal=ready.get("cal"),
            dense_layers=kw["dense_layers"], **opts,
        )  # fmt: skip
    elif m is not None and m.family == "unit":
        kw["sparsity"] = s
        for k in ("mlp_sparsity", "head_sparsity"):
            if k in spec:
                kw[k] = spec[k]
        if m.needs == "static sets":
            kw["static"] = ready["static"]
        if m.needs == "predictors":
            kw["predictors"] = ready["predictors"]
    else:
        if "cal" not in ready:
            raise ValueError(f"{spec['method']} needs a calibration to read thresholds from.")
        kw["thresholds"] = ready["cal"].thresholds(
            spec["method"],
            s,
            allocation=spec.get("allocation", "uniform"),
            dense_layers=kw["dense_layers"],
            sites=spec.get("sites"),
        )
        if spec.get("tilt"):  # its shares tilted by a tilt chosen on the calibration text
            from .refit_shares import choose_tilt, tilt

            t, _ = choose_tilt(model, ready["calib"], kw["thresholds"], ready["cal"],
                               dense_layers=kw["dense_layers"])  # fmt: skip
            kw["thresholds"] = tilt(kw["thresholds"], ready["cal"], get_arch(model), t)
        if spec.get("refit"):
            from .refit import fit_refit

            thr = kw["thresholds"].site_thresholds(model)
            kw["refit"] = fit_refit(model, ready["calib"], thr, progress=False)
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

    if corpus not in CORPORA:
        raise ValueError(
            "dejavu trains its predictors on a named corpus's training text; with a text file "
            "pass trained predictors (see `dejavu-lab train-predictors`) or leave dejavu out."
        )
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


def crossing_records(crossing: pd.DataFrame) -> list[dict]:
    """:func:`at_bytes`'s table as JSON-ready records (NaN -> None), one per variant.

    >>> df = pd.DataFrame({0.5: [1.2, float("nan")]}, index=pd.Index(["a", "b"], name="variant"))
    >>> crossing_records(df)
    [{'variant': 'a', 0.5: 1.2}, {'variant': 'b', 0.5: None}]
    """
    crossing = crossing.reset_index()
    return crossing.astype(object).where(crossing.notna(), None).to_dict("records")
