"""How the int4 codes are chosen, and what it costs in perplexity (the 4-bit chapter).

Three ways to pick each group's scale and min at the same group size and bytes, from the
recordings of ``python -m dejavu_lab.measure.quant_quality`` that ran them side by side
(:data:`FILES`): round-to-nearest over the group's whole range (``rtn``), the range searched
for the smallest squared weight error (``mse``), and that error weighed by each input channel's
mean squared activation on calibration text (``act``; :mod:`dejavu_lab.quant.refine`).
:func:`rounding_table` puts their perplexity rises side by side; :func:`rounding_sentence`
says what they show.
"""

from __future__ import annotations

import pandas as pd

from .. import results
from .int4 import load_quality, quality_table

__all__ = ["FILES", "HEAD_FILES", "KINDS", "LONG_FILES", "head_sentence", "load_rounding",
           "longer_text_sentence", "rounding_sentence", "rounding_table"]  # fmt: skip

#: the recordings that ran the three roundings side by side, one per model
FILES = (
    "quant_quality_demo_mse",
    "quant_quality_qwen2.5-0.5b_mse",
    "quant_quality_qwen2.5-1.5b_act",
)
#: the recordings that ran round-to-nearest with and without the output projection in int4
HEAD_FILES = ("quant_quality_head_demo", "quant_quality_head_qwen2.5-0.5b")
#: the recordings of every format on twice the held-out text (8 windows of 512 tokens)
LONG_FILES = (
    "quant_quality_demo_w8",
    "quant_quality_demo_w8_g32",
    "quant_quality_qwen2.5-0.5b_w8",
    "quant_quality_qwen2.5-0.5b_w8_g32",
    "quant_quality_qwen2.5-1.5b_w8",
)
KINDS = {"rtn": "round-to-nearest", "mse": "least weight error", "act": "activation-weighted"}


def load_rounding(names=FILES):
    """(rows, provenance per file) of the rounding recordings (:func:`~.int4.load_quality`).

    >>> frame, provs = load_rounding()
    >>> sorted(set(frame["format"]))
    ['act-g128', 'fp', 'mse-g128', 'rtn-g128']
    """
    return load_quality(names)


