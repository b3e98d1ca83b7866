"""The observation chapters' numbers beside a larger model's recording (§3.1–3.3, App. C.1).

Each observation chapter measures its claim live on the demo model and, beside it, reads the
same numbers for a model ten times larger from ``results/observations_<model>.json`` (written
by :mod:`dejavu_lab.measure.observations`, the same functions at the same sizes). This module
puts them side by side:

- :func:`load_recording` — a recording's quantities as ``{name: (value, bracketed)}`` and its
  provenance;
- :func:`beside` — one chapter's table: the live column, the recorded model's, and the
  recorded demo model's when the live run read other sizes (quick mode), so one pair of
  columns is always like for like;
- :func:`verdict` — one or two sentences computed from those numbers (which model is sparser,
  whether the paper's sign or threshold holds on each);
- :func:`origin` — a caption clause: which model, dtype, text sizes, CPU, commit and age;
  :func:`note` — the table's caption, one line per column.
"""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd

from .. import results, staleness
from ..measure.observations import STAGE_SIZES, STAGES, Sizes
from .frontiers import title

__all__ = [
    "DEMO_RECORDING",
    "QUANTITIES",
    "RECORDING",
    "beside",
    "load_recording",
    "note",
    "origin",
    "verdict",
]

RECORDING = "observations_qwen2.5-1.5b"  # the larger model the chapters quote
DEMO_RECORDING = "observations_demo"  # the demo model through the same recorder
# What a recording depends on: its age is counted in commits to these.
PATHS = ("dejavu_lab/measure", "dejavu_lab/sparsify", "dejavu_lab/hooks.py", "dejavu_lab/corpus.py")


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def _pct1(v: float) -> str:
    return f"{100 * v:.1f}%"


# name -> (chapter, what it is, format); the chapters' tables list these in this order
QUANTITIES: dict[str, tuple[str, str, callable]] = {
    "mlp_token_sparsity": ("10", "median per-token MLP sparsity (90% of |act| mass)", _pct),
    "heads_token_sparsity": ("10", "median per-token head sparsity (90% of norm mass)", _pct),
    "dense_ppl": ("10", "dense perplexity", "{:.2f}".format),
    "mlp_rise10_oracle": ("10", "MLP sparsity at +10% perplexity, contextual", _pct),
    "mlp_rise10_static": ("10", "MLP sparsity at +10% perplexity, static", _pct),
    "heads_rise10_oracle": ("10", "head sparsity at +10% perplexity, contextual", _pct),
    "heads_rise10_static": ("10", "head sparsity at +10% perplexity, static", _pct),
    "mlp_rise01_oracle": ("10", "MLP sparsity at +1% perplexity, contextual", _pct),
    "cos_consecutive": ("20", "median cos(X_l, X_l+1), l ≥ 1", "{:.3f}".format),
    "cos_gap4": ("20", "median cos(X_l, X_l+4), l ≥ 1", "{:.3f}".format),
    "norm_ratio_attn": ("20", "median ‖X‖/‖F(X)‖, attention, l ≥ 1", "{:.1f}".format),
    "norm_ratio_mlp": ("20", "median ‖X‖/‖F(X)‖, MLP, l ≥ 1", "{:.1f}".format),
    "rho_entropy_norm": ("30", "Spearman ρ(entropy, output norm) over heads", "{:+.2f}".format),
    "share_sink": ("30", "share of sink heads", _pct),
    "share_uniform_mixing": ("30", "share of uniform-mixing heads", _pct),
    "share_heavy_hitter": ("30", "share of heavy-hitter heads", _pct),
    "union_batch": ("35", "largest batch B (sequences)", "{:.0f}".format),
    "union_top10_mlp": ("35", "MLP union sparsity at B, each token's top 10%", _pct1),
    "union_top10_mlp_uniform": ("35", "… uniform random sets of that density", _pct1),
    "union_mass90_mlp": ("35", "MLP union sparsity at B, 90% of the mass", _pct1),
    "union_mass90_heads": ("35", "head union sparsity at B, 90% of the mass", _pct1),
}


