"""R-Sparse's blocks: TEAL's thresholded product plus a low-rank term for what it drops
(Zhang et al., ICLR 2025, §3–4).

Per site, ``y = W[:, S] x_S + U_r (V_r x_R)``: ``S`` the entries of x above the threshold
(what :func:`~dejavu_lab.kernels.threshold_gemv` reads), ``R`` the rest. :class:`LowRank` is
the second term, added in place to the GEMV's output — or, where the threshold GEMV leaves
fp32 sums for a fused epilogue (:mod:`~dejavu_lab.engine.fused_step`), to those sums — by
:func:`~dejavu_lab.kernels.threshold.lowrank.lowrank_add`: two launches (``V_r`` on the
dropped entries, then ``U_r``), no host synchronisation, so the step stays one CUDA graph. It
counts ``r · (d_in + d_out)`` weights per token (all of ``V_r``, as the quality path does;
the kernel loads only the rows of the dropped entries). A layer without a factor runs TEAL's blocks
(:class:`~dejavu_lab.engine.attention.ThresholdAttention`, :class:`~dejavu_lab.engine.mlp.ThresholdMLP`),
so rank 0 everywhere is TEAL with R-Sparse's thresholds.

The MLP's hidden activations are materialised when a factor reads them (down_in) or must be
added before the activation (mlp_in): those layers skip ``fuse_hidden``'s saving.
"""

from __future__ import annotations

import torch

from ..kernels import rope_sums, threshold_gemv, threshold_sums
from ..kernels.threshold.lowrank import lowrank_add, lowrank_ref
from .attention import ThresholdAttention
from .mlp import ThresholdMLP, act
from .weights import linear_t

__all__ = ["LowRank", "LowRankAttention", "LowRankMLP"]


class LowRank:
    """``U (V x_R)`` for x [B, d_in]: ``x_R`` keeps the entries with ``|x_i| <= thr_i`` (the
    ones the threshold GEMV drops); ``u`` [d_out, r], ``v`` [r, d_in], stored in ``dtype``.

    >>> from dejavu_lab.engine.site_thresholds import Threshold
    >>> u, v = torch.ones(3, 2), torch.ones(2, 4)
    >>> lr = LowRank(u, v, Threshold(0.5, torch.full((4,), 0.5)), torch.float32)
    >>> x = torch.tensor([[1.0, 0.25, -0.5, 2.0]])
    >>> lr(x)  # 0.25 - 0.5 through the rank-2 term
    tensor([[-0.5000, -0.5000, -0.5000]])
    >>> lr.add_to(torch.ones(1, 3), x)  # in place
    tensor([[0.5000, 0.5000, 0.5000]])
    >>> lr.nbytes  # (3 + 4) x 2 fp32 values
    56
    """

    def __init__(self, u: torch.Tensor, v: torch.Tensor, thr, dtype: torch.dtype):
        dev = thr.vector.device
        self.v_t = v.T.to(dev, dtype).contiguous()  # [d_in, r]
        self.u_t = u.T.to(dev, dtype).contiguous()  # [r, d_out]
        self.thr = thr.vector  # fp32 [d_in]: the kernels' fp32 comparison
        self.nbytes = self.v_t.nbytes + self.u_t.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The term alone, [B, d_out] fp32 (the reference)."""
        return lowrank_ref(x, self.thr, self.v_t, self.u_t)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Add the term of x [B, d_in] to ``out`` ([B, d_out], or fp32 sums [d_out] of one
        token) in place; returns ``out``."""
        return lowrank_add(x, self.thr, self.v_t, self.u_t, out)


