"""The attention block of one layer in a decode step: every head, thresholded, or DejaVu's kept heads.

Each decoder layer gets one of these at construction (the method decides, once), holding its
layer's weights, its slice of the KV cache and its thresholds; calling it on x [1, d] appends
this token's K/V and gives the block's output [1, d]:

- :class:`DenseAttention` — every head: ``W_QKV`` through cuBLAS (or our gather kernel over
  every block, ``dense_ops`` ``qkv=triton``), RoPE in place, the attention core through
  PyTorch over the masked static cache or through :func:`~dejavu_lab.kernels.sparse_attention_core`
  (``attn=triton``), ``W_O`` through cuBLAS;
- :class:`ThresholdAttention` — the same with TEAL/WINA's thresholds on ``attn_in`` and
  ``o_in`` (:func:`~dejavu_lab.kernels.threshold_gemv` over ``W_QKV^T`` and ``W_O^T``); one
  token finishes its QKV sums inside the rotation (:func:`~dejavu_lab.kernels.rope_sums`);
- :class:`~dejavu_lab.engine.kept_heads.KeptHeads` — DejaVu's kept heads with deferred KV.

What every layer of a step shares (positions, the mask or the lengths, the tables of every
head) lives in one :class:`StepState` the decoder fills once per step.
"""

from __future__ import annotations

import math

import torch

from ..kernels import (
    query_slots,
    rope_,
    rope_sums,
    sparse_attention_core,
    sparse_mlp_up,
    threshold_gemv,
    threshold_sums,
)
from .weights import linear_t

__all__ = ["DenseAttention", "StepState", "ThresholdAttention", "every_head", "rotate"]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-split form; x [..., dh], cos/sin broadcastable to x (prefill, flush).

    >>> rotate(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4), torch.ones(4))  # a quarter turn
    tensor([-3., -4.,  1.,  2.])
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class StepState:
    """The shapes, tables and per-step tensors every attention block of a decoder reads.

    The decoder writes the per-step ones once per step (``_per_step``): ``seqlen`` [B] (tokens
    in each cache with this one), ``positions`` [rows] (the position of each projected row),
    ``mask`` [T] or [B, T] (PyTorch attention), ``slot`` [1] (this token's row of the deferred
    window), ``pos_t`` / ``base_t`` (the decoder's position buffers), ``hwin`` [L, W, d] (the
    window's stored attention inputs).

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama").model, max_seq_len=8)
    >>> st = dec.st  # one per decoder, shared by its layers' blocks
    >>> st.H, st.Hkv, st.dh, dec.attn[1].st is st
    (4, 2, 16, True)
    """

    def __init__(self, arch, device, *, cos, sin, ops: dict, window: int = 0):
        H, Hkv = arch.n_heads, arch.n_kv_heads
        self.H, self.Hkv, self.dh = H, Hkv, arch.d_head
        self.scale = 1.0 / math.sqrt(self.dh)
        self.cos, self.sin, self.ops, self.window = cos, sin, ops, window
        self.kv_all = torch.arange(Hkv, device=device)  # every KV head
        self.qkv_all = torch.arange(H + 2 * Hkv, device=device)  # every W_QKV block
        self.heads_all = torch.arange(H, device=device)
        self.slots_all = query_slots(self.heads_all, H)  # once, not per step (GQA)
        self.seqlen = self.positions = self.mask = self.slot = None
        self.pos_t = self.base_t = self.hwin = None


