"""Our decoder beside TEAL's own, from a recording of ``kernels/bench_engine.py --peer-teal``.

The recording holds our engine's rows (``kind="e2e"``, dense and TEAL) and TEAL's decoder
timed in the same run (``kind="peer"``: its gpt-fast fork, its sparse GEMV kernels,
``torch.compile(mode="reduce-overhead")``, :mod:`dejavu_lab.bench.peer_teal`). :func:`peer_table`
pairs them by model, prompt and sparsity; :func:`missing_sentence` says how to record one where
none exists, since TEAL's code cannot be shipped with the book.
"""

from __future__ import annotations

import pandas as pd

from .. import results
from ..errors import ResultsError

__all__ = ["COMMAND", "FILE", "load", "missing_sentence", "peer_sentence", "peer_table"]

FILE = "engine_peer_teal"
COMMAND = ("python kernels/bench_engine.py --models llama-3-8b --prompts 512 --baselines '' "
           "--methods dense,dense_columns,teal --sparsity 0.4,0.5 --new-tokens 64 --no-check "
           "--peer-teal <a TEAL checkout> --name engine_peer_teal")  # fmt: skip


def load(name: str = FILE) -> tuple[pd.DataFrame | None, dict]:
    """(rows, provenance) of the recording ``results/<name>.json``, or (None, {}) if none.

    >>> load("no_such_recording")
    (None, {})
    """
    try:
        return results.load(name)
    except ResultsError:
        return None, {}


def peer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """ms per token of ours (dense, TEAL) and of TEAL's decoder at the same model, prompt and
    sparsity, and how many times faster ours is (``TEAL / ours``), for the models TEAL's decoder
    ran; rows with an error are left out, and a point only one side measured shows a gap.
    Dense, ours is the engine's default step — every column through our kernels
    (``dense_columns``) where the recording timed it, else the cuBLAS step — and ``our step``
    says which.

    >>> rows = pd.DataFrame([
    ...     {"kind": "e2e", "engine": "teal", "model": "m", "prompt": 8, "sparsity": 0.5,
    ...      "ms_per_token": 2.0},
    ...     {"kind": "peer", "engine": "teal_peer", "model": "m", "prompt": 8, "sparsity": 0.5,
    ...      "ms_per_token": 3.0}])
    >>> peer_table(rows).to_dict("records")
    [{'model': 'm', 'prompt': 8, 'sparsity': 0.5, 'our step': 'teal', 'ours (ms)': 2.0, "TEAL's decoder (ms)": 3.0, 'TEAL / ours': 1.5}]
    """
    f = frame.copy()
    if "error" in f:
        f = f[f["error"].isna()]
    f["sparsity"] = f["sparsity"].fillna(0.0).astype(float)
    keys = ["model", "prompt", "sparsity"]
    teal = f[f["kind"] == "peer"]
    # the models TEAL's decoder ran (Llama family only): ours elsewhere has nothing beside it
    ours = f[(f["kind"] == "e2e") & f["engine"].isin(["dense", "dense_columns", "teal"])
             & f["model"].isin(teal["model"])]  # fmt: skip
    # one dense step per point: the default (dense_columns) before the cuBLAS one
    ours = ours.assign(_pick=ours["engine"].map({"dense_columns": 0, "dense": 1, "teal": 0}))
    ours = ours.sort_values("_pick").drop_duplicates(keys).rename(columns={"engine": "our step"})
    table = pd.merge(
        ours[keys + ["our step", "ms_per_token"]].rename(columns={"ms_per_token": "ours (ms)"}),
        teal[keys + ["ms_per_token"]].rename(columns={"ms_per_token": "TEAL's decoder (ms)"}),
        on=keys, how="outer",
    )  # fmt: skip
    table["TEAL / ours"] = table["TEAL's decoder (ms)"] / table["ours (ms)"]
    return table.sort_values(keys).reset_index(drop=True)


def missing_sentence() -> str:
    """What to run for the comparison when no recording exists (one paragraph, Markdown).

    >>> "--peer-teal" in missing_sentence()
    True
    """
    return ("TEAL's own decoder has not been timed beside ours in a recording here (its code "
            "is not shipped with the book: the benchmark imports it from a checkout you point "
            f"it to). On a GPU box, `{COMMAND}` records it to `results/{FILE}.json`, and this "
            "section then draws it.")  # fmt: skip


def peer_sentence(table: pd.DataFrame, prov: dict) -> str:
    """What :func:`peer_table` shows, in one sentence: per model, how many times faster ours
    is than TEAL's decoder dense and at each sparsity, on the recording's GPU.

    >>> t = pd.DataFrame({"model": ["m", "m"], "prompt": [8, 8], "sparsity": [0.0, 0.5],
    ...                   "TEAL / ours": [0.98, 1.33]})
    >>> peer_sentence(t, {"gpu": "NVIDIA H100 80GB HBM3"})
    "On the NVIDIA H100 80GB HBM3, at the m shape (prompt 8), TEAL's decoder takes 0.98× our time dense and 1.33× at 50%."
    """
    parts = []
    for (model, prompt), g in table.dropna(subset=["TEAL / ours"]).groupby(["model", "prompt"]):
        g = g.sort_values("sparsity")
        dense = g[g["sparsity"] == 0]
        sparse = g[g["sparsity"] > 0]
        bits = [f"{r:.2f}× our time dense" for r in dense["TEAL / ours"]]
        sparse_bits = [f"{r:.2f}×" for r in sparse["TEAL / ours"]]
        if sparse_bits:
            at = " and ".join(f"{s:.0%}" for s in sparse["sparsity"])
            joined = " / ".join(sparse_bits)
            bits.append(f"{joined} at {at}")
        parts.append(f"at the {model} shape (prompt {prompt}), TEAL's decoder takes "
                     + " and ".join(bits))  # fmt: skip
    if not parts:
        return "The recording holds no point that both decoders measured."
    return f"On the {prov.get('gpu', 'GPU')}, " + "; ".join(parts) + "."
