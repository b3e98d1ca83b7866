"""DejaVu's attention block: the kept heads only, their K/V deferred (Deja Vu §4.2-4.3, Appendix C.1).

One :class:`KeptHeads` per layer reads the kept heads' rows of ``W_QKV`` and ``W_O^T`` and the
kept heads' cache only (:func:`~dejavu_lab.kernels.sparse_attention_core`); the kept set is
read from the decoder's sets at each call (by hand, or DejaVu's lookahead predictors).

Skipped heads write no K/V: the attention input of the last ``window`` tokens is kept per
layer (``StepState.hwin``), a kept head recomputes its K/V over that window in the same weight
pass (a union batch), and every ``window`` tokens one dense K/V pass over the window fills
every head (:meth:`KeptHeads.flush`). ``fused``: QKV, RoPE and the window's K/V write in one
launch (:func:`~dejavu_lab.kernels.qkv_rope`), else apart. The unfused step reads its weights
through three methods — the kept heads' QKV rows, their ``W_O^T`` rows, every head's K/V rows
over the window — that the 4-bit block (:class:`~dejavu_lab.engine.int4_sparse.Int4KeptHeads`)
replaces with the int4 kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import (
    kv_window_write,
    qkv_rope,
    rope_,
    sparse_attention_core,
    sparse_mlp_down,
    sparse_mlp_up,
)
from .attention import StepState

__all__ = ["KeptHeads"]


class KeptHeads:
    """Layer ``i``'s kept heads (``sets.head_idx[i]``, blocks ``sets.qkv_idx[i]``) over its
    cache ``kv`` [2, Hkv, T, dh]; x [1, d] -> [1, d].

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5))
    >>> type(dec.attn[0]).__name__, type(dec.mlp[0]).__name__
    ('KeptHeads', 'KeptMLP')
    """

    def __init__(self, lw, kv: torch.Tensor, st: StepState, i: int, sets, *, fused: bool):
        self.lw, self.kv, self.st, self.i, self.sets, self.fused = lw, kv, st, i, sets, fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        st, lw, i = self.st, self.lw, self.i
        heads = self.sets.head_idx[i]
        if st.window:  # union batch: this token plus the window's stored inputs
            st.hwin[i].index_copy_(0, st.slot, x)
            xb = st.hwin[i]
        else:
            xb = x
        # [B, (k + 2 nkv) dh]: the kept blocks of W_QKV, queries and keys rotated (row b at
        # its position) and, with deferred KV, the kept heads' K/V over the window written to
        # the cache, all in one launch
        win = st.window > 0
        if not self.fused:
            return self._unfused(xb, heads)
        qkv = qkv_rope(xb, lw.w_qkv, self.sets.qkv_idx[i], n_heads=st.H, n_kv_heads=st.Hkv,
                       positions=st.positions,
                       bias=lw.b_qkv, cos=st.cos, sin=st.sin,
                       k_cache=self.kv[0] if win else None,
                       v_cache=self.kv[1] if win else None)  # fmt: skip
        if win:  # this token's row
            qkv = qkv.index_select(0, st.slot)  # [1, (k + 2 nkv) dh]
        # appends this token's K/V (again, in the window case) and attends, kept heads only
        return self._attend(qkv, heads)

    def src(self, x: torch.Tensor) -> tuple:
        """The block's finished output as the fused step takes it: (output, no bias left,
        not fp32 sums)."""
        return self(x), None, False

    def lists_for(self) -> None:
        """No kept lists: the kept heads are rows of ``W_QKV``, not input channels."""
        return None

    def _attend(self, qkv: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Append this token's K/V, attend over the kept heads' cache only, then their W_O rows."""
        st = self.st
        o = sparse_attention_core(
            qkv, self.kv[0][None], self.kv[1][None], st.seqlen, heads, n_heads=st.H,
            kv_heads=None if st.window else st.kv_all, scale=st.scale,
        )  # [1, k dh]  # fmt: skip
        return self._out(o, heads)

    def _qkv_rows(self, xb: torch.Tensor) -> torch.Tensor:
        """[B, (k + 2 nkv) dh]: the kept blocks of W_QKV times xb [B, d] (the gather-GEMV)."""
        lw = self.lw
        return sparse_mlp_up(xb, lw.w_qkv, self.sets.qkv_idx[self.i], bias=lw.b_qkv,
                             activation="none", rows_per_index=self.st.dh,
                             validate=False)  # fmt: skip

    def _out(self, o: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """[1, d]: the kept heads' rows of W_O^T times their attention output o [1, k dh]."""
        return sparse_mlp_down(o, self.lw.w_o_t, heads, bias=self.lw.b_o, rows_per_index=self.st.dh,
                               validate=False, config=self.sets.down_config)  # fmt: skip

    def _kv_rows(self, hwin: torch.Tensor) -> torch.Tensor:
        """[W, 2 Hkv dh]: every head's K and V over the window's attention inputs hwin [W, d]."""
        lw, H, dh = self.lw, self.st.H, self.st.dh
        bias = None if lw.b_qkv is None else lw.b_qkv[H * dh :]
        return F.linear(hwin, lw.w_qkv[H * dh :], bias)

    def _unfused(self, xb: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The kept heads' QKV gather-GEMV, RoPE, the window's K/V write and attention apart."""
        st = self.st
        k, nkv = self.sets.k_heads, self.sets.n_kv_sel
        qkv = self._qkv_rows(xb)  # [B, (k + 2 nkv) dh]
        if st.cos is not None:  # row b sits at positions[b]; one launch, in place
            rope_(qkv, st.cos, st.sin, st.positions, n_rot=k + nkv)
        if st.window:  # the kept heads' K/V over the whole window, then this token's row
            kv_window_write(qkv, self.kv[0], self.kv[1], heads, st.base_t, n_q=k)
            qkv = qkv.index_select(0, st.slot)  # [1, (k + 2 nkv) dh]
        return self._attend(qkv, heads)

    def flush(self, base: int, blocks: torch.Tensor | None, positions: torch.Tensor):
        """Dense K/V of every head for the window's tokens (from position ``base``, rows at
        ``positions``): the step's own kernel over every K/V block (``blocks``), so both write
        the same numbers; the unfused step rotates with :func:`~dejavu_lab.kernels.rope_`, and
        so does its flush."""
        st, lw, kv, hwin = self.st, self.lw, self.kv, self.st.hwin[self.i]
        if self.fused:
            qkv_rope(hwin, lw.w_qkv, blocks, n_heads=st.H, n_kv_heads=st.Hkv,
                     positions=positions, bias=lw.b_qkv, cos=st.cos, sin=st.sin,
                     k_cache=kv[0], v_cache=kv[1])  # fmt: skip
            return
        Hkv, dh, W, b = st.Hkv, st.dh, st.window, base
        new = self._kv_rows(hwin)  # [W, 2 Hkv dh]: every K block, then every V block
        if st.cos is not None:  # the K blocks, as the step turns them
            rope_(new, st.cos, st.sin, positions, n_rot=Hkv)
        new = new.view(W, 2, Hkv, dh)
        kv[0, :, b : b + W] = new[:, 0].transpose(0, 1)
        kv[1, :, b : b + W] = new[:, 1].transpose(0, 1)
