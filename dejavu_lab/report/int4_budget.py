"""The 4-bit chapter's closing box: for each quality budget, the recorded combination of weight
format and activation sparsity that reads the fewest bytes (:func:`budget_table`), as the
chapter's Markdown list (:func:`budget_markdown`) and one sentence (:func:`budget_sentence`).
The quality comes from :func:`dejavu_lab.report.int4.quality_table`; the bytes from
:func:`dejavu_lab.step_bytes.step_bytes` at a Llama shape.
"""

from __future__ import annotations

import math

import pandas as pd

from ..arch import get_arch
from ..models import PRESETS
from ..step_bytes import step_bytes
from .int4 import TEAL_SITES, fitting_group, format_label

__all__ = ["budget_markdown", "budget_sentence", "budget_table"]


def _bytes_at(arch, vocab: int, fmt: str, variant: str, sparsity: float, context: int) -> float:
    """Bytes per token at ``arch``'s shape of a quality study's row (format, variant)."""
    kw = {}
    if fmt != "fp":
        g = 32 if fmt == "gguf" else int(fmt.removeprefix("rtn-g"))
        kw = {"int4_group": fitting_group(arch, g), "scale_esize": 4 if fmt == "gguf" else 2}
    k = 1 - sparsity
    site = {} if variant == "dense" else (
        {"gate": k} if variant.startswith("cats") else dict.fromkeys(TEAL_SITES, k))  # fmt: skip
    return step_bytes(arch, vocab=vocab, context=context, site_kept=site, **kw)["total"]


def budget_table(quality: pd.DataFrame, budgets=(2, 10, 25, 50, 100), *,
                 engine: pd.DataFrame | None = None, shape: str = "llama-3-8b",
                 context: int = 512, tbps: float = 4.2) -> pd.DataFrame:  # fmt: skip
    """For each model of ``quality`` (:func:`~dejavu_lab.report.int4.quality_table`) and each budget (perplexity rise
    over its fp dense, in percent): the recorded combination that reads the fewest decoder-layer
    bytes within the budget, and what it would read and take per token at ``shape``'s size —
    its bytes (:func:`~dejavu_lab.step_bytes.step_bytes`, greedy allocations at their mean
    kept fraction) over ``tbps`` (the H200's copy ceiling), and the measured ms per token when
    ``engine`` (:func:`~dejavu_lab.report.int4_speed.engine_table`) timed that combination at that shape.

    >>> from dejavu_lab.report.int4 import load_quality, quality_table
    >>> box = budget_table(quality_table(load_quality()[0]))
    >>> box.loc[("Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)", 10)][["format", "variant", "rise over fp dense %"]]
    format                  rtn-g128
    variant                    dense
    rise over fp dense %    9.306527
    Name: (Qwen2.5 Coder 0.5B Instruct AWQ (qwen2.5-coder-0.5b-instruct-q4_k_m.gguf), 10), dtype: object
    """
    arch, vocab = get_arch(PRESETS[shape].config()), PRESETS[shape].vocab
    dense16 = step_bytes(arch, vocab=vocab, context=context)["total"]
    timed = {}
    if engine is not None and len(engine):
        e = engine.reset_index()
        timed = {(r["weights"], r["engine"], r["sparsity"]): r["ms/token"]
                 for _, r in e[e["model"] == shape].iterrows()}  # fmt: skip
    rows = []
    for model, t in quality.groupby(level="model", sort=False):
        t = t.reset_index()
        for budget in budgets:
            ok = t[t["rise over fp dense %"] <= budget]
            if not len(ok):
                rows.append({"model": model, "budget %": budget, "format": "none fits"})
                continue
            best = ok.sort_values(["layer bytes vs fp16", "perplexity"]).iloc[0]
            b = _bytes_at(arch, vocab, best["format"], best["variant"], best["sparsity"], context)
            weights = "fp16" if best["format"] == "fp" else "int4"
            method = best["variant"].split(" ")[0]
            grp = 128 if best["format"] == "rtn-g128" else None
            measured = (
                timed.get((weights, method, best["sparsity"]), math.nan)
                if (weights == "fp16" or grp == 128)
                else math.nan
            )  # the engine's int4 is RTN g128
            rows.append({"model": model, "budget %": budget, "format": best["format"],
                         "variant": best["variant"], "sparsity": best["sparsity"],
                         "groups": best["groups"],
                         "rise over fp dense %": best["rise over fp dense %"],
                         "layer bytes vs fp16": best["layer bytes vs fp16"],
                         f"{shape} GB/token": b / 1e9,
                         f"{shape} of fp16 dense": b / dense16,
                         f"{shape} ms/token at {tbps} TB/s": b / (tbps * 1e12) * 1e3,
                         f"{shape} measured ms/token": measured})  # fmt: skip
    return pd.DataFrame(rows).set_index(["model", "budget %"])


