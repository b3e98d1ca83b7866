"""What an input-threshold method (TEAL, WINA, CATS) needs of a site: the linear layers that
read it, their column norms, and the hooks that zero its entries below a threshold.

A site (:data:`~dejavu_lab.vocab.SITES`) is one input shared by linear layers — q/k/v's
(``attn_in``), o_proj's (``o_in``), gate/up's or fc1's (``mlp_in``), down_proj's or fc2's
(``down_in``); an entry kept selects one column of each of their weights.
:mod:`~dejavu_lab.sparsify.core` builds the context these hooks read and re-exports them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import Arch
from ..vocab import SITES

__all__ = ["column_norms", "site_weights", "threshold_hooks"]


def _apply(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def site_weights(model: nn.Module, arch: Arch, layer: int, site: str) -> list[nn.Linear]:
    """The linear layers whose input is ``site``; its entries select their weight columns.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> [tuple(w.weight.shape) for w in site_weights(m.model, m.arch, 0, "attn_in")]  # q, k, v
    [(64, 64), (32, 64), (32, 64)]
    """
    if site == "attn_in":
        return [arch.part(model, layer, p) for p in ("q", "k", "v")]
    if site == "o_in":
        return [arch.part(model, layer, "o")]
    if site == "mlp_in":
        return arch.mlp_in(model, layer)
    if site == "down_in":
        return [arch.part(model, layer, "mlp_out")]
    raise ValueError(f"site must be one of {', '.join(SITES)}, got {site!r}.")


def column_norms(model: nn.Module, arch: Arch, layer: int, site: str) -> torch.Tensor:
    """‖W[:, i]‖₂ of the site's weights stacked by rows (e.g. [Wq; Wk; Wv]): fp32 [d_in].

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt")
    >>> column_norms(m.model, m.arch, 0, "down_in").shape  # one per MLP neuron
    torch.Size([256])
    """
    sq = sum(
        w.weight.detach().float().pow(2).sum(0) for w in site_weights(model, arch, layer, site)
    )
    return sq.sqrt()


def threshold_hooks(ctx, thresholds: dict) -> list:
    """Hooks zeroing entry ``i`` of a site's input where ``|x[..., i]| <= thr`` (``thr[i]``).

    ``thresholds``: ``{(layer, site): float or fp32 [d_in]}`` (a float for the whole site, a
    tensor per input column; for ``"o_in"`` d_in is ``h * dh``), as
    :meth:`~dejavu_lab.sparsify.thresholds.Thresholds.site_thresholds` gives them. Sites
    missing from the dict run dense.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.core import SparseContext
    >>> m = random_model("tiny-llama")
    >>> ctx = SparseContext(m.model, m.arch, "teal", mlp=[0.0, 0.0], heads=[0.0, 0.0])
    >>> fns = threshold_hooks(ctx, {(1, "mlp_in"): 0.5})
    >>> [name for name, _ in fns]
    ['blocks.1.ln2.hook_normalized']
    """
    fns = []
    for (i, site), thr in sorted(thresholds.items()):
        if i in ctx.dense:
            continue
        fns.append((f"blocks.{i}.{SITES[site]}", _thresholder(ctx, i, site, thr)))
    return fns


def _thresholder(ctx, i, site, thr):
    cache: dict = {}

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        t = cache.get(x.device) if isinstance(thr, torch.Tensor) else float(thr)
        if t is None:
            t = cache[x.device] = thr.to(x.device, torch.float32)
        shape = x.shape
        flat = x.reshape(*shape[:2], -1) if site == "o_in" else x  # heads -> h * dh columns
        keep = flat.abs().float() > t  # torch compares a Python float in fp32, as an fp32 tensor
        if ctx.kept is not None:
            ctx.kept.add(i, site, keep)
        return _apply(flat, keep).reshape(shape)

    return fn