class LowRankAttention(ThresholdAttention):
    """TEAL's attention block plus the low-rank terms ``lr_in`` (attn_in, added to q/k/v
    before the rotation) and ``lr_o`` (o_in): :class:`LowRank` or None.

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> f = {(0, "o_in"): (torch.randn(64, 4), torch.randn(4, 64))}
    >>> dec = Decoder(m, max_seq_len=8, sparse=SparseConfig(method="rsparse",
    ...               thresholds=keep_all(m), factors=f))
    >>> [type(b).__name__ for b in dec.attn]  # every column kept: the term adds nothing
    ['LowRankAttention', 'ThresholdAttention']
    """

    def __init__(self, lw, kv, st, t_in, t_o, lr_in: LowRank | None, lr_o: LowRank | None):
        super().__init__(lw, kv, st, t_in, t_o)
        self.lr_in, self.lr_o = lr_in, lr_o

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        out = super().qkv(x)  # a fresh tensor: the term is added in place
        return out if self.lr_in is None else self.lr_in.add_to(out, x)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        y = super().out(o)
        return y if self.lr_o is None else self.lr_o.add_to(y, o)

    def qkv_rot(self, x: torch.Tensor) -> torch.Tensor:
        """One token: the term joins the QKV sums before the rotation finishes them."""
        st = self.st
        thr = self.t_in.at(x) if (self.t_in is not None and st.cos is not None) else None
        ws = threshold_sums(x, self.lw.w_qkv_t, thr) if thr is not None else None
        if ws is None:
            return super(ThresholdAttention, self).qkv_rot(x)  # self.qkv: with the term
        if self.lr_in is not None:
            self.lr_in.add_to(ws, x)
        out = torch.empty((1, ws.numel()), dtype=x.dtype, device=x.device)
        return rope_sums(ws, self.lw.b_qkv, out, st.cos, st.sin, st.positions, n_rot=st.H + st.Hkv)

    def o_src(self, o: torch.Tensor) -> tuple:
        ws = threshold_sums(o, self.lw.w_o_t, self.t_o.at(o)) if self.t_o is not None else None
        if ws is None:
            return self.out(o), None, False
        if self.lr_o is not None:
            self.lr_o.add_to(ws, o)
        return ws, self.lw.b_o, True


class LowRankMLP(ThresholdMLP):
    """TEAL's MLP plus the low-rank terms ``lr_in`` (mlp_in, added before the activation) and
    ``lr_down`` (down_in, on the hidden activations): :class:`LowRank` or None.

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> f = {(1, "down_in"): (torch.randn(64, 4), torch.randn(4, 192))}
    >>> dec = Decoder(m, max_seq_len=8, sparse=SparseConfig(method="rsparse",
    ...               thresholds=keep_all(m), factors=f))
    >>> [type(b).__name__ for b in dec.mlp], dec.lowrank_bytes  # (64 + 192) x 4 fp16 values
    (['ThresholdMLP', 'LowRankMLP'], 2048)
    """

    def __init__(self, lw, w, t_in, t_down, lr_in: LowRank | None, lr_down: LowRank | None):
        super().__init__(lw, w, t_in, t_down)
        self.lr_in, self.lr_down = lr_in, lr_down

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.lr_in is None:
            return super().hidden(x)  # the activation in the GEMV's finalize
        lw = self.lw
        a = threshold_gemv(x, lw.w_in_t, self.t_in.at(x), bias=lw.b_in)
        return act(self.lr_in.add_to(a, x), self.activation, self.gated, self.n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.hidden(x))

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        if self.t_down is None:
            return linear_t(h, lw.w_down_t, lw.b_down)
        y = threshold_gemv(h, lw.w_down_t, self.t_down.at(h), bias=lw.b_down)
        return y if self.lr_down is None else self.lr_down.add_to(y, h)

    def src(self, x: torch.Tensor, fuse_hidden: bool) -> tuple:
        """The down GEMV's sums with its term added (the hidden activations materialised)."""
        h = self.hidden(x)
        lw = self.lw
        ws = threshold_sums(h, lw.w_down_t, self.t_down.at(h)) if self.t_down is not None else None
        if ws is None:
            return self._down(h), None, False, None
        if self.lr_down is not None:
            self.lr_down.add_to(ws, h)
        return ws, lw.b_down, True, None
