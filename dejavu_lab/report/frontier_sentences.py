"""The sentences chapter 42 builds from the frontier recordings (:mod:`.frontiers`): which
variant is best at each byte budget on how many models (:func:`decision`), DejaVu's oracle sets
beside the best pick (:func:`oracle_sentence`), and what a refit changes
(:func:`refit_sentence`, :mod:`dejavu_lab.sparsify.refit`) and its tilted shares
(:func:`tilt_sentence`, :mod:`dejavu_lab.sparsify.refit_shares`), and how far the same points
move when evaluated again with one setting changed (:func:`rerun_sentence`): the size of a gap
the recordings resolve.
"""

from __future__ import annotations

import math

import pandas as pd

from .frontiers import title
from .source import listing

__all__ = [
    "CLOSE",
    "decision",
    "oracle_sentence",
    "refit_sentence",
    "rerun_sentence",
    "tilt_sentence",
]

CLOSE = 0.01  # a runner-up this close (in perplexity ratio) is called out: the pick is a toss-up


def _pct(r: float) -> str:
    return f"{r - 1:+.1%}"


def oracle_sentence(cross: pd.DataFrame, best: pd.DataFrame, names=title) -> str:
    """Where :func:`crossing_table` has the oracle (DejaVu's ideal neuron and head sets): its
    rise at each byte fraction per model beside the best deployable variant's (:func:`best_at`);
    '' when no model has both.

    >>> cross = pd.DataFrame({"model": "a", "variant": ["oracle", "x"], "fraction": 0.5,
    ...                       "ratio": [1.4, 1.25]})
    >>> from dejavu_lab.report.frontiers import best_at
    >>> oracle_sentence(cross, best_at(cross), names=str)
    "DejaVu's oracle sets, chosen from the true activations, against the best threshold or rotation variant at equal bytes: on a +40.0% against +25.0% at 50% of the bytes."
    """
    parts = []
    for model, g in (
        cross[cross.variant == "oracle"].dropna(subset=["ratio"]).groupby("model", sort=False)
    ):
        b = best[(best.model == model) & best.variant.notna()].set_index("fraction").ratio
        at = [f"{_pct(r)} against {_pct(b[f])} at {f:.0%} of the bytes"
              for f, r in zip(g.fraction, g.ratio, strict=True) if f in b.index]  # fmt: skip
        if at:
            parts.append(f"on {names(model)} " + ", ".join(at))
    if not parts:
        return ""
    return ("DejaVu's oracle sets, chosen from the true activations, against the best threshold "
            "or rotation variant at equal bytes: " + "; ".join(parts) + ".")  # fmt: skip


def refit_sentence(cross: pd.DataFrame, names=title) -> str:
    """Each refit variant of :func:`~dejavu_lab.report.frontiers.crossing_table` beside the
    variant it refits (the same name without "refit"), per model, at the byte fractions both
    reach; '' when none has both.

    >>> cross = pd.DataFrame({"model": "a", "variant": ["w (layers)", "w (layers, refit)"] * 2,
    ...                       "fraction": [0.6, 0.6, 0.5, 0.5], "ratio": [1.1, 1.05, 1.3, 1.2]})
    >>> refit_sentence(cross, names=str)
    'Read through the refit weights, the perplexity rise at equal bytes goes: on a, w (layers) from +10.0% / +30.0% to +5.0% / +20.0% at 60% / 50% of the bytes.'
    """
    base = lambda v: v.replace(", refit)", ")").replace(" (refit)", "")  # noqa: E731
    said = _beside(cross, base, names)
    return (
        f"Read through the refit weights, the perplexity rise at equal bytes goes: {said}."
        if said
        else ""
    )


def tilt_sentence(cross: pd.DataFrame, names=title) -> str:
    """Each tilted refit variant (:mod:`~dejavu_lab.sparsify.refit_shares`) beside the same
    refit with the greedy shares as they are, as :func:`refit_sentence`; '' when none.

    >>> cross = pd.DataFrame({"model": "a", "variant": ["w (refit)", "w (refit, tilted)"],
    ...                       "fraction": 0.5, "ratio": [1.2, 1.15]})
    >>> tilt_sentence(cross, names=str)
    "With the shares tilted toward the MLP's inner input, the rise goes: on a, w (refit) from +20.0% to +15.0% at 50% of the bytes."
    """
    said = _beside(cross, lambda v: v.replace(", tilted)", ")"), names)
    return (
        f"With the shares tilted toward the MLP's inner input, the rise goes: {said}."
        if said
        else ""
    )