def budget_markdown(box: pd.DataFrame, shape: str = "llama-3-8b") -> str:
    """The budget table as a Markdown list, one line per model and budget, for the chapter's box.

    >>> from dejavu_lab.report.int4 import load_quality, quality_table
    >>> print(budget_markdown(budget_table(quality_table(load_quality()[0]))).splitlines()[1])
    - **≤ 2%**: int4 RTN, group 32, dense (+0.0%, 0.31 of fp16's layer bytes); 5.5 GB per token at llama-3-8b size, 0.36 of fp16 dense's.
    """
    lines = []
    for model, t in box.groupby(level="model", sort=False):
        lines.append(f"**{model.split(' (')[0]}**")
        for (_, budget), r in t.iterrows():
            if r["format"] == "none fits":
                lines.append(f"- **≤ {budget}%**: no recorded combination fits.")
                continue
            how = "dense" if r["variant"] == "dense" else f"{r['variant']} at {r['sparsity']:.0%}"
            ms = r.get(f"{shape} measured ms/token", math.nan)
            timing = f", measured {ms:.2f} ms per token" if ms == ms else ""
            gb, frac = r[f"{shape} GB/token"], r[f"{shape} of fp16 dense"]
            lines.append(f"- **≤ {budget}%**: {format_label(r['format'], r['groups'])}, {how} "
                         f"({r['rise over fp dense %']:+.1f}%, {r['layer bytes vs fp16']:.2f} of "
                         f"fp16's layer bytes); {gb:.1f} GB per token at {shape} size, "
                         f"{frac:.2f} of fp16 dense's{timing}.")  # fmt: skip
        lines.append("")
    return "\n".join(lines).strip()


def budget_sentence(box: pd.DataFrame) -> str:
    """What the budget box (:func:`budget_table`) decided, per model: the pick at the smallest
    budget and the budget at which activation sparsity first enters.

    >>> from dejavu_lab.report.int4 import load_quality, quality_table
    >>> budget_sentence(budget_table(quality_table(load_quality()[0])))
    'On SmolLM2-135M-Instruct the smallest budget (≤ 2%) takes int4 RTN, group 32, dense, and sparsity first enters at ≤ 50%; on Qwen2.5 Coder 0.5B Instruct AWQ ... at ≤ 25%.'
    """
    parts = []
    for model, t in box.groupby(level="model", sort=False):
        t = t.droplevel("model")
        fits = t[t["format"] != "none fits"]
        if not len(fits):
            parts.append(f"on {model.split(' (')[0]} no recorded combination fits any budget")
            continue
        first, r = fits.index[0], fits.iloc[0]
        text = (f"on {model.split(' (')[0]} the smallest budget (≤ {first}%) takes "
                f"{format_label(r['format'], r['groups'])}, {r['variant']}")  # fmt: skip
        sparse = fits[fits["variant"] != "dense"]
        text += (f", and sparsity first enters at ≤ {sparse.index[0]}%" if len(sparse)
                 else ", and no budget shown takes sparsity")  # fmt: skip
        parts.append(text)
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]
