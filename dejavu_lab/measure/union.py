"""Union contextual sparsity across a batch (Deja Vu Appendix C.1).

A batched sparse kernel must load the union of the active sets of every sequence in the batch,
so what a batch of B buys is::

    union contextual sparsity = 1 − |∪_b S^(b)| / total

The paper reports that on OPT-175B the union grows sub-linearly with B (B = 2…32): sequences
share their active neurons and heads, because how often a unit fires follows a heavy-tailed
(power-law) distribution rather than a uniform one. Here:

- :func:`token_scores` — neuron magnitudes and head-output norms of sampled tokens of many
  windows (one window = one sequence), from one forward pass; ``.active(criterion)`` turns
  them into :class:`ActiveSets` under any criterion of :mod:`.sparsity`
  (:func:`active_sets` does both).
- :func:`union_sparsity` — for each batch size, random batches of tokens from B *different*
  windows, their union sparsity per layer, and what B independent uniform draws of the same
  size would give, (1 − p)^B for a per-token density p.
- :func:`fit_union_growth` — the power law ``|∪S| ∝ B^α`` per layer (α < 1: sub-linear).
- :func:`activation_frequency` — how often each unit is active, ranked (the heavy tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..arch import Arch, get_arch
from ._run import stream
from .sparsity import active_mask, criterion_label, default_criterion

__all__ = [
    "ActiveSets",
    "TokenScores",
    "activation_frequency",
    "active_sets",
    "fit_union_growth",
    "token_scores",
    "union_of",
    "union_sparsity",
]


@dataclass
class ActiveSets:
    """Active units of sampled tokens, each token from one window (sequence).

    >>> mlp = torch.tensor([[[True, False, True, False]], [[True, True, False, False]]])
    >>> sets = ActiveSets(mlp=mlp, heads=torch.ones(2, 1, 2, dtype=torch.bool),
    ...                   window=np.array([0, 1]), pos=np.array([5, 7]),
    ...                   criterion={"mlp": "by hand", "heads": "by hand"})
    >>> sets.block("mlp").shape, sets.block("mlp").float().mean().item()
    (torch.Size([2, 1, 4]), 0.5)
    """

    mlp: torch.Tensor  # bool [tokens, layers, d_mlp]: active MLP neurons
    heads: torch.Tensor  # bool [tokens, layers, n_heads]: active heads
    window: np.ndarray  # int [tokens]: the window each token comes from
    pos: np.ndarray  # int [tokens]: its position in that window
    criterion: dict[str, str]  # block -> how "active" was decided, in words

    def block(self, name: str) -> torch.Tensor:
        if name not in ("mlp", "heads"):
            raise ValueError(f"block must be 'mlp' or 'heads', got {name!r}.")
        return self.mlp if name == "mlp" else self.heads


@dataclass
class TokenScores:
    """Absolute activation of every MLP neuron and output norm of every head, for sampled tokens.

    Kept so that one forward pass serves any definition of "active" (:meth:`active`): the
    sampled tokens are few (a few per sequence), so this is small (tokens × layers × d_mlp).

    >>> scores = TokenScores(mlp=torch.tensor([[[0.0, 2.0, 0.5, 0.0]]]),
    ...                      heads=torch.tensor([[[3.0, 1.0]]]), window=np.array([0]),
    ...                      pos=np.array([5]), relu=True)
    >>> scores.active().mlp  # ReLU: active = non-zero
    tensor([[[False,  True,  True, False]]])
    >>> scores.active("topk", keep=0.25).mlp
    tensor([[[False,  True, False, False]]])
    """

    mlp: torch.Tensor  # float [tokens, layers, d_mlp]: |mlp.hook_post|
    heads: torch.Tensor  # float [tokens, layers, n_heads]: ‖z_h W_O^h‖
    window: np.ndarray  # int [tokens]: the window each token comes from
    pos: np.ndarray  # int [tokens]: its position in that window
    relu: bool  # plain ReLU MLP (exact zeros): the "auto" criterion is "zeros"

    def active(
        self,
        criterion: str = "auto",
        *,
        mass: float = 0.9,
        head_mass: float = 0.9,
        keep: float | None = None,
    ) -> ActiveSets:
        """Active sets under a criterion (see :mod:`.sparsity`); heads use ``head_mass``."""
        crit = ("zeros" if self.relu else "mass") if criterion == "auto" else criterion
        return ActiveSets(
            mlp=active_mask(self.mlp, crit, mass=mass, keep=keep),
            heads=active_mask(self.heads, "mass", mass=head_mass),
            window=self.window,
            pos=self.pos,
            criterion={
                "mlp": criterion_label(crit, mass, keep),
                "heads": criterion_label("mass", head_mass) + " (head-output norm)",
            },
        )


def token_scores(
    model,
    windows: torch.Tensor,
    *,
    positions: int = 8,
    min_pos: int = 32,
    seed: int = 0,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> TokenScores:
    """Neuron and head magnitudes of ``positions`` random tokens (at ≥ ``min_pos``) per window.

    ``windows``: LongTensor [n, window]; each window is one sequence of a batch. Tokens late in
    a window have context, as a decoding step does, hence ``min_pos``.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> scores = token_scores(model, torch.randint(0, 128, (8, 16)), positions=2, min_pos=8)
    >>> scores.mlp.shape, scores.heads.shape  # 8 windows x 2 tokens, 2 layers, units
    (torch.Size([16, 2, 256]), torch.Size([16, 2, 4]))
    >>> scores.window[:4].tolist()
    [0, 0, 1, 1]
    """
    arch = arch or get_arch(model)
    n_win, n_pos = windows.shape
    if not 0 <= min_pos < n_pos or positions < 1 or positions > n_pos - min_pos:
        raise ValueError(
            f"Cannot pick {positions} positions at or after {min_pos} in windows of {n_pos} "
            "tokens; lower positions or min_pos, or use longer windows."
        )
    rng = np.random.default_rng(seed)
    picks = np.stack(
        [np.sort(rng.choice(np.arange(min_pos, n_pos), positions, replace=False)) for _ in windows]
    )  # [n_win, positions]: sampled positions of each window
    n_tok = n_win * positions
    mlp = torch.zeros(n_tok, arch.n_layers, arch.d_mlp)
    heads = torch.zeros(n_tok, arch.n_layers, arch.n_heads)
    picks_t = torch.from_numpy(picks)

    def make_hooks(cursor):
        def rows(t: torch.Tensor) -> tuple[slice, torch.Tensor]:
            sel = picks_t[cursor.start : cursor.start + cursor.batch].to(t.device)  # [b, k]
            idx = sel.view(*sel.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:])
            out = t.gather(1, idx).flatten(0, 1)  # [b * k, ...]
            return slice(cursor.start * positions, (cursor.start + cursor.batch) * positions), out

        def on_mlp(t: torch.Tensor, name: str) -> None:  # t: [b, p, n]
            where, a = rows(t)
            mlp[where, int(name.split(".")[1])] = a.float().abs().cpu()

        def on_heads(t: torch.Tensor, name: str) -> None:  # t: [b, p, h, d]
            where, r = rows(t)
            heads[where, int(name.split(".")[1])] = r.float().norm(dim=-1).cpu()

        return {"blocks.*.mlp.hook_post": on_mlp, "blocks.*.attn.hook_result": on_heads}

    stream(model, windows, make_hooks, arch=arch, batch_size=batch_size, progress=progress)
    return TokenScores(
        mlp=mlp,
        heads=heads,
        window=np.repeat(np.arange(n_win), positions),
        pos=picks.flatten(),
        relu=default_criterion(arch) == "zeros",
    )


def active_sets(
    model,
    windows: torch.Tensor,
    *,
    positions: int = 8,
    min_pos: int = 32,
    criterion: str = "auto",
    mass: float = 0.9,
    head_mass: float = 0.9,
    keep: float | None = None,
    seed: int = 0,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> ActiveSets:
    """Active neurons and heads of sampled tokens: :func:`token_scores` then one criterion.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> sets = active_sets(model, torch.randint(0, 128, (8, 16)), positions=2, min_pos=8)
    >>> sets.criterion["mlp"], round(sets.mlp.float().mean().item(), 1)
    ('active = non-zero (ReLU exact zeros)', 0.5)
    """
    scores = token_scores(
        model,
        windows,
        positions=positions,
        min_pos=min_pos,
        seed=seed,
        arch=arch,
        batch_size=batch_size,
        progress=progress,
    )
    return scores.active(criterion, mass=mass, head_mass=head_mass, keep=keep)


def union_of(mask: torch.Tensor, batches: torch.Tensor) -> torch.Tensor:
    """Union sparsity of token batches: ``1 − |∪S| / total``, FloatTensor [draws, layers].

    ``mask``: bool [tokens, layers, units]; ``batches``: LongTensor [draws, B] of token indices.

    >>> mask = torch.tensor([[[True, False, True, False]], [[True, True, False, False]]])
    >>> union_of(mask, torch.tensor([[0, 0], [0, 1]]))  # token 0 alone; tokens 0 and 1
    tensor([[0.5000],
            [0.2500]])
    """
    union = mask[batches].any(dim=1)  # [draws, layers, units]
    return 1 - union.float().mean(-1)


def _draw(window: np.ndarray, batch: int, n_draws: int, rng) -> np.ndarray:
    """[n_draws, batch] token indices, each batch from ``batch`` distinct windows."""
    ids = np.unique(window)
    if batch > ids.size:
        raise ValueError(
            f"A batch of {batch} sequences needs at least {batch} windows; got {ids.size}."
        )
    by_window = [np.flatnonzero(window == w) for w in ids]
    out = np.empty((n_draws, batch), dtype=np.int64)
    for d in range(n_draws):
        for j, w in enumerate(rng.choice(ids.size, batch, replace=False)):
            out[d, j] = rng.choice(by_window[w])
    return out


def union_sparsity(
    sets: ActiveSets,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    *,
    n_draws: int = 64,
    seed: int = 0,
    chunk: int = 16,
) -> pd.DataFrame:
    """Union contextual sparsity per layer for random batches of B different sequences.

    Returns one row per (block, layer, batch_size, draw) with ``union_sparsity`` and
    ``uniform``: the expectation (1 − p)^B if each token instead drew its active units
    uniformly at random, p being the layer's mean per-token density.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> sets = active_sets(model, torch.randint(0, 128, (8, 16)), positions=2, min_pos=8)
    >>> union = union_sparsity(sets, (1, 2, 4), n_draws=8).query("block == 'mlp'")
    >>> union.groupby("batch_size")[["union_sparsity", "uniform"]].mean().round(2)
                union_sparsity  uniform
    batch_size
    1                     0.50     0.50
    2                     0.30     0.25
    4                     0.11     0.06
    """
    rng = np.random.default_rng(seed)
    frames = []
    for block in ("mlp", "heads"):
        mask = sets.block(block)
        density = mask.float().mean(dim=(0, 2)).numpy()  # [layers]
        n_layers = mask.shape[1]
        for b in batch_sizes:
            batches = torch.from_numpy(_draw(sets.window, b, n_draws, rng))
            sp = torch.cat(
                [union_of(mask, batches[s : s + chunk]) for s in range(0, n_draws, chunk)]
            )
            frames.append(
                pd.DataFrame(
                    {
                        "block": block,
                        "layer": np.tile(np.arange(n_layers), n_draws),
                        "batch_size": b,
                        "draw": np.repeat(np.arange(n_draws), n_layers),
                        "union_sparsity": sp.flatten().numpy(),
                        "uniform": np.tile((1 - density) ** b, n_draws),
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)


def fit_union_growth(union: pd.DataFrame) -> pd.DataFrame:
    """Fit ``|∪S| / total = c · B^α`` per (block, layer) by least squares in log-log.

    ``union``: the output of :func:`union_sparsity`. Returns ``block``, ``layer``, ``alpha``,
    ``c``, ``r2`` and the same fit to the uniform expectation (``alpha_uniform``). α < 1 is
    sub-linear growth; an α well below the uniform one means sequences share active units.

    >>> b = np.array([1, 2, 4, 8])
    >>> union = pd.DataFrame({"block": "mlp", "layer": 0, "batch_size": b,
    ...                       "union_sparsity": 1 - 0.1 * b**0.5, "uniform": 0.9**b})
    >>> fit_union_growth(union)[["alpha", "c", "alpha_uniform"]].round(2)
       alpha    c  alpha_uniform
    0    0.5  0.1           0.84
    """
    mean = union.groupby(["block", "layer", "batch_size"], as_index=False)[
        ["union_sparsity", "uniform"]
    ].mean()
    rows = []
    for (block, layer), g in mean.groupby(["block", "layer"]):
        x = np.log(g["batch_size"].to_numpy(float))
        row = {"block": block, "layer": layer}
        for col, suffix in (("union_sparsity", ""), ("uniform", "_uniform")):
            y = np.log(np.clip(1 - g[col].to_numpy(float), 1e-12, None))
            alpha, logc = np.polyfit(x, y, 1)
            resid = y - (alpha * x + logc)
            ss = ((y - y.mean()) ** 2).sum()
            row[f"alpha{suffix}"] = alpha
            row[f"c{suffix}"] = float(np.exp(logc))
            row[f"r2{suffix}"] = 1 - (resid**2).sum() / ss if ss > 0 else 1.0
        rows.append(row)
    return pd.DataFrame(rows)


def activation_frequency(sets: ActiveSets) -> pd.DataFrame:
    """How often each unit is active over the sampled tokens, ranked per layer (1 = most).

    Columns: ``block``, ``layer``, ``unit``, ``frequency``, ``rank``.

    >>> mlp = torch.tensor([[[True, False, True, False]], [[True, True, False, False]]])
    >>> sets = ActiveSets(mlp=mlp, heads=torch.ones(2, 1, 2, dtype=torch.bool),
    ...                   window=np.array([0, 1]), pos=np.array([5, 7]), criterion={})
    >>> activation_frequency(sets).head(4)
      block  layer  unit  frequency  rank
    0   mlp      0     0        1.0     1
    1   mlp      0     1        0.5     2
    2   mlp      0     2        0.5     3
    3   mlp      0     3        0.0     4
    """
    frames = []
    for block in ("mlp", "heads"):
        freq = sets.block(block).float().mean(0)  # [layers, units]
        n_layers, n_units = freq.shape
        rank = freq.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1) + 1
        frames.append(
            pd.DataFrame(
                {
                    "block": block,
                    "layer": np.repeat(np.arange(n_layers), n_units),
                    "unit": np.tile(np.arange(n_units), n_layers),
                    "frequency": freq.flatten().numpy(),
                    "rank": rank.flatten().numpy(),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)
