"""Which neurons and heads the sparse decoder keeps, per layer (Deja Vu §4.1–4.3).

A part of a DejaVu :class:`dejavu_lab.engine.Decoder` (its ``sets``): static index buffers (one
row per layer, fixed sizes, so a CUDA graph can replay them) that its blocks read, filled either
by hand (:meth:`KeptSets.set_indices`: oracle or random sets) or, inside the decode step, by the
top-k of DejaVu's low-rank predictors (:mod:`dejavu_lab.predictors`) evaluated on the previous
layer's input (lookahead). The two
predictors of a layer read the same input, so they are evaluated stacked: both ``d -> r`` halves
(the RMS norm folded in) in one launch, both ``r -> n`` in another
(:func:`~dejavu_lab.kernels.predict.predictor_scores`) — the same function as
``Predictors.mlp_scores`` / ``head_scores``, in fewer launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..budgets import n_keep
from ..kernels.predict import predictor_scores
from ..kernels.select import topk_select
from .config import EngineError, SparseConfig

__all__ = ["KeptSets", "topk_into"]


def topk_into(s: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor,
              kernel: bool = False) -> None:  # fmt: skip
    """The top-``k`` of each row of the scores ``s`` ([n] or [rows, n]) written into ``values``
    (fp32) / ``indices``: by ``torch.topk`` (unsorted), or with ``kernel`` by
    :func:`~dejavu_lab.kernels.select.topk_select` (one launch, the entries in index order;
    ``kernels/bench_topk.py`` times both) — the same sets up to ties at the k-th value.

    >>> s = torch.randn(20480)
    >>> v, i = torch.empty(3072), torch.empty(3072, dtype=torch.long)
    >>> topk_into(s, 3072, v, i, kernel=True)
    >>> set(i.tolist()) == set(torch.topk(s, 3072).indices.tolist()), torch.equal(s[i], v)
    (True, True)
    """
    if kernel:
        topk_select(s, k, values, indices)
    else:
        torch.topk(s, k, dim=-1, sorted=False, out=(values, indices))


class KeptSets:
    """The kept neurons and heads of every layer of a model of shape ``arch`` (``window``: the
    deferred-KV window; ``predictors``: DejaVu's, or None for sets given by hand).

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 4 heads, 256 neurons
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> dec.set_indices(0, mlp=range(64, 128), heads=[1, 3])  # an oracle's or a random choice
    >>> dec.sets.head_idx[0].tolist(), dec.sets.qkv_idx[0].tolist()  # q heads, then K, V blocks
    ([1, 3], [1, 3, 5, 7, 9, 11])
    """

    def __init__(self, arch, sp: SparseConfig, device, *, window: int, predictors=None):
        a, dev = arch, device
        self.arch, self.device, self.window, self.predictors = arch, device, window, predictors
        self.H, self.Hkv = a.n_heads, a.n_kv_heads
        self.k_mlp = n_keep(sp.mlp_sparsity, a.d_mlp) if sp.mlp_sparsity > 0 else a.d_mlp
        self.k_heads = n_keep(sp.head_sparsity, self.H) if sp.head_sparsity > 0 else self.H
        self.n_kv_sel = self.k_heads if self.window else self.Hkv
        L = a.n_layers
        self.mlp_idx = torch.arange(self.k_mlp, device=dev).repeat(L, 1)  # [L, k_mlp]
        self.head_idx = torch.arange(self.k_heads, device=dev).repeat(L, 1)  # [L, k_heads]
        self.qkv_idx = torch.zeros(
            L, self.k_heads + 2 * self.n_kv_sel, dtype=torch.long, device=dev
        )
        self._mlp_val = torch.zeros(L, self.k_mlp, device=dev)
        self._head_val = torch.zeros(L, self.k_heads, device=dev)
        self._kv_off = torch.tensor([[self.H], [self.H + self.Hkv]], device=dev)  # K, V blocks
        self._kv_all = torch.arange(self.Hkv, device=dev)
        for i in range(L):
            self._fill_qkv(i)
        self._fused = None
        # topk_into by torch.topk; True: our one-launch select (kernels/bench_topk.py). On an
        # H100 the select runs 46 µs a call at OPT-13B's 20,480 neurons against torch's 42 (a
        # dozen launches), and the step with it 5.31 ms against 5.04; at Llama-3-8B's 14,336
        # it wins alone (31 against 38 µs) but the steps tie (results/engine_dejavu_select.json)
        self.topk_kernel = False
        self.score_kernel = True  # scores(): kernels/predict.py (False: PyTorch's ops)
        # the batch-1 down projections' kernel while predictors share the GPU from a side
        # stream: the split kernel's few programs per SM leave room for them (an H100, OPT-13B:
        # 5.06 ms a token against 5.36 with the one-tile kernel, which was the faster alone:
        # 4.08 against 4.19 ms with fixed sets; results/engine_dejavu_down_*.json); None: the
        # kernel's own choice. A Decoder's first capture times both (Decoder._kernel_choices)
        side = predictors is not None and sp.side_stream
        self.down_mode: str | None = "split" if side else None
        if self.predictors is not None:
            self._fuse_predictors()

    @property
    def down_config(self) -> dict | None:
        """The ``config`` of the down projections' :func:`~dejavu_lab.kernels.sparse_mlp_down`."""
        return None if self.down_mode is None else {"mode": self.down_mode}

    def _fill_qkv(self, i: int) -> None:
        """Row blocks of W_QKV for layer i: kept q heads, then their (or all) K and V heads."""
        h, k = self.head_idx[i], self.k_heads
        self.qkv_idx[i, :k].copy_(h)
        kv = self.qkv_idx[i, k:].view(2, self.n_kv_sel)
        torch.add((h if self.window else self._kv_all)[None], self._kv_off, out=kv)

    def set_indices(self, layer: int, *, mlp=None, heads=None) -> None:
        """Fix the kept neurons / heads of ``layer`` (used when no predictors are given)."""
        for name, idx, buf, n in (("mlp", mlp, self.mlp_idx, self.arch.d_mlp),
                                  ("heads", heads, self.head_idx, self.H)):  # fmt: skip
            if idx is None:
                continue
            idx = torch.as_tensor(idx, device=buf.device).long().flatten()
            if idx.numel() != buf.shape[1] or idx.unique().numel() != idx.numel():
                raise EngineError(
                    f"{name} needs {buf.shape[1]} distinct indices, got {idx.numel()}."
                )
            if int(idx.min()) < 0 or int(idx.max()) >= n:
                raise EngineError(f"{name} indices must lie in [0, {n - 1}].")
            buf[layer].copy_(idx)
        self._fill_qkv(layer)

    def _fuse_predictors(self) -> None:
        """Stack DejaVu's two low-rank predictors of each layer (same input in lookahead mode):
        one RMS norm and one GEMV for both ``d -> r`` halves, then each ``r -> n`` (fp32)."""
        p, self._fused = self.predictors, None
        try:
            mlp, heads = list(p.mlp), list(p.heads)
            downs = [
                torch.cat((m.down.weight, h.down.weight)).float()
                for m, h in zip(mlp, heads, strict=True)
            ]
        except (AttributeError, TypeError):
            return  # any other object: call its mlp_scores / head_scores
        dev = self.device
        self._fused = [
            (d.to(dev), m.down.weight.shape[0], m.up.weight.float().to(dev),
             m.up.bias.float().to(dev), h.up.weight.float().to(dev), h.up.bias.float().to(dev))
            for d, m, h in zip(downs, mlp, heads, strict=True)
        ]  # fmt: skip

    def scores(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp scores [1, n], head scores [1, H]) of layer i's predictors at x [1, d]."""
        if self._fused is None:
            p = self.predictors
            return p.mlp_scores(i, x), p.head_scores(i, x)
        down, r, wm, bm, wh, bh = self._fused[i]
        if self.score_kernel:  # two launches (kernels/predict.py)
            return predictor_scores(x, down, wm, bm, wh, bh)
        z = F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6) @ down.t()  # [1, r_mlp + r_head]
        return F.linear(z[:, :r], wm, bm), F.linear(z[:, r:], wh, bh)

    def predict(self, i: int, x: torch.Tensor) -> None:
        """Kept sets of layer i from x (layer i-1's input: lookahead) by top-k of the scores."""
        ms, hs = self.scores(i, x)
        if self.k_mlp < self.arch.d_mlp:
            s = ms.reshape(-1)
            topk_into(s.float(), self.k_mlp, self._mlp_val[i], self.mlp_idx[i], self.topk_kernel)
        if self.k_heads < self.H:
            s = hs.reshape(-1)
            topk_into(s.float(), self.k_heads, self._head_val[i], self.head_idx[i],
                      self.topk_kernel)  # fmt: skip
            self._fill_qkv(i)
