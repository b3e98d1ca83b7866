"""What contextual sparsity costs in quality (Deja Vu §3.1, Fig. 3; §5.2).

The paper's point: dropping the units a *given token* does not need (oracle contextual sparsity)
keeps quality far longer than dropping the same units for every token (static sparsity, chosen
by average magnitude). OPT-175B keeps its perplexity with 85% of MLP neurons or 50% of heads
removed per token (§5.2). :func:`perplexity_sweep` measures both curves with
:mod:`dejavu_lab.sparsify` (plus random head dropping as a control), and
:func:`sparsity_at_rise` reads off the sparsity at which perplexity rises by 1% and 10%.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..arch import Arch, get_arch
from ..corpus import perplexity
from ..sparsify import sparse_perplexity, static_sets
from .heads import random_head_perplexity

__all__ = ["SWEEP_MODES", "perplexity_sweep", "sparsity_at_rise"]

SWEEP_MODES = ("oracle", "static", "random")  # random: heads only, the control


def perplexity_sweep(
    model,
    windows: torch.Tensor,
    *,
    mlp: Sequence[float] = (),
    heads: Sequence[float] = (),
    both: Sequence[float] = (),
    modes: Sequence[str] = ("oracle", "static"),
    calib: torch.Tensor | None = None,
    dense_layers: Sequence[int] = (),
    seeds: Sequence[int] = (0,),
    arch: Arch | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Perplexity on ``windows`` [n, window] at each sparsity (fraction removed), per mode.

    ``mlp`` / ``heads`` sweep one block with the other dense; ``both`` applies the same level to
    both. ``calib`` [m, window]: the text static sets are chosen on (default: ``windows``;
    pass other windows for an honest baseline). ``random`` drops random heads (``heads`` only),
    averaged over ``seeds``. Returns ``target``, ``mode``, ``sparsity``, ``mlp_sparsity``,
    ``head_sparsity``, ``ppl``, ``dense_ppl``, ``rise`` (ppl / dense − 1).

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    >>> sweep = perplexity_sweep(model, ids, mlp=[0.8])  # oracle keeps far more quality
    >>> sweep[["target", "mode", "sparsity", "rise"]].round(1)
      target    mode  sparsity  rise
    0    mlp  oracle       0.8   0.4
    1    mlp  static       0.8  40.2
    """
    arch = arch or get_arch(model)
    bad = [m for m in modes if m not in SWEEP_MODES]
    if bad:
        raise ValueError(f"modes must be among {', '.join(SWEEP_MODES)}, got {bad!r}.")
    dense = perplexity(model, windows, progress=False)
    static = None
    if "static" in modes:
        src = windows if calib is None else calib
        static = static_sets(model, src, mlp_sparsity=0.0, head_sparsity=0.0, progress=False)
    rows = []
    plan = [("mlp", s, s, 0.0) for s in mlp]
    plan += [("heads", s, 0.0, s) for s in heads]
    plan += [("both", s, s, s) for s in both]
    total = len(plan) * len(modes)
    done = 0
    for target, level, ms, hs in plan:
        for mode in modes:
            done += 1
            if progress:
                print(f"\r{done}/{total} {target} {mode} {level:.2f}", end="", flush=True)
            if mode == "random":
                if target != "heads":
                    continue
                ppl = float(
                    np.mean(
                        [
                            random_head_perplexity(model, windows, hs, seed=s, arch=arch)
                            for s in seeds
                        ]
                    )
                )
            else:
                ppl = sparse_perplexity(
                    model,
                    windows,
                    progress=False,
                    mlp_sparsity=ms,
                    head_sparsity=hs,
                    mode=mode,
                    static=static if mode == "static" else None,  # the other modes take none
                    dense_layers=tuple(dense_layers),
                    arch=arch,
                )
            rows.append(
                {
                    "target": target,
                    "mode": mode,
                    "sparsity": level,
                    "mlp_sparsity": ms,
                    "head_sparsity": hs,
                    "ppl": ppl,
                }
            )
    if progress:
        print()
    df = pd.DataFrame(rows)
    df["dense_ppl"] = dense
    df["rise"] = df["ppl"] / dense - 1
    return df


def sparsity_at_rise(sweep: pd.DataFrame, rises: Sequence[float] = (0.01, 0.10)) -> pd.DataFrame:
    """The sparsity at which perplexity first rises by each of ``rises`` (linear interpolation).

    ``sweep``: the output of :func:`perplexity_sweep`; sparsity 0 counts as rise 0. Where the
    curve never crosses a threshold the answer is the largest sparsity measured and
    ``bracketed`` is False (read it as "at least").

    >>> sweep = pd.DataFrame({"target": "mlp", "mode": "oracle", "sparsity": [0.5, 0.8],
    ...                       "rise": [0.0, 0.2]})
    >>> sparsity_at_rise(sweep)
      target    mode  rise  sparsity  bracketed
    0    mlp  oracle  0.01     0.515       True
    1    mlp  oracle  0.10     0.650       True
    """
    rows = []
    for (target, mode), g in sweep.groupby(["target", "mode"], sort=False):
        g = g.sort_values("sparsity")
        s = np.concatenate([[0.0], g["sparsity"].to_numpy(float)])
        r = np.concatenate([[0.0], g["rise"].to_numpy(float)])
        for rise in rises:
            over = np.flatnonzero(r > rise)
            if over.size == 0:
                at, bracketed = s[-1], False
            else:
                j = over[0]  # r[j-1] <= rise < r[j]; j >= 1 since r[0] = 0 <= rise
                frac = (rise - r[j - 1]) / (r[j] - r[j - 1])
                at, bracketed = s[j - 1] + frac * (s[j] - s[j - 1]), True
            rows.append(
                {
                    "target": target,
                    "mode": mode,
                    "rise": rise,
                    "sparsity": at,
                    "bracketed": bracketed,
                }
            )
    return pd.DataFrame(rows)
