"""The blocks of a batched decode step: each sequence's own heads, deferred KV per sequence.

A mixin of :class:`dejavu_lab.engine.BatchDecoder` (it expects the batch-1 Decoder's weights,
cache and tables, and the batch's ``B``, ``W``, plans and per-sequence buffers):

- ``_attn_sparse`` (DejaVu): ``W_QKV``'s rows of the batch's union of heads, RoPE per row at its
  own position, each sequence attending its own heads of its own cache
  (:func:`~dejavu_lab.kernels.sparse_attention_core` with ``head_mask``), ``W_O``'s union rows;
- ``_attn_all`` (dense, TEAL, WINA, CATS): every head of every sequence, through our attention
  kernel or PyTorch with a [B, T] mask of each sequence's own positions;
- deferred KV (§4.2): the step recomputes the union heads' K/V over the window of each
  sequence, ``B x W`` rows in one gather-GEMV (at most 32: ``W = min(kv_window, 32 // B)``, and
  no deferral below 4, nor when the union has room for every head), so a head outside the
  union writes no K/V until the window's flush (``_flush``: one dense K/V pass over every
  sequence's window) or until it joins the union.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import (
    kv_window_write,
    rope_,
    sparse_attention_core,
    sparse_mlp_down,
    sparse_mlp_up,
)

__all__ = ["BatchBlocks"]

MAX_ROWS = 32  # the gather-GEMVs take 1-32 rows


class BatchBlocks:
    """Attention blocks and the deferred-KV flush of a batch of B sequences; a mixin.

    >>> import torch
    >>> from dejavu_lab.engine import BatchDecoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 4 heads: deferred KV
    >>> dec = BatchDecoder(m, max_seq_len=32, sparse=SparseConfig(0.5, 0.75, kv_window=16))
    >>> [dec._window_for(b) for b in (1, 2, 4, 8, 16, 32)]  # B x W <= 32 rows, B heads < 4
    [16, 16, 0, 0, 0, 0]
    """

    def _window_for(self, B: int) -> int:
        """The deferred-KV window at batch size B: B x W rows fit one gather-GEMV (<= 32)."""
        if self.method == "dejavu" and min(self.H, B * self.k_heads) == self.H:
            return 0  # the union can hold every head: nothing to defer
        w = min(self.window, MAX_ROWS // B)
        return w if (w == self.window or w >= 4) else 0

    def _per_step(self) -> None:
        B, W = self.B, self.W
        pos = self.pos_t[:B]
        self._seqlen = pos + 1  # [B] tokens in each cache with this one
        self._live_heads[:B].copy_(self.live_t[:B, None].expand(B, self.H))
        if self.method != "dejavu" and self.ops["attn"] == "torch":  # [B, T] own positions only
            self._cur_mask = torch.where(self.ar_t[None] <= pos[:, None], self._zero, self._ninf)
        if W:  # window row b * W + slot holds this step's input of sequence b
            self._rows = self._ar_b[:B] * W + (self.step_t - self.wstart_t)
            self._positions = (self.base_t[:B, None] + self.ar_w[None, :W]).reshape(-1)
        else:
            self._positions = pos

    def _attn_sparse(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The union's W_QKV rows (over the window's B x W rows when deferring), each
        sequence's own heads attended, the union's W_O rows; x [B, d] -> [B, d]."""
        lw, p, B, W, dh = self.w.layers[i], self._plan, self.B, self.W, self.dh
        uh = p.head_idx.shape[1]
        every = uh == self.H and not W  # the union holds every head: the dense projections
        if W:
            self.hwin[i].index_copy_(0, self._rows, x)
            x = self.hwin[i, : B * W]
        if every:
            qkv = self._qkv(i, x)
        else:  # [rows, (Uh + 2 n_kv) dh]
            qkv = sparse_mlp_up(x, lw.w_qkv, p.qkv_idx[i], bias=lw.b_qkv, activation="none",
                                rows_per_index=dh, validate=False)  # fmt: skip
        n_kv = (p.qkv_idx.shape[1] - uh) // 2
        if self.cos is not None:  # queries and keys, each row at its own position
            rope_(qkv, self.cos, self.sin, self._positions, n_rot=uh + n_kv)
        kc, vc = self.kv[i, 0], self.kv[i, 1]  # [B_max, Hkv, T, dh]
        if W:  # the union heads' K/V over each sequence's window, then this step's rows
            for b in range(B):
                kv_window_write(qkv[b * W : (b + 1) * W], kc[b], vc[b], p.head_idx[i],
                                self.base_t[b : b + 1], n_q=uh)  # fmt: skip
            qkv = qkv.index_select(0, self._rows)
        o = sparse_attention_core(qkv, kc[:B], vc[:B], self._seqlen, p.head_idx[i], n_heads=self.H,
                                  kv_heads=None if W else self._kv_all, scale=self.scale,
                                  head_mask=p.mask[i])  # fmt: skip
        if every:  # o is in head order, zeros where a sequence skips a head
            return self._out(i, o)
        return sparse_mlp_down(o, lw.w_o_t, p.head_idx[i], bias=lw.b_o, rows_per_index=dh,
                               validate=False)  # fmt: skip

    def _mlp_sparse(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The union's neurons; when the buffer holds every neuron, the dense MLP (cuBLAS)."""
        if self._plan.mlp_idx.shape[1] == self.arch.d_mlp:
            return self._mlp_torch(i, x)
        return super()._mlp_sparse(i, x)

    def _attn_all(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Every head of every sequence (dense, TEAL, WINA, CATS); x [B, d] -> [B, d]."""
        H, Hkv, dh, B = self.H, self.Hkv, self.dh, self.B
        qkv = self._qkv(i, x)  # [B, (H + 2 Hkv) dh]
        if self.cos is not None:
            rope_(qkv, self.cos, self.sin, self._positions, n_rot=H + Hkv)
        kc, vc = self.kv[i, 0, :B], self.kv[i, 1, :B]
        if self.ops["attn"] == "triton":  # finished sequences attend nothing
            o = sparse_attention_core(qkv, kc, vc, self._seqlen, self._heads_all, n_heads=H,
                                      kv_heads=None if H == Hkv else self._kv_all,
                                      scale=self.scale, head_mask=self._live_heads[:B],
                                      q_slot=self._slots_all)  # fmt: skip
            return self._out(i, o)
        blocks = qkv.view(B, H + 2 * Hkv, dh)
        where = (self._ar_b[:B, None], self._kv_all[None], self.pos_t[:B, None])
        kc.index_put_(where, blocks[:, H : H + Hkv])
        vc.index_put_(where, blocks[:, H + Hkv :])
        q = blocks[:, :H].reshape(B * Hkv, H // Hkv, dh)
        s = torch.baddbmm(self._cur_mask.repeat_interleave(Hkv, 0)[:, None], q,
                          kc.reshape(B * Hkv, -1, dh).transpose(1, 2), alpha=self.scale)  # fmt: skip
        o = torch.bmm(torch.softmax(s, dim=-1), vc.reshape(B * Hkv, -1, dh))
        return self._out(i, o.reshape(B, H * dh))

    def _flush(self) -> None:
        """Every KV head's K/V over the window of every sequence, then a new window (§4.2)."""
        B, W, H, dh = self.B, self.W, self.H, self.dh
        positions = (self.base_t[:B, None] + self.ar_w[None, :W]).reshape(-1)
        for i, lw in enumerate(self.w.layers):
            bias = None if lw.b_qkv is None else lw.b_qkv[H * dh :]
            kv = F.linear(self.hwin[i, : B * W], lw.w_qkv[H * dh :], bias)  # K blocks, V blocks
            if self.cos is not None:
                rope_(kv, self.cos, self.sin, positions, n_rot=self.Hkv)
            for b in range(B):
                kv_window_write(kv[b * W : (b + 1) * W], self.kv[i, 0, b], self.kv[i, 1, b],
                                self._kv_all, self.base_t[b : b + 1], n_q=0)  # fmt: skip
        self.base_t[:B] += W
        self.wstart += W
        self.wstart_t.fill_(self.wstart)
