"""The engine's default dense step beside the cuBLAS one, and DejaVu's fused step beside its
plain one, from ``kernels/bench_engine.py --methods dense,dense_columns,dejavu --plain``.

A batch-1 decoder built on a GPU stores the ``"columns"`` layout and runs every op through our
kernels (``dense_columns`` in the recording); ``dense`` is the cuBLAS step it replaced. The
recordings (:data:`FILES`) time both, with DejaVu's step on the fused loop (its block output
added and normed in one launch) and, as ``plain_ms_per_token``, on the plain loop.
:func:`default_table` takes the median over a file's repeats; :func:`default_sentence` says
what it shows.
"""

from __future__ import annotations

import pandas as pd

from .. import results
from ..errors import ResultsError

__all__ = ["FILES", "default_sentence", "default_table", "load"]

FILES = ("engine_dense_default", "engine_dense_default_13b")
STEPS = {"dense": "dense, cuBLAS", "dense_columns": "dense, default (our kernels)",
         "sparse": "DejaVu (lookahead predictors)", "teal": "TEAL"}  # fmt: skip


def load(names=FILES) -> tuple[pd.DataFrame, dict]:
    """(the step rows of every recording of ``names`` that exists, stacked; provenance per
    file). Raises :class:`~dejavu_lab.errors.ResultsError` when none exists.

    >>> frame, provs = load()
    >>> sorted(provs), sorted(set(frame.model))
    (['engine_dense_default', 'engine_dense_default_13b'], ['llama-2-13b', 'llama-3-8b', 'opt-13b'])
    """
    frame, provs, _ = results.load_many(
        names, lambda df: (df["kind"] == "e2e") & df["engine"].isin(list(STEPS))
    )
    if not provs:
        raise ResultsError(f"none of {', '.join(names)} is recorded in results/.")
    return frame, provs


def default_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per model, step and sparsity: ms per token (the median over the recording's repeats,
    and how many), the share of the copy ceiling its bytes reach (floor / time), and the plain
    loop's ms where the run timed it.

    >>> t = default_table(load()[0])
    >>> int(t.loc[("llama-3-8b", "dense, default (our kernels)", 0.0), "repeats"])
    3
    >>> bool(t.loc[("llama-3-8b", "dense, default (our kernels)", 0.0), "ms/token"]
    ...      < t.loc[("llama-3-8b", "dense, cuBLAS", 0.0), "ms/token"])
    True
    """
    f = frame.assign(step=frame["engine"].map(STEPS), sparsity=frame["sparsity"].fillna(0.0))
    if "plain_ms_per_token" not in f:
        f["plain_ms_per_token"] = float("nan")
    g = f.groupby(["model", "step", "sparsity"], sort=False)
    ms = g["ms_per_token"].median()
    return pd.DataFrame({
        "ms/token": ms,
        "repeats": g.size(),
        "of ceiling": g["floor_ms"].median() / ms,
        "plain loop ms/token": g["plain_ms_per_token"].median(),
    })  # fmt: skip


def default_sentence(table: pd.DataFrame, provs: dict) -> str:
    """Per model: the default dense step against cuBLAS's (ms and share of the ceiling), and
    DejaVu's fused step against its plain one where both were timed.

    >>> print(default_sentence(default_table(load()[0]), load()[1]))
    On the NVIDIA H100 80GB HBM3 ...: at llama-3-8b the default dense step takes 5.58 ms (0.90 of the copy ceiling) against cuBLAS's 6.11 ms (0.82)...
    """
    gpus = sorted({str(p.get("gpu")) for p in provs.values()})
    parts = []
    for model, t in table.groupby(level="model", sort=False):
        t = t.droplevel("model")
        cols, cub, dv = (t.loc[(STEPS[k], 0.0)] if (STEPS[k], 0.0) in t.index else None
                         for k in ("dense_columns", "dense", "sparse"))  # fmt: skip
        if cols is None or cub is None:
            continue
        text = (f"at {model} the default dense step takes {cols['ms/token']:.2f} ms "
                f"({cols['of ceiling']:.2f} of the copy ceiling) against cuBLAS's "
                f"{cub['ms/token']:.2f} ms ({cub['of ceiling']:.2f})")  # fmt: skip
        if dv is not None and dv["plain loop ms/token"] == dv["plain loop ms/token"]:  # timed
            text += (f"; DejaVu's fused step {dv['ms/token']:.2f} ms against its plain loop's "
                     f"{dv['plain loop ms/token']:.2f} ({dv['of ceiling']:.2f} of its floor)")  # fmt: skip
        parts.append(text)
    reps = max(int(table["repeats"].max()), 1)
    return (f"On the {' and '.join(gpus)} (batch 1, prompt 512, CUDA-graph replay, median of up "
            f"to {reps} fresh-process runs): " + "; ".join(parts) + ".")  # fmt: skip