def _chapter(chapter: str) -> str:
    return chapter.split("_")[0]


def load_recording(name: str = RECORDING) -> tuple[dict[str, tuple[float, bool]], dict]:
    """``({quantity: (value, bracketed)}, provenance)`` of ``results/<name>.json``.

    ``bracketed`` is False where a perplexity curve never crossed its rise (read "at least").

    >>> values, prov = load_recording()
    >>> 0 < values["cos_consecutive"][0] <= 1, prov["n_layers"]
    (True, 28)
    """
    frame, prov = results.load(name)
    frame = frame[frame["name"] != "ppl"]
    brk = frame["bracketed"] if "bracketed" in frame else pd.Series(True, index=frame.index)
    values = {
        r.name: (float(r.value), not (b is not None and b == b and not bool(b)))  # NaN: True
        for r, b in zip(frame.itertuples(), brk, strict=True)
    }
    return values, prov


def _stages(chapter: str) -> list[str]:
    return [s for s, c in STAGES.items() if _chapter(c) == _chapter(chapter)]


def _sizes_text(chapter: str, sizes: dict) -> str:
    """The sizes of a chapter's stages in words, for a caption."""
    ch = _chapter(chapter)
    if ch == "10":
        return (f"{sizes['eval_windows']} × {sizes['window']}-token windows, static sets from "
                f"{sizes['calib_windows']} others")  # fmt: skip
    if ch == "20":
        return f"{sizes['embed_windows']} × {sizes['window']}-token windows"
    if ch == "30":
        return f"{sizes['head_windows']} × {sizes['window']}-token windows"
    return (f"{sizes['union_windows']} sequences × {sizes['union_window']} tokens, "
            f"{sizes['union_positions']} positions each, {sizes['union_draws']} batches per size")  # fmt: skip


def origin(prov: dict, chapter: str) -> str:
    """Caption clause for a recording: model, dtype, the chapter's text sizes, CPU, commit, age.

    >>> origin(load_recording()[1], "20_slowly_changing_embeddings")
    'Qwen2.5-Coder-1.5B-Instruct, bfloat16, Lee news corpus (4 × 256-token windows), ... CPU, 1 thread, ...'
    """
    threads = prov.get("threads", 1)
    by_stage = prov.get("stage_git_sha") or {}
    shas = list(dict.fromkeys(by_stage.get(s, prov["git_sha"]) for s in _stages(chapter)))
    age = staleness.note({"git_sha": shas[0], "repeats": [{"git_sha": x} for x in shas[1:]]},
                         paths=PATHS, what="the measuring code")  # fmt: skip
    return (f"{title(str(prov.get('model')))}, {prov.get('model_dtype')}, Lee news corpus "
            f"({_sizes_text(chapter, prov['sizes'])}), {prov.get('cpu')} CPU, {threads} "
            f"thread{'s' * (threads != 1)}, {str(prov.get('date', ''))[:10]}, {age}")  # fmt: skip


def note(chapter: str, live_caption: str, *, sizes: Sizes, recording: str = RECORDING,
         demo_recording: str = DEMO_RECORDING) -> str:  # fmt: skip
    """The caption of :func:`beside`'s table (Markdown): where each column comes from.

    >>> text = note("20_slowly_changing_embeddings", "Model: demo.", sizes=Sizes())
    >>> text.startswith("*Live column:* Model: demo. *Recorded:* Qwen2.5-Coder-1.5B-Instruct")
    True
    >>> "same sizes" in note("20_slowly_changing_embeddings", "", sizes=Sizes(window=48))
    True
    """
    _, prov = load_recording(recording)
    text = f"*Live column:* {live_caption} *Recorded:* {origin(prov, chapter)}."
    if not _same_sizes(chapter, asdict(sizes), prov["sizes"]):
        _, dprov = load_recording(demo_recording)
        text += (" *Third column:* the live run read other sizes (quick mode), so the demo "
                 f"model recorded at the same sizes stands beside it: {origin(dprov, chapter)}.")  # fmt: skip
    return text


