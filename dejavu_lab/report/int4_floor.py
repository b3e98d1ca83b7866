"""How close the int4 GEMV comes to reading its own bytes: the read floor (the 4-bit chapter).

``kernels/bench_int4.py`` times, beside each dense int4 GEMV, one streaming read of as many
bytes (:mod:`dejavu_lab.bench.read_floor`) and, at batch 1, the kernel alone as the decode step
runs it (``int4_sums``: fp32 sums left for the next launch, no finishing launch).
:func:`floor_sentence` puts the three side by side against the copy ceiling. At each kept
fraction it also reads the kept code rows alone (``read_kept``): :func:`kept_floor_sentence`
sets the threshold kernel beside that read and beside the "ideal" (the dense time times the
kept fraction), which no read of scattered rows reaches, and, where recorded
(``int4_listed``), the same kernel walking kept rows that x's producer listed once
(:mod:`~dejavu_lab.kernels.int4.lists`) instead of each column tile listing its own.
"""

from __future__ import annotations

from .. import results
from ..errors import ResultsError

__all__ = ["FLOOR_FILES", "LISTS_FILES", "floor_sentence", "kept_floor_sentence", "lists_sentence"]

#: the decode step with the norm listing the next product's kept rows off and on
LISTS_FILES = ("engine_int4_8b_lists0", "engine_int4_8b_lists1")
#: the batch-1 recordings that hold the read floor, newest layout first
FLOOR_FILES = ("int4_gemv_g128_b1_listed", "int4_gemv_g128_b1_kernel", "int4_gemv_g128_b1")


def _holding(names, provider: str):
    """(frame, provenance) of each of the recordings ``names`` that exists and holds rows of
    ``provider``, in order."""
    for name in names:
        try:
            frame, prov = results.load(name)
        except ResultsError:
            continue
        if "provider" in frame and (frame["provider"] == provider).any():
            yield frame, prov


def floor_sentence(names=FLOOR_FILES) -> str:
    """Per shape, the read floor of the dense int4 bytes (µs and fraction of the copy ceiling),
    the standalone GEMV and, where recorded, the kernel alone, each as a fraction of that read;
    from the first of ``names`` that holds read-floor rows. Empty when none does.

    >>> s = floor_sentence()
    >>> s == "" or "read" in s
    True
    >>> floor_sentence(("no_such_recording",))
    ''
    """
    for frame, prov in _holding(names, "read"):
        f = frame[(frame["kind"] == "time") & (frame["batch"] == 1) & (frame["kept"] == 1.0)]
        parts = []
        for shape, g in f.groupby("shape", sort=False):
            us = g.groupby("provider")["us"].min()
            if "read" not in us or "int4" not in us:
                continue
            read = g.loc[g["provider"] == "read"].iloc[0]
            text = (f"{shape}: the read {us['read']:.1f} µs ({read['frac_copy']:.2f} of the "
                    f"ceiling), the GEMV {us['int4']:.1f} µs ({us['read'] / us['int4']:.2f} of "
                    "the read)")  # fmt: skip
            if "int4_sums" in us:
                text += (f", its kernel alone {us['int4_sums']:.1f} µs "
                         f"({us['read'] / us['int4_sums']:.2f})")  # fmt: skip
            parts.append(text)
        if not parts:
            continue
        return (f"On the {prov.get('gpu', 'GPU')} (code at {str(prov.get('git_sha', '?'))[:7]}), "
                "one plain streaming read of as many bytes as the dense int4 GEMV moves, "
                "launched and timed the same way, is the most those bytes can reach at this "
                "size (a launch's ramp and tail weigh on 30 MB, where the copy ceiling is "
                "measured on 2 GiB); the kernel alone is the GEMV as the decode step runs it, its "
                "fp32 sums left for the next launch instead of a finishing launch of their own. "
                + "; ".join(parts) + ".")  # fmt: skip
    return ""


