"""The attention blocks of a batched decode step: each sequence's own heads, deferred KV per sequence.

A :class:`~dejavu_lab.engine.BatchDecoder` builds one per layer, as the batch-1 decoder does,
around that layer's projections (a :class:`~dejavu_lab.engine.attention.DenseAttention` or
:class:`~dejavu_lab.engine.attention.ThresholdAttention`, ``proj``) and its cache slots
``kv`` [2, B_max, Hkv, T, dh]; x [B, d] -> [B, d]:

- :class:`BatchKeptHeads` (DejaVu): ``W_QKV``'s rows of the batch's union of heads, RoPE per
  row at its own position, each sequence attending its own heads of its own cache
  (:func:`~dejavu_lab.kernels.sparse_attention_core` with ``head_mask``), ``W_O``'s union rows;
- :class:`BatchAttention` (dense, TEAL, WINA, CATS): every head of every sequence, through our
  attention kernel or PyTorch with a [B, T] mask of each sequence's own positions;
- deferred KV (§4.2): the step recomputes the union heads' K/V over the window of each
  sequence, ``B x W`` rows in one gather-GEMV (at most 32: ``W = min(kv_window, 32 // B)``, and
  no deferral below 4, nor when the union has room for every head), so a head outside the
  union writes no K/V until the window's flush (:meth:`BatchKeptHeads.flush`: one dense K/V
  pass over every sequence's window) or until it joins the union.

The batch's per-step tensors are the decoder's :class:`~dejavu_lab.engine.attention.StepState`
plus ``B``, ``rows`` (window row of each sequence's token), ``live_heads`` and ``ar_b``.

>>> import torch
>>> from dejavu_lab.engine import BatchDecoder, SparseConfig
>>> from dejavu_lab.models import random_model
>>> m = random_model("tiny-opt", dtype=torch.float16).model  # 4 heads: deferred KV
>>> dec = BatchDecoder(m, max_seq_len=32, sparse=SparseConfig(0.5, 0.75, kv_window=16))
>>> [dec._window_for(b) for b in (1, 2, 4, 8, 16, 32)]  # B x W <= 32 rows, B heads < 4
[16, 16, 0, 0, 0, 0]
>>> type(dec.attn[0]).__name__, type(dec.mlp[0]).__name__
('BatchKeptHeads', 'KeptMLP')
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import kv_window_write, rope_, sparse_attention_core, sparse_mlp_down, sparse_mlp_up

__all__ = ["BatchAttention", "BatchKeptHeads"]


class BatchAttention:
    """Every head of every sequence; ``proj`` gives the layer's (thresholded) projections.

    >>> from dejavu_lab.engine import BatchDecoder
    >>> from dejavu_lab.models import random_model
    >>> dec = BatchDecoder(random_model("tiny-llama").model, max_seq_len=16, max_batch=2)
    >>> type(dec.attn[0]).__name__, type(dec.attn[0].proj).__name__
    ('BatchAttention', 'DenseAttention')
    >>> [o.shape[0] for o in dec.generate([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], 3)]
    [6, 5]
    """

    def __init__(self, proj, kv: torch.Tensor, st):
        self.proj, self.kv, self.st = proj, kv, st
        self.triton_core = st.ops["attn"] == "triton"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        st, H, Hkv, dh, B = self.st, self.st.H, self.st.Hkv, self.st.dh, self.st.B
        qkv = self.proj.qkv(x)  # [B, (H + 2 Hkv) dh]
        if st.cos is not None:
            rope_(qkv, st.cos, st.sin, st.positions, n_rot=H + Hkv)
        kc, vc = self.kv[0, :B], self.kv[1, :B]
        if self.triton_core:  # finished sequences attend nothing
            o = sparse_attention_core(qkv, kc, vc, st.seqlen, st.heads_all, n_heads=H,
                                      kv_heads=None if H == Hkv else st.kv_all,
                                      scale=st.scale, head_mask=st.live_heads,
                                      q_slot=st.slots_all)  # fmt: skip
            return self.proj.out(o)
        blocks = qkv.view(B, H + 2 * Hkv, dh)
        where = (st.ar_b[:, None], st.kv_all[None], st.pos_t[:B, None])
        kc.index_put_(where, blocks[:, H : H + Hkv])
        vc.index_put_(where, blocks[:, H + Hkv :])
        q = blocks[:, :H].reshape(B * Hkv, H // Hkv, dh)
        s = torch.baddbmm(st.mask.repeat_interleave(Hkv, 0)[:, None], q,
                          kc.reshape(B * Hkv, -1, dh).transpose(1, 2), alpha=st.scale)  # fmt: skip
        o = torch.bmm(torch.softmax(s, dim=-1), vc.reshape(B * Hkv, -1, dh))
        return self.proj.out(o.reshape(B, H * dh))


class BatchKeptHeads:
    """Layer ``i``'s union of heads over each sequence's window (``sets``: the decoder's
    :class:`~dejavu_lab.engine.batch_sets.BatchSets`, pointed at the batch size's unions).

    >>> from dejavu_lab.engine import BatchDecoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> dec = BatchDecoder(m, max_seq_len=16, max_batch=2, sparse=SparseConfig(0.5, 0.5))
    >>> type(dec.attn[0]).__name__
    'BatchKeptHeads'
    >>> [o.shape[0] for o in dec.generate([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], 3)]
    [6, 5]
    """

    def __init__(self, proj, kv: torch.Tensor, st, i: int, sets):
        self.proj, self.lw, self.kv, self.st, self.i, self.sets = proj, proj.lw, kv, st, i, sets

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        st, sets, lw, i, dh = self.st, self.sets, self.lw, self.i, self.st.dh
        B, W, heads = sets.B, sets.W, sets.head_idx[i]
        uh = heads.shape[0]
        every = uh == st.H and not W  # the union holds every head: the dense projections
        if W:
            st.hwin[i].index_copy_(0, st.rows, x)
            x = st.hwin[i, : B * W]
        if every:
            qkv = self.proj.qkv(x)
        else:  # [rows, (Uh + 2 n_kv) dh]
            qkv = sparse_mlp_up(x, lw.w_qkv, sets.qkv_idx[i], bias=lw.b_qkv, activation="none",
                                rows_per_index=dh, validate=False)  # fmt: skip
        n_kv = (sets.qkv_idx.shape[1] - uh) // 2
        if st.cos is not None:  # queries and keys, each row at its own position
            rope_(qkv, st.cos, st.sin, st.positions, n_rot=uh + n_kv)
        kc, vc = self.kv[0], self.kv[1]  # [B_max, Hkv, T, dh]
        if W:  # the union heads' K/V over each sequence's window, then this step's rows
            for b in range(B):
                kv_window_write(
                    qkv[b * W : (b + 1) * W], kc[b], vc[b], heads, st.base_t[b : b + 1], n_q=uh
                )
            qkv = qkv.index_select(0, st.rows)
        o = sparse_attention_core(qkv, kc[:B], vc[:B], st.seqlen, heads, n_heads=st.H,
                                  kv_heads=None if W else st.kv_all, scale=st.scale,
                                  head_mask=sets.mask[i])  # fmt: skip
        if every:  # o is in head order, zeros where a sequence skips a head
            return self.proj.out(o)
        return sparse_mlp_down(o, lw.w_o_t, heads, bias=lw.b_o, rows_per_index=dh, validate=False,
                               config=sets.down_config)  # fmt: skip

    def flush(self, B: int, W: int, positions: torch.Tensor) -> None:
        """Every KV head's K/V over the window of every sequence (rows at ``positions``)."""
        st, lw, H, dh = self.st, self.lw, self.st.H, self.st.dh
        bias = None if lw.b_qkv is None else lw.b_qkv[H * dh :]
        kv = F.linear(st.hwin[self.i, : B * W], lw.w_qkv[H * dh :], bias)  # K blocks, V blocks
        if st.cos is not None:
            rope_(kv, st.cos, st.sin, positions, n_rot=st.Hkv)
        for b in range(B):
            kv_window_write(kv[b * W : (b + 1) * W], self.kv[0, b], self.kv[1, b], st.kv_all,
                            st.base_t[b : b + 1], n_q=0)  # fmt: skip