def _same_sizes(chapter: str, live: dict, recorded: dict) -> bool:
    keys = {k for s in _stages(chapter) for k in STAGE_SIZES[s]}
    norm = {k: [round(float(x), 9) for x in v] if isinstance(v, list | tuple) else v
            for k, v in live.items()}  # fmt: skip
    rec = {k: [round(float(x), 9) for x in v] if isinstance(v, list | tuple) else v
           for k, v in recorded.items()}  # fmt: skip
    return all(norm.get(k) == rec.get(k) for k in keys)


def _cell(name: str, v) -> str:
    value, bracketed = v if isinstance(v, tuple) else (v, True)
    return ("≥ " if not bracketed else "") + QUANTITIES[name][2](value)


def beside(chapter: str, live: dict, *, sizes: Sizes, model: str = "demo model",
           recording: str = RECORDING, demo_recording: str = DEMO_RECORDING) -> pd.DataFrame:  # fmt: skip
    """One chapter's quantities: ``live`` (its ``*_quantities`` output; ``model`` names it)
    beside ``recording``; with a third column from ``demo_recording`` when ``sizes`` (the live
    run's) differ from the recording's, so that two columns are always like for like.

    >>> from dejavu_lab.measure.observations import head_quantities
    >>> heads = pd.DataFrame({"entropy": [0.2, 0.5, 0.9], "rel_norm": [0.5, 1.0, 1.5],
    ...                       "kind": ["sink", "heavy-hitter", "uniform-mixing"]})
    >>> table = beside("30_mean_shift_heads", head_quantities(heads), sizes=Sizes(head_windows=1))
    >>> table.columns.tolist()[1:]
    ['Qwen2.5-Coder-1.5B-Instruct (recorded)', 'demo model (recorded, same sizes)']
    """
    rec, prov = load_recording(recording)
    names = [n for n, (ch, *_) in QUANTITIES.items() if ch == _chapter(chapter) and n in rec]
    table = pd.DataFrame({"quantity": [QUANTITIES[n][1] for n in names]})
    table[f"{model} (live)"] = [_cell(n, live[n]) if n in live else "—" for n in names]
    table[f"{title(str(prov.get('model')))} (recorded)"] = [_cell(n, rec[n]) for n in names]
    if not _same_sizes(chapter, asdict(sizes), prov["sizes"]):
        demo, _ = load_recording(demo_recording)
        table["demo model (recorded, same sizes)"] = [
            _cell(n, demo[n]) if n in demo else "—" for n in names
        ]
    return table.set_index("quantity")


def _more(a: float, b: float, tol: float, more: str, less: str, same: str) -> str:
    """``more`` if a exceeds b by more than ``tol``, ``less`` if it falls short, else ``same``.

    >>> _more(0.7, 0.5, 0.02, "more X than", "less X than", "about as much X as")
    'more X than'
    """
    return same if abs(a - b) <= tol else (more if a > b else less)


