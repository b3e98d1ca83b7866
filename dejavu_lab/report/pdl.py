"""What programmatic dependent launch buys the decode step, from recorded runs (the end-to-end
chapter).

``kernels/bench_engine_int4.py`` run three times on one machine, the same commit, with
``DEJAVU_PDL=0`` (each kernel launched after the one before has ended), ``DEJAVU_PDL_EARLY=0``
(launched as the one before exits, waiting at its first instruction) and the default (the one
before lets it launch once its own blocks are running): :func:`early_sentence` sets the three
side by side for every step the runs timed.
"""

from __future__ import annotations

from .. import results
from ..errors import ResultsError

__all__ = ["EARLY_FILES", "early_sentence", "early_table"]

#: the three recordings, by launch mode: no PDL, PDL with the wait only, PDL with the early signal
EARLY_FILES = {
    "no PDL": "engine_int4_8b_pdl_off",
    "PDL, launched at exit": "engine_int4_8b_pdl_wait",
    "PDL, launched early": "engine_int4_8b_pdl_early",
}


def early_table(files=None):
    """ms per token of each step (weights, engine, sparsity) in each launch mode, as a pandas
    DataFrame (one column per mode of :data:`EARLY_FILES`), and the provenance of the runs;
    None when a recording is missing.

    >>> t = early_table()
    >>> t is None or list(t[0].columns) == list(EARLY_FILES)
    True
    """
    import pandas as pd

    cols, prov = {}, {}
    for mode, name in (files or EARLY_FILES).items():
        try:
            frame, prov = results.load(name)
        except ResultsError:
            return None
        f = frame[frame["kind"] == "e2e"]
        cols[mode] = f.set_index(["weights", "engine", "sparsity"])["ms_per_token"]
    return pd.DataFrame(cols), prov


def early_sentence(files=None) -> str:
    """One sentence: each step's ms per token without PDL, with PDL launched at exit and
    launched early; empty when a recording is missing.

    >>> s = early_sentence()
    >>> s == "" or "ms" in s
    True
    >>> early_sentence({"no PDL": "no_such_recording"})
    ''
    """
    got = early_table(files)
    if got is None:
        return ""
    table, prov = got
    parts = []
    for (weights, engine, sparsity), row in table.iterrows():
        step = f"{weights} {engine}" + (f" at {sparsity:.0%}" if sparsity else "")
        parts.append(f"{step} " + " / ".join(f"{v:.2f}" for v in row.to_numpy()) + " ms")
    return (f"On the {prov.get('gpu', 'GPU')} (Llama-3-8B shape, code at "
            f"{str(prov.get('git_sha', '?'))[:7]}, one run per mode), per token without "
            "programmatic launch / launched as the kernel before exits / launched early: "
            + "; ".join(parts) + ".")  # fmt: skip
