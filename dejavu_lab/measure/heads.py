"""Attention as mean-shift clustering (Deja Vu §3.2): which heads matter, and why.

§3.2: one attention head maps a query y to m(y) = Σ_j K(x_j, y) x_j / Σ_j K(x_j, y) with
K(x_j, y) = exp(y W_Q W_Kᵀ x_j) — one step of kernel mean-shift, pulling tokens towards local
modes. Heads then come in two kinds: *uniform-mixing* heads (attention spread evenly; small
output norm) and *heavy-hitter* heads (attention on a few tokens; large output norm), so pruning
by output norm removes the uniform ones. Modern models add a third kind the paper does not
name: *sink* heads that park most of their attention on the first token and write little.

- :func:`head_stats` — per head and token: attention entropy (normalised by log of the number of
  keys, 1 = uniform), mass on the first token, largest attention weight, output norm.
- :func:`classify_heads` — per head means and a kind: sink / uniform-mixing / heavy-hitter.
- :func:`mean_shift_step` and :func:`token_trajectories` — the mean-shift picture on real
  tokens, in a 2-D principal-component projection.
- :func:`random_head_perplexity` — perplexity with a random set of heads dropped per token, the
  control for pruning by output norm (:mod:`dejavu_lab.sparsify`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..arch import Arch, get_arch
from ..budgets import n_keep
from ..corpus import perplexity
from ..hooks import hooks, run_with_cache
from ._run import check_fraction, stream, token_frame

__all__ = [
    "classify_heads",
    "head_stats",
    "mean_shift_step",
    "random_head_perplexity",
    "token_trajectories",
]


def head_stats(
    model,
    windows: torch.Tensor,
    *,
    min_keys: int = 16,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> pd.DataFrame:
    """Attention entropy, sink mass, peak weight and output norm per (layer, head, token).

    ``windows``: LongTensor [n, window]; the model must run eager attention (``load_model``
    does). Queries with fewer than ``min_keys`` visible keys are skipped (their entropy says
    little). Columns: ``layer``, ``head``, ``window``, ``pos``, ``entropy`` (H / log #keys),
    ``sink`` (weight on the window's first token), ``peak`` (largest weight), ``norm``
    (‖W_O^h z^h‖) and ``rel_norm`` (norm / mean head norm of that layer and token).

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> stats = head_stats(model, torch.randint(0, 128, (1, 20)))  # queries 15..19 see 16+ keys
    >>> len(stats)  # 2 layers x 4 heads x 5 queries
    40
    >>> stats.columns.tolist()
    ['layer', 'head', 'window', 'pos', 'entropy', 'sink', 'peak', 'norm', 'rel_norm']
    """
    arch = arch or get_arch(model)
    chunks: list[dict[str, np.ndarray]] = []

    def make_hooks(cursor):
        pending: dict[int, dict[str, torch.Tensor]] = {}  # layer -> stats seen so far

        def emit(i: int) -> None:
            stats = pending.pop(i)
            norm = stats.pop("norm")  # [b, p, h]
            stats["rel_norm"] = norm / norm.mean(-1, keepdim=True).clamp_min(1e-30)
            stats["norm"] = norm
            b, n_pos, h = norm.shape
            sel = slice(min_keys - 1, None)  # query q sees q + 1 keys
            w, p = cursor.window_ids(n_pos)
            w, p = w.reshape(b, n_pos)[:, sel], p.reshape(b, n_pos)[:, sel]
            n = w.size * h
            cols = {
                "layer": np.full(n, i, dtype=np.int16),
                "head": np.tile(np.arange(h, dtype=np.int16), w.size),
                "window": np.repeat(w.flatten(), h),
                "pos": np.repeat(p.flatten(), h),
            }
            for key in ("entropy", "sink", "peak", "norm", "rel_norm"):
                cols[key] = stats[key][:, sel].flatten().cpu().numpy().astype(np.float32)
            chunks.append(cols)

        def on_pattern(t: torch.Tensor, name: str) -> None:  # t: [b, h, q, k]
            i = int(name.split(".")[1])
            q = torch.arange(t.shape[2], device=t.device)
            p = t.float()
            ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [b, h, q]
            ent = ent / (q + 1).clamp(min=2).log()  # uniform over the q+1 visible keys -> 1
            got = pending.setdefault(i, {})
            got["entropy"] = ent.transpose(1, 2)  # [b, q, h]
            got["sink"] = p[..., 0].transpose(1, 2)
            got["peak"] = p.amax(-1).transpose(1, 2)
            if "norm" in got:
                emit(i)

        def on_result(t: torch.Tensor, name: str) -> None:  # t: [b, p, h, d]
            i = int(name.split(".")[1])
            got = pending.setdefault(i, {})
            got["norm"] = t.float().norm(dim=-1)
            if "entropy" in got:
                emit(i)

        return {"blocks.*.attn.hook_pattern": on_pattern, "blocks.*.attn.hook_result": on_result}

    if windows.shape[1] < min_keys:
        raise ValueError(f"windows of {windows.shape[1]} tokens are shorter than min_keys.")
    stream(model, windows, make_hooks, arch=arch, batch_size=batch_size, progress=progress)
    return token_frame(chunks)


def classify_heads(
    stats: pd.DataFrame, *, sink_threshold: float = 0.5, uniform_threshold: float = 0.5
) -> pd.DataFrame:
    """Per-head means of :func:`head_stats` and a kind for each head.

    ``sink`` when the mean weight on the first token is at least ``sink_threshold``; otherwise
    ``uniform-mixing`` when the mean normalised entropy is at least ``uniform_threshold``
    (attention spread over at least ~√n of n tokens), else ``heavy-hitter``. Both thresholds
    are ours (the paper gives none); the chapter shows the distributions they cut.

    >>> stats = pd.DataFrame({"layer": 0, "head": [0, 1, 2], "entropy": [0.2, 0.9, 0.3],
    ...                       "sink": [0.8, 0.1, 0.1], "peak": [0.8, 0.2, 0.7],
    ...                       "norm": [0.1, 0.5, 2.0], "rel_norm": [0.1, 0.6, 2.3]})
    >>> classify_heads(stats)[["head", "kind"]]
       head            kind
    0     0            sink
    1     1  uniform-mixing
    2     2    heavy-hitter
    """
    per = stats.groupby(["layer", "head"], as_index=False)[
        ["entropy", "sink", "peak", "norm", "rel_norm"]
    ].mean()
    per["kind"] = np.where(
        per["sink"] >= sink_threshold,
        "sink",
        np.where(per["entropy"] >= uniform_threshold, "uniform-mixing", "heavy-hitter"),
    )
    return per


def _pca2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and the top-2 principal directions [d, 2] of rows ``x`` [n, d]."""
    mu = x.mean(0)
    _, _, v = torch.pca_lowrank(x - mu, q=2, center=False, niter=6)
    return mu, v[:, :2]


@torch.no_grad()
def mean_shift_step(
    model,
    ids: torch.Tensor,
    layer: int,
    head: int,
    *,
    query: int | None = None,
    tokenizer=None,
    arch: Arch | None = None,
) -> pd.DataFrame:
    """One head as a mean-shift step on real tokens (§3.2), in a 2-D PCA projection.

    ``ids``: LongTensor [1, p]. x_j is what the attention sees (its norm's output for pre-LN
    models) and m(y_q) = Σ_j A[q, j] x_j the head's kernel-weighted mean, A its attention
    pattern. Returns one row per position with ``pos``, ``token``, ``pc1``, ``pc2`` (x_j),
    ``mean_pc1``, ``mean_pc2`` (m(x_j) as a query), ``entropy`` and ``weight`` (attention from
    ``query``, default the last position, to this token; NaN after ``query``).

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> step = mean_shift_step(model, torch.randint(0, 128, (1, 8)), layer=0, head=1)
    >>> step.columns.tolist()
    ['pos', 'token', 'pc1', 'pc2', 'mean_pc1', 'mean_pc2', 'entropy', 'weight']
    >>> round(float(step.weight.sum()), 4)  # the last token's attention sums to 1
    1.0
    """
    arch = arch or get_arch(model)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be one sequence [1, p], got shape {tuple(ids.shape)}.")
    pre, pat = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_pattern"
    _, cache = run_with_cache(model, ids, names=[pre, pat], arch=arch)
    x = cache[pre][0].float()  # [p, d]
    if arch.pre_ln:
        x = arch.part(model, layer, "ln_attn")(cache[pre]).float()[0]
    a = cache[pat][0, head].float()  # [q, k]
    m = a @ x  # [p, d]: kernel-weighted means
    mu, v = _pca2(x)
    xy, mxy = (x - mu) @ v, (m - mu) @ v
    n = x.shape[0]
    q = n - 1 if query is None else query
    weight = np.full(n, np.nan, dtype=np.float32)
    weight[: q + 1] = a[q, : q + 1].cpu().numpy()
    ent = -(a * a.clamp_min(1e-30).log()).sum(-1) / torch.arange(1, n + 1).clamp(min=2).log()
    tokens = [tokenizer.decode([t]) for t in ids[0].tolist()] if tokenizer is not None else [""] * n
    return pd.DataFrame(
        {
            "pos": np.arange(n),
            "token": tokens,
            "pc1": xy[:, 0].cpu().numpy(),
            "pc2": xy[:, 1].cpu().numpy(),
            "mean_pc1": mxy[:, 0].cpu().numpy(),
            "mean_pc2": mxy[:, 1].cpu().numpy(),
            "entropy": ent.cpu().numpy(),
            "weight": weight,
        }
    )


@torch.no_grad()
def token_trajectories(
    model,
    ids: torch.Tensor,
    layers: list[int],
    *,
    tokenizer=None,
    arch: Arch | None = None,
) -> pd.DataFrame:
    """Unit-normalised residual states X_l of each token at ``layers`` in one 2-D projection.

    ``ids``: LongTensor [1, p]; layer index L means the last block's output. The projection is
    the top-2 principal components of all the chosen states together, so arrows from one layer
    to the next show where tokens move. Also returns ``spread``: the mean distance of a token's
    state to the centroid of its layer (mean-shift pulls tokens together when it shrinks).
    Columns: ``pos``, ``token``, ``layer``, ``pc1``, ``pc2``, ``spread``.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")  # 2 layers: layer 2 is the output
    >>> traj = token_trajectories(model, torch.randint(0, 128, (1, 8)), layers=[0, 1, 2])
    >>> traj.shape, traj.layer.unique().tolist()
    ((24, 6), [0, 1, 2])
    """
    arch = arch or get_arch(model)
    names = {
        layer: (
            f"blocks.{layer}.hook_resid_pre"
            if layer < arch.n_layers
            else f"blocks.{arch.n_layers - 1}.hook_resid_post"
        )
        for layer in layers
    }
    _, cache = run_with_cache(model, ids, names=list(names.values()), arch=arch)
    states = [torch.nn.functional.normalize(cache[names[i]][0].float(), dim=-1) for i in layers]
    mu, v = _pca2(torch.cat(states))
    n = ids.shape[1]
    tokens = [tokenizer.decode([t]) for t in ids[0].tolist()] if tokenizer is not None else [""] * n
    frames = []
    for layer, s in zip(layers, states, strict=True):
        xy = (s - mu) @ v
        spread = (s - s.mean(0)).norm(dim=-1)
        frames.append(
            pd.DataFrame(
                {
                    "pos": np.arange(n),
                    "token": tokens,
                    "layer": layer,
                    "pc1": xy[:, 0].cpu().numpy(),
                    "pc2": xy[:, 1].cpu().numpy(),
                    "spread": spread.cpu().numpy(),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def random_head_perplexity(
    model,
    windows: torch.Tensor,
    head_sparsity: float,
    *,
    seed: int = 0,
    arch: Arch | None = None,
) -> float:
    """Perplexity with a random ``head_sparsity`` share of heads per token and layer dropped.

    The control for pruning by output norm: same budget, no information. Dropping a head
    zeroes its z (``attn.hook_z``) so it writes nothing through W_O (a bias, if any, stays).

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> random_head_perplexity(model, ids, 0.0) == perplexity(model, ids, progress=False)
    True
    >>> round(random_head_perplexity(model, ids, 0.5))  # random weights: about the vocabulary
    128
    """
    arch = arch or get_arch(model)
    check_fraction("head_sparsity", head_sparsity)
    n_drop = arch.n_heads - n_keep(head_sparsity, arch.n_heads)  # as sparsify rounds it
    gen = torch.Generator().manual_seed(seed)

    def drop(z: torch.Tensor, name: str) -> torch.Tensor:  # z: [b, p, h, dh]
        scores = torch.rand(z.shape[:-1], generator=gen).to(z.device)
        dropped = scores.argsort(-1)[..., :n_drop]
        keep = torch.ones(z.shape[:-1], dtype=z.dtype, device=z.device)
        keep.scatter_(-1, dropped, 0.0)
        return z * keep.unsqueeze(-1)

    if n_drop == 0:
        return perplexity(model, windows, progress=False)
    with hooks(model, {"blocks.*.attn.hook_z": drop}, arch):
        return perplexity(model, windows, progress=False)