def _beside(cross: pd.DataFrame, base_of, names) -> str:
    """'on model, base from ... to ... at ... of the bytes; ...' for every variant whose
    ``base_of(variant)`` is another variant of the table, at the fractions both reach."""
    ratio = cross.dropna(subset=["ratio"]).set_index(["model", "variant", "fraction"]).ratio
    pairs: dict = {}  # (model, base variant) -> [(fraction, base ratio, variant's ratio)]
    for (model, variant, f), r in ratio.items():
        base = base_of(variant)
        if base != variant and (model, base, f) in ratio.index:
            pairs.setdefault((model, base), []).append((f, ratio[(model, base, f)], r))
    by_model: dict = {}
    for (model, base), at in pairs.items():
        at = sorted(at, reverse=True)
        before, after = (" / ".join(_pct(a[k]) for a in at) for k in (1, 2))
        where = " / ".join(f"{a[0]:.0%}" for a in at)
        by_model.setdefault(model, []).append(
            f"{base} from {before} to {after} at {where} of the bytes"
        )
    return "; ".join(f"on {names(m)}, " + ", ".join(t) for m, t in by_model.items())


def decision(best: pd.DataFrame, names=title) -> list[str]:
    """One sentence per byte fraction of :func:`best_at`: which variant is best on how many of
    the models (with each model's rise over dense), where they disagree, and on which models
    the best variant meets the target. ``names``: model -> its name in the sentence.

    >>> best = pd.DataFrame({"fraction": 0.6, "model": ["a", "b"], "variant": ["x", "y"],
    ...                      "ratio": [1.04, 1.2], "runner_up": ["y", "x"],
    ...                      "runner_up_ratio": [1.05, 1.3], "target": 1.05,
    ...                      "meets": [True, False]})
    >>> print(decision(best, names=str)[0])  # doctest: +NORMALIZE_WHITESPACE
    At 60% of the weight bytes the models disagree: x is best on a (+4.0%, y +5.0%); y on b
    (+20.0%, x +30.0%). The target (at most +5%) is met on a only.
    >>> agree = best.assign(variant="x", runner_up="y", runner_up_ratio=[1.045, 1.3])
    >>> print(decision(agree, names=str)[0])  # doctest: +NORMALIZE_WHITESPACE
    At 60% of the weight bytes x is best on all 2 models: a (+4.0%, y +4.5%) and b (+20.0%, y
    +30.0%); the runner-up is within 1 point of the best on a. The target (at most +5%) is met
    on a only.
    """
    out = []
    for f, g in best.groupby("fraction", sort=False):
        n = len(g)
        reached = g[g.variant.notna()]
        where = f"At {f:.0%} of the weight bytes"
        if reached.empty:
            out.append(f"{where} no recorded method reads that few bytes on any of the {n} models.")
            continue

        def one(r) -> str:  # a model, its best variant's rise and the runner-up's
            alt = (f", {r.runner_up} {_pct(r.runner_up_ratio)}" if r.runner_up is not None
                   and not math.isnan(r.runner_up_ratio) else "")  # fmt: skip
            return f"{names(r.model)} ({_pct(r.ratio)}{alt})"

        winners = sorted(reached.groupby("variant", sort=False), key=lambda kv: -len(kv[1]))
        if len(winners) == 1:
            v, on = winners[0]
            many = (f"all {n} models" if n > 1 else "the model") if len(on) == n else (
                f"{len(on)} of {n} models")  # fmt: skip
            text = f"{where} {v} is best on {many}: {listing(map(one, on.itertuples()))}"
        else:
            bits = []
            for i, (v, on) in enumerate(winners):
                many = f"{len(on)} of the {n} models, " if len(on) > 1 else ""
                lead = "is best on" if i == 0 else "on"
                bits.append(f"{v} {lead} {many}{listing(map(one, on.itertuples()))}")
            text = f"{where} the models disagree: " + "; ".join(bits)
        close = [
            r.model for r in reached.itertuples() if abs(r.runner_up_ratio - r.ratio) < CLOSE
        ]  # NaN compares False
        if close:
            text += (
                f"; the runner-up is within {CLOSE * 100:g} point of the best on "
                f"{'every model' if len(close) == len(reached) else listing(map(names, close))}"
            )
        unreached = g[g.variant.isna()].model.tolist()
        if unreached:
            text += f"; no recorded method reads that few bytes on {listing(map(names, unreached))}"
        target = float(g.target.iloc[0])
        met = g[g.meets].model.tolist()
        if math.isnan(target):
            out.append(text + ".")
            continue
        goal = f"The target (at most {target - 1:+.0%})"
        if not met:
            verdict = f"{goal} is met on none of the {n} models."
        elif len(met) == n:
            verdict = f"{goal} is met on all {n} models."
        else:
            verdict = f"{goal} is met on {listing(map(names, met))} only."
        out.append(f"{text}. {verdict}")
    return out