def verdict(chapter: str, demo: dict, recording: str = RECORDING, *,
            sizes: Sizes | None = None, demo_recording: str = DEMO_RECORDING) -> str:  # fmt: skip
    """Sentences comparing the recorded model with the demo model's numbers ``demo`` on the
    paper's claim of ``chapter`` — computed, so they follow the data. When ``sizes`` (those
    ``demo`` was measured at) differ from the recording's, the demo model's recording at the
    same sizes stands in for ``demo``, so the comparison stays like for like.

    >>> demo, _ = load_recording(DEMO_RECORDING)
    >>> verdict("30_mean_shift_heads", demo).startswith("Over heads, ρ(entropy, norm)")
    True
    """
    rec, prov = load_recording(recording)
    if sizes is not None and not _same_sizes(chapter, asdict(sizes), prov["sizes"]):
        demo, _ = load_recording(demo_recording)
    big = title(str(prov.get("model"))).removesuffix("-Instruct")

    def v(d: dict, n: str) -> float:
        x = d[n]
        return float(x[0] if isinstance(x, tuple) else x)

    def pct(d: dict, n: str) -> str:  # "≥" where the curve never crossed the rise
        x = d[n]
        return ("≥ " if isinstance(x, tuple) and not x[1] else "") + f"{v(d, n):.0%}"

    ch = _chapter(chapter)
    if ch == "10":
        mo, ms = v(rec, "mlp_rise10_oracle"), v(rec, "mlp_rise10_static")
        ho, do = v(rec, "heads_rise10_oracle"), v(demo, "mlp_rise10_oracle")
        dh = v(demo, "heads_rise10_oracle")
        mlp = _more(
            mo,
            do,
            0.02,
            "more contextual MLP sparsity than",
            "less contextual MLP sparsity than",
            "about as much contextual MLP sparsity as",
        )
        heads = _more(ho, dh, 0.02, "larger", "smaller", "about the same")
        gap = "holds" if mo > ms + 0.05 else "does not hold"
        return (f"At +10% perplexity {big} tolerates {mlp} the demo model "
                f"({pct(rec, 'mlp_rise10_oracle')} against {pct(demo, 'mlp_rise10_oracle')}); "
                f"the share of heads it can drop is {heads} ({pct(rec, 'heads_rise10_oracle')} "
                f"against {pct(demo, 'heads_rise10_oracle')}). Contextual against static "
                f"({pct(rec, 'mlp_rise10_oracle')} against {pct(rec, 'mlp_rise10_static')} of "
                f"MLP neurons): the paper's gap {gap} at this size.")  # fmt: skip
    if ch == "20":
        c, dc = v(rec, "cos_consecutive"), v(demo, "cos_consecutive")
        r, dr = v(rec, "norm_ratio_mlp"), v(demo, "norm_ratio_mlp")
        closer = _more(
            c,
            dc,
            0.002,
            "closer to the paper's 0.99 than",
            "further from the paper's 0.99 than",
            "as close to the paper's 0.99 as",
        )
        above = "above" if c > 0.95 else "below"
        return (f"Consecutive layers of {big} agree to a median cosine of {c:.3f} ({above} the "
                f"paper's 0.95), {closer} the demo model's ({dc:.3f}); its "
                f"residual is {r:.1f}× the MLP's update against {dr:.1f}× on the demo model.")  # fmt: skip
    if ch == "30":
        r, dr = v(rec, "rho_entropy_norm"), v(demo, "rho_entropy_norm")
        holds = {(True, True): "on both models", (False, False): "on neither model",
                 (True, False): f"on {big} only", (False, True): "on the demo model only"}  # fmt: skip
        return (f"Over heads, ρ(entropy, norm) is {r:+.2f} on {big} and {dr:+.2f} on the demo "
                f"model: the paper's negative sign (low-norm heads are the uniform ones) holds "
                f"{holds[(r < 0, dr < 0)]}. Sink heads are {v(rec, 'share_sink'):.0%} of "
                f"{big}'s heads, {v(demo, 'share_sink'):.0%} of the demo model's.")  # fmt: skip
    u, uu = v(rec, "union_top10_mlp"), v(rec, "union_top10_mlp_uniform")
    du, b = v(demo, "union_top10_mlp"), int(v(rec, "union_batch"))
    more = _more(u, du, 0.005, "more than", "less than", "about as much as")
    ratio = f"{u / uu:.1f}× what" if uu > 0 else "far more than"
    return (f"With each token's top 10% of MLP neurons, a batch of {b} sequences leaves "
            f"{u:.1%} of {big}'s MLP unused ({ratio} uniform random sets would), {more} "
            f"on the demo model ({du:.1%}); at 90% of the mass the union leaves "
            f"{v(rec, 'union_mass90_mlp'):.1%}.")  # fmt: skip
