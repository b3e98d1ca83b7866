"""What DejaVu's lookahead predictors cost a decode step, variant by variant, from
``kernels/bench_engine.py --methods dejavu`` (:data:`FILES`) and ``kernels/bench_topk.py``.

The engine's DejaVu step predicts layer i + 1's kept sets while layer i computes, on a second
CUDA stream. Its rows time the same step with the predictors as they run by default, with one
part of their path changed (the scores by PyTorch's ops, the stream at default priority, the
down projections by the one-tile kernel, the kept sets by our select kernel), inline on one stream, and with fixed sets and no predictors at
all: the difference to that last row is what the predictors put on the critical path.
:func:`path_table` takes the median over a file's repeats; :func:`path_sentence` and
:func:`topk_sentence` say what the recordings show.
"""

from __future__ import annotations

import pandas as pd

from .. import results
from ..errors import ResultsError
from .methods import LABELS

__all__ = ["FILES", "TOPK_FILES", "load", "path_sentence", "path_table", "topk_sentence"]

FILES = ("engine_dejavu_tuned",)  # OPT-13B, OPT-30B and Llama-3-8B, fresh-process runs
TOPK_FILES = ("topk_select", "topk_split")  # ours against torch.topk; a split top-k (H200)
FIXED = "sparse_fixed_sets"


def load(names=FILES) -> tuple[pd.DataFrame, dict]:
    """(DejaVu's step rows of every recording of ``names`` that exists, stacked; provenance per
    file). Raises :class:`~dejavu_lab.errors.ResultsError` when none exists.

    >>> frame, provs = load()
    >>> sorted(set(frame.model)), "sparse_torch_scores" in set(frame.engine)
    (['llama-3-8b', 'opt-13b', 'opt-30b'], True)
    """
    frame, provs, _ = results.load_many(
        names, lambda df: (df["kind"] == "e2e") & (df["method"] == "dejavu")
    )
    if not provs:
        raise ResultsError(f"none of {', '.join(names)} is recorded in results/.")
    return frame, provs


def path_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model and variant: ms per token (median over repeats, and how many), the share of
    the bytes floor it reaches, and the ms it adds over fixed sets (the predictors' cost on the
    critical path).

    >>> t = path_table(load()[0])
    >>> bool(t.loc[("opt-13b", "DejaVu"), "over fixed sets (ms)"]
    ...      < t.loc[("opt-13b", "DejaVu, predictor scores by PyTorch ops"), "over fixed sets (ms)"])
    True
    """
    g = frame.groupby(["model", "engine"], sort=False)
    ms = g["ms_per_token"].median()
    t = pd.DataFrame({"ms/token": ms, "repeats": g.size(), "of floor": g["floor_ms"].median() / ms})
    fixed = t.xs(FIXED, level="engine")["ms/token"]
    t["over fixed sets (ms)"] = (
        t["ms/token"] - fixed.reindex(t.index.get_level_values("model")).values
    )
    return t.rename(index=LABELS, level="engine").rename_axis(["model", "variant"])


def path_sentence(table: pd.DataFrame, provs: dict) -> str:
    """Per model: the predictors' cost over fixed sets by default, and with each change undone.

    >>> print(path_sentence(path_table(load()[0]), load()[1]))
    On the NVIDIA H100 80GB HBM3 ...: at opt-13b the predictors add ... ms per token over fixed sets...
    """
    gpus = sorted({str(p.get("gpu")) for p in provs.values()})
    parts = []
    for model, t in table.groupby(level="model", sort=False):
        t = t.droplevel("model")["over fixed sets (ms)"]
        if LABELS["sparse"] not in t:
            continue
        cost = t[LABELS["sparse"]]
        text = (f"at {model} the predictors add {cost:.2f} ms per token over fixed sets" if cost >= 0.01
                else f"at {model} the predictors add nothing measurable over fixed sets ({cost:+.2f} ms)")  # fmt: skip
        others = [(k, LABELS[k]) for k in ("sparse_untuned", "sparse_torch_scores",
                                            "sparse_side_priority_0",
                                            "sparse_down_tile", "sparse_torch_topk",
                                            "sparse_select_kernel",
                                            "sparse_inline_predictors")]  # fmt: skip
        alt = [f"{t[label]:.2f} with {what}" for k, label in others if label in t
               for what in [_WHAT[k]]]  # fmt: skip
        if alt:
            text += " (" + ", ".join(alt) + ")"
        parts.append(text)
    reps = max(int(table["repeats"].max()), 1)
    return (f"On the {' and '.join(gpus)} (batch 1, prompt 512, CUDA-graph replay, median of up "
            f"to {reps} fresh-process runs): " + "; ".join(parts) + ".")  # fmt: skip


_WHAT = {"sparse_untuned": "the kernels not timed (torch.topk, split down projections)",
         "sparse_torch_scores": "the scores by PyTorch's ops",
         "sparse_side_priority_0": "the side stream at default priority",
         "sparse_down_tile": "the down projections by the one-tile kernel",
         "sparse_select_kernel": "the kept sets by our select kernel",
         "sparse_torch_topk": "the kept sets by torch.topk",
         "sparse_inline_predictors": "everything inline"}  # fmt: skip


def topk_sentence(names=TOPK_FILES) -> str:
    """What the top-k benchmarks measured: torch.topk against our select kernel (and against
    the split top-k where recorded), per call at OPT-13B's 20,480 neurons, 85% dropped.

    >>> print(topk_sentence())
    Selecting 3,072 of OPT-13B's 20,480 neurons takes torch.topk ... µs per call on the ...
    """
    rows = []
    for name in names:
        try:
            df, prov = results.load(name)
        except ResultsError:
            continue
        r = df[(df["shape"] == "opt-13b") & (df["n"] == 20480) & (df["rows"] == 1)].iloc[0]
        other, what = (("kernel_us", "our one-program select") if "kernel_us" in r
                       else ("split_us", "two single-block passes over halves"))  # fmt: skip
        rows.append(f"torch.topk {r['torch_us']:.0f} µs per call on the {prov['gpu']}, "
                    f"{what} {r[other]:.0f} µs")  # fmt: skip
    if not rows:
        raise ResultsError(f"none of {', '.join(names)} is recorded in results/.")
    return ("Selecting 3,072 of OPT-13B's 20,480 neurons takes " + "; ".join(rows)
            + " (CUDA-graph replay, one call alone); inside the step the engine times both.")  # fmt: skip