def kept_floor_sentence(names=FLOOR_FILES) -> str:
    """Per shape and kept fraction: the read of the kept code rows alone, the threshold kernel
    alone, and the ideal (the dense kernel alone times the kept fraction), from the first of
    ``names`` that holds ``read_kept`` rows. Empty when none does.

    >>> s = kept_floor_sentence()
    >>> s == "" or "kept" in s
    True
    """
    for frame, prov in _holding(names, "read_kept"):
        f = frame[(frame["kind"] == "time") & (frame["batch"] == 1)]
        parts = []
        for shape, g in f.groupby("shape", sort=False):
            dense = g[(g["provider"] == "int4_sums") & (g["kept"] == 1.0)]["us"]
            items = []
            for kept, k in g[g["kept"] < 1].groupby("kept", sort=False):
                us = k.groupby("provider")["us"].min()
                if dense.empty or not {"read_kept", "int4_sums"} <= set(us.index):
                    continue
                ideal = float(dense.iloc[0]) * kept
                items.append(f"{kept:.0%} kept: the read {us['read_kept']:.1f} µs "
                             f"({ideal / us['read_kept']:.2f} of the ideal {ideal:.1f}), the "
                             f"kernel {us['int4_sums']:.1f} µs "
                             f"({us['read_kept'] / us['int4_sums']:.2f} of the read)")  # fmt: skip
                if "int4_listed" in us:  # its kept rows listed beforehand, once per token
                    items[-1] += (f", {us['int4_listed']:.1f} µs walking rows listed beforehand "
                                  f"({us['read_kept'] / us['int4_listed']:.2f})")  # fmt: skip
            if items:
                parts.append(f"{shape}: " + ", ".join(items))
        if parts:
            return ("The ideal of a threshold GEMV is the dense time times the kept fraction; a "
                    "read of only the kept code rows, launched and timed like the kernel, is the "
                    "floor its bytes allow, and where that read reaches less than 1 of the ideal, "
                    "the launch's ramp and tail and the first loads' latency, which stay whatever "
                    f"is dropped, weigh more than the bytes. On the {prov.get('gpu', 'GPU')} "
                    f"(code at {str(prov.get('git_sha', '?'))[:7]}): " + "; ".join(parts) + ".")  # fmt: skip
    return ""


def lists_sentence(files=LISTS_FILES) -> str:
    """One sentence: each thresholded int4 step's ms per token with each product listing its own
    kept rows, and with the norm before it listing them once per token
    (:mod:`~dejavu_lab.kernels.int4.lists`), from two runs on one machine; empty when either
    recording is missing.

    >>> s = lists_sentence()
    >>> s == "" or "ms" in s
    True
    >>> lists_sentence(("no_such_recording", "engine_int4_8b_lists1"))
    ''
    """
    steps = []
    for name in files:
        try:
            frame, prov = results.load(name)
        except ResultsError:
            return ""
        f = frame[(frame["kind"] == "e2e") & (frame["sparsity"] > 0)]
        f = f[f["weights"].str.startswith("int4")]  # the lists are the int4 products' only
        steps.append(f.set_index(["weights", "engine", "sparsity"])["ms_per_token"])
    own, listed = steps
    parts = []
    for (weights, engine, sparsity), ms in own.items():
        if (weights, engine, sparsity) in listed.index:
            new = float(listed[(weights, engine, sparsity)])
            parts.append(f"{weights} {engine} at {sparsity:.0%} {ms:.2f} → {new:.2f} ms "
                         f"({'faster' if new < ms else 'slower'})")  # fmt: skip
    if not parts:
        return ""
    return (
        f"On the {prov.get('gpu', 'GPU')} (Llama-3-8B shape, code at "
        f"{str(prov.get('git_sha', '?'))[:7]}, one run each), per token with each product "
        "listing its own rows → with the norm listing them: " + "; ".join(parts) + "."
    )