class DenseAttention:
    """Every head of layer ``lw`` over its cache ``kv`` [2, Hkv, T, dh] (see module doc).

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama").model, max_seq_len=8)
    >>> type(dec.attn[0]).__name__, type(dec.mlp[0]).__name__
    ('DenseAttention', 'DenseMLP')
    """

    def __init__(self, lw, kv: torch.Tensor, st: StepState):
        self.lw, self.kv, self.st = lw, kv, st
        self.triton_qkv = st.ops["qkv"] == "triton"
        self.triton_core = st.ops["attn"] == "triton"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, d] -> [1, d]."""
        return self.out(self.core(self.qkv_rot(x)))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, (H + 2 Hkv) dh]: the dense projection (cuBLAS, or our gather-GEMV, rows layout)."""
        lw, st = self.lw, self.st
        if self.triton_qkv:
            return sparse_mlp_up(x, lw.w_qkv, st.qkv_all, bias=lw.b_qkv, activation="none",
                                 rows_per_index=st.dh, validate=False)  # fmt: skip
        return lw.qkv(x)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, d]: o [B, H dh] times W_O^T."""
        return linear_t(o, self.lw.w_o_t, self.lw.b_o)

    def qkv_rot(self, x: torch.Tensor) -> torch.Tensor:
        """[1, (H + 2 Hkv) dh]: q/k/v of x with queries and keys turned at this position."""
        st = self.st
        qkv = self.qkv(x)
        if st.cos is not None:  # in place
            rope_(qkv, st.cos, st.sin, st.positions, n_rot=st.H + st.Hkv)
        return qkv

    def core(self, qkv: torch.Tensor) -> torch.Tensor:
        """[1, H dh]: this token's K/V appended to the cache, every head attended."""
        st, H, Hkv, dh = self.st, self.st.H, self.st.Hkv, self.st.dh
        if self.triton_core:  # our kernel appends K/V and attends, every head
            return sparse_attention_core(
                qkv, self.kv[0][None], self.kv[1][None], st.seqlen, st.heads_all,
                n_heads=H, kv_heads=None if H == Hkv else st.kv_all, scale=st.scale,
                q_slot=st.slots_all,
            )  # fmt: skip
        qkv = qkv.view(H + 2 * Hkv, dh)
        q, new = qkv[:H], qkv[H:].view(2, Hkv, dh)
        self.kv.index_copy_(2, st.pos_t, new.unsqueeze(2))
        return self.attend(q, st.mask).view(1, H * dh)

    def attend(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per head over the cache; q [H, dh] -> [H, dh] (GQA by grouping)."""
        st = self.st
        k, v = self.kv[0], self.kv[1]  # [Hkv, T, dh]
        qg = q.view(st.Hkv, st.H // st.Hkv, st.dh)
        s = torch.baddbmm(mask.view(1, 1, -1), qg, k.transpose(1, 2), alpha=st.scale)
        return torch.bmm(torch.softmax(s, dim=-1), v).view(st.H, st.dh)

    def o_src(self, o: torch.Tensor) -> tuple:
        """o [1, H dh] times W_O^T as the fused step takes it: (output, bias still to add,
        whether it is fp32 sums)."""
        return self.out(o), None, False

    def src(self, x: torch.Tensor) -> tuple:
        """The block on a normed x [1, d] as the fused step takes it (see :meth:`o_src`)."""
        return self.o_src(self.core(self.qkv_rot(x)))

    def lists_for(self) -> tuple | None:
        """``(thr, kept)``: the kept lists (:class:`~dejavu_lab.kernels.int4.lists.KeptLists`)
        this block's next input should come with, listed by the norm that makes it, or None
        (the int4 threshold blocks, :class:`~dejavu_lab.engine.int4.Int4Attention`, want them)."""
        return None


class ThresholdAttention(DenseAttention):
    """Every head, with ``t_in`` on the attention input (attn_in) and ``t_o`` on the input of
    ``W_O`` (o_in): :class:`~dejavu_lab.engine.site_thresholds.Threshold` s or None (dense).

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m, ids = random_model("tiny-llama", dtype=torch.float16).model, torch.tensor([[1, 2, 3]])
    >>> dec = Decoder(m, max_seq_len=8, sparse=SparseConfig(method="teal", thresholds=keep_all(m)))
    >>> type(dec.attn[0]).__name__  # every column kept: the dense decoder's tokens
    'ThresholdAttention'
    >>> dec.generate(ids, 4).tolist() == Decoder(m, max_seq_len=8).generate(ids, 4).tolist()
    True
    """

    def __init__(self, lw, kv: torch.Tensor, st: StepState, t_in, t_o):
        super().__init__(lw, kv, st)
        self.t_in, self.t_o = t_in, t_o

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """Thresholded columns of W_QKV^T, or the dense projection."""
        if self.t_in is not None:
            return threshold_gemv(x, self.lw.w_qkv_t, self.t_in.at(x), bias=self.lw.b_qkv)
        return super().qkv(x)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        if self.t_o is not None:
            return threshold_gemv(o, self.lw.w_o_t, self.t_o.at(o), bias=self.lw.b_o)
        return super().out(o)

    def qkv_rot(self, x: torch.Tensor) -> torch.Tensor:
        """One thresholded token finishes its sums inside the rotation (:func:`rope_sums`)."""
        st = self.st
        thr = self.t_in.at(x) if (self.t_in is not None and st.cos is not None) else None
        ws = threshold_sums(x, self.lw.w_qkv_t, thr) if thr is not None else None
        if ws is not None:
            out = torch.empty((1, ws.numel()), dtype=x.dtype, device=x.device)
            return rope_sums(
                ws, self.lw.b_qkv, out, st.cos, st.sin, st.positions, n_rot=st.H + st.Hkv
            )
        return super().qkv_rot(x)

    def o_src(self, o: torch.Tensor) -> tuple:
        ws = threshold_sums(o, self.lw.w_o_t, self.t_o.at(o)) if self.t_o is not None else None
        if ws is not None:
            return ws, self.lw.b_o, True
        return self.out(o), None, False


def every_head(lw, kv: torch.Tensor, st: StepState, thresholds: dict) -> DenseAttention:
    """The block over every head of layer ``lw``: thresholded where ``thresholds`` (the layer's
    ``{site: Threshold or None}``) has attn_in or o_in, else dense.

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> teal = SparseConfig(method="teal", thresholds={(0, "o_in"): 0.1})
    >>> dec = Decoder(m, max_seq_len=8, sparse=teal)
    >>> [type(every_head(dec.w.layers[i], dec.kv[i], dec.st, dec.site_thresholds[i])).__name__
    ...  for i in (0, 1)]  # layer 1 has no threshold
    ['ThresholdAttention', 'DenseAttention']
    """
    t_in, t_o = thresholds["attn_in"], thresholds["o_in"]
    if t_in is None and t_o is None:
        return DenseAttention(lw, kv, st)
    return ThresholdAttention(lw, kv, st, t_in, t_o)