def rounding_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Perplexity rise over the model's fp dense (%), one column per rounding, one row per
    model, variant and sparsity; and the sparsity's interaction with each (``quality_table``).

    >>> t = rounding_table(load_rounding()[0])
    >>> list(t.columns)[:4]
    ['fp', 'round-to-nearest', 'least weight error', 'activation-weighted']
    """
    t = quality_table(frame).reset_index()
    t["rounding"] = t["format"].map(lambda f: KINDS.get(f.split("-g")[0], f))
    t["model"] = t["model"].map(lambda m: m.split(" (")[0])
    rise = t.pivot_table(index=["model", "variant", "sparsity"], columns="rounding",
                         values="rise over fp dense %", sort=False)  # fmt: skip
    inter = t[t["format"] != "fp"].pivot_table(index=["model", "variant", "sparsity"],
                                               columns="rounding", values="interaction %",
                                               sort=False)  # fmt: skip
    inter = inter.drop(index="dense", level="variant", errors="ignore")
    inter.columns = [f"{c}: interaction" for c in inter.columns]
    order = ["fp", *KINDS.values()]
    return rise[[c for c in order if c in rise]].join(inter, how="left")


def rounding_sentence(table: pd.DataFrame, variant: str = "teal (uniform)",
                      sparsity: float = 0.4) -> str:  # fmt: skip
    """What the three roundings cost per model, dense and with ``variant`` at ``sparsity``, as
    perplexity rises over the model's fp dense.

    >>> rounding_sentence(rounding_table(load_rounding()[0]))
    'On SmolLM2-135M-Instruct, dense, the int4 weights cost +42.2% with round-to-nearest codes, ...'
    """
    phrases = {"round-to-nearest": "with round-to-nearest codes",
               "least weight error": "with the least weight error",
               "activation-weighted": "activation-weighted"}  # fmt: skip
    parts = []
    for model, m in table.groupby(level="model", sort=False):
        m = m.droplevel("model").dropna(axis=1, how="all")
        kinds = [k for k in KINDS.values() if k in m]  # the roundings this model ran
        dense = m.xs("dense", level="variant").iloc[0]
        said = [f"{dense[k]:+.1f}% {phrases[k]}" for k in kinds]
        text = (f"On {model}, dense, the int4 weights cost " + ", ".join(said[:-1])
                + (" and " if len(said) > 1 else "") + said[-1])  # fmt: skip
        if (variant, sparsity) in m.index:
            s = m.loc[(variant, sparsity)]
            text += (f"; with {variant} at {sparsity:.0%} ({s['fp']:+.1f}% on fp) "
                     + " / ".join(f"{s[k]:+.1f}%" for k in kinds))  # fmt: skip
        parts.append(text + ".")
    return " ".join(parts)


def head_sentence(names=HEAD_FILES, variant: str = "teal (uniform)", sparsity: float = 0.4) -> str:
    """What rounding the output projection (``lm_head``) to int4 as well costs per recorded
    model, dense and with ``variant`` at ``sparsity`` (rises over the model's fp dense), or ''
    when none of ``names`` is recorded.

    >>> head_sentence()
    'Rounding the output projection to int4 as well (round-to-nearest, group 128 or the largest ...'
    >>> head_sentence(("no_such_recording",))
    ''
    """
    recorded = set(results.list_results())
    names = [n for n in names if n in recorded]
    if not names:
        return ""
    frame, provs = load_quality(names)
    t = quality_table(frame).reset_index()
    parts = []
    for model, g in t.groupby("model", sort=False):
        rise = g.set_index(["format", "variant", "sparsity"])["rise over fp dense %"]
        base = [f for f in g["format"].unique() if f + "+head" in set(g["format"])]
        if not base:
            continue
        f = base[0]
        text = (
            f"on {model.split(' (')[0]}, dense {rise[(f, 'dense', 0.0)]:+.1f}% with the "
            f"layers alone and {rise[(f + '+head', 'dense', 0.0)]:+.1f}% with the head too"
        )
        if (f, variant, sparsity) in rise and (f + "+head", variant, sparsity) in rise:
            text += (f", {variant} at {sparsity:.0%} {rise[(f, variant, sparsity)]:+.1f}% and "
                     f"{rise[(f + '+head', variant, sparsity)]:+.1f}%")  # fmt: skip
        parts.append(text)
    if not parts:
        return ""
    shas = ", ".join(sorted({str(p.get("git_sha", "?"))[:7] for p in provs.values()}))
    return ("Rounding the output projection to int4 as well (round-to-nearest, group 128 or the "
            "largest that divides its inputs), against the fp dense model: "
            + "; ".join(parts) + f" (recorded on CPU at commit {shas}: "
            + ", ".join(f"results/{n}.json" for n in names) + ").")  # fmt: skip


def longer_text_sentence(names=LONG_FILES, variant: str = "teal (uniform)",
                         sparsity: float = 0.4) -> str:  # fmt: skip
    """What ``variant`` at ``sparsity`` costs over each weight format's own dense model, against
    the same on the fp weights (in points), from the recordings of ``names`` that exist (every
    format on 8 held-out windows), or '' when none does.

    >>> s = longer_text_sentence()
    >>> s.startswith("On 4,096 held-out tokens, teal (uniform) at 40% raises"), "points" in s
    (True, True)
    >>> longer_text_sentence(("no_such_recording",))
    ''
    """
    recorded = set(results.list_results())
    names = [n for n in names if n in recorded]
    if not names:
        return ""
    parts, provs, seen = [], {}, set()
    for name in names:  # each recording against its own fp run (threads move fp's last digits)
        frame, prov = load_quality([name])
        provs.update(prov)
        t = quality_table(frame).reset_index()
        t = t[(t["variant"] == variant) & (t["sparsity"] == sparsity)]
        for model, g in t.groupby("model", sort=False):
            fp = float(g["same on fp %"].iloc[0])
            each = [f"{f} {r:+.1f}% ({r - fp:+.1f} points)" for f, r in
                    zip(g["format"], g["rise over own dense %"], strict=True) if f != "fp"]  # fmt: skip
            label = model.split(" (")[0] + (" (another run)" if model in seen else "")
            seen.add(model)
            parts.append(f"{label}: fp {fp:+.1f}%, " + ", ".join(each))
    shas = ", ".join(sorted({str(p.get("git_sha", "?"))[:7] for p in provs.values()}))
    counts = sorted({int(p.get("tokens", 0) or 0) for p in provs.values()} - {0})
    tokens = "/".join(f"{c:,}" for c in counts) or "the"
    return (f"On {tokens} held-out tokens, {variant} at {sparsity:.0%} raises perplexity over each "
            "format's own dense model by (points against the same on fp): " + "; ".join(parts)
            + f" (recorded on CPU at commit {shas}: "
            + ", ".join(f"results/{n}.json" for n in names) + ").")  # fmt: skip