def _tilts(r) -> str:
    """' (tilt chosen 0.1 → 0.05)' where the two runs chose different tilts, else ''."""
    a, b = getattr(r, "tilt", math.nan), getattr(r, "tilt_again", math.nan)
    if a != a or b != b or a == b:  # NaN: not a tilted variant
        return ""
    return f" (tilt chosen {a:g} → {b:g})"


def _changed(main: dict, again: dict) -> str:
    """What a re-evaluation's provenance changed, in words: '1 thread instead of 2'."""
    said = []
    for key, unit in (("threads", "thread"), ("dtype", None), ("cpu", None)):
        a, b = main.get(key), again.get(key)
        if a is None or b is None or a == b:
            continue
        if unit:
            said.append(f"{b} {unit}{'' if b == 1 else 's'} instead of {a}")
        else:
            said.append(f"{b} instead of {a}")
    return ", ".join(said) or "the same settings"


def rerun_sentence(frame: pd.DataFrame, provs: dict, reruns: pd.DataFrame, rprovs: dict,
                   names=title) -> str:  # fmt: skip
    """How far each re-evaluated point (:data:`~dejavu_lab.report.frontiers.RERUN` recordings,
    loaded by :func:`~dejavu_lab.report.frontiers.load_frontiers`) moved from the same model's,
    variant's and sparsity's point in the frontier recording, in points of perplexity rise over
    each recording's own dense; '' when no point is in both.

    >>> frame = pd.DataFrame({"model": "a", "variant": ["dense", "w"], "sparsity": [0, 0.5],
    ...                       "ratio": [1.0, 1.20]})
    >>> again = frame.assign(model="a (x)", ratio=[1.0, 1.17])
    >>> rerun_sentence(frame, {"a": {"threads": 2}}, again,
    ...                {"a (x)": {"model": "a", "threads": 1}}, names=str)
    'Evaluated again on a with 1 thread instead of 2, the same points moved by 3.0 points of perplexity rise at most (median 3.0): w at 50% +20.0% → +17.0%.'
    """
    parts = []
    for key, prov in rprovs.items():
        model = str(prov.get("model", key))
        if model not in provs:
            continue
        mine = frame[(frame.model == model) & (frame.variant != "dense")]
        again = reruns[(reruns.model == key) & (reruns.variant != "dense")]
        both = mine.merge(again, on=["variant", "sparsity"], suffixes=("", "_again"))
        if not len(both):
            continue
        moved = (100 * (both.ratio_again - both.ratio)).abs()
        points = ", ".join(f"{r.variant} at {r.sparsity:.0%} {_pct(r.ratio)} → {_pct(r.ratio_again)}"
                           + _tilts(r) for r in both.itertuples())  # fmt: skip
        parts.append(f"on {names(model)} with {_changed(provs[model], prov)}, the same points "
                     f"moved by {moved.max():.1f} points of perplexity rise at most (median "
                     f"{moved.median():.1f}): {points}")  # fmt: skip
    return ("Evaluated again " + "; ".join(parts) + ".") if parts else ""
