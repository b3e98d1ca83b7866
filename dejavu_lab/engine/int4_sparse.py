"""DejaVu and CATS on 4-bit weights: kept heads, kept neurons and kept up rows over int4 matrices.

The bytes of a 4-bit step multiply with the kept fraction when a dropped unit is a row never
read. :func:`~dejavu_lab.engine.int4.quantize_weights` lays the matrices out so that it is
(``method="dejavu"``: ``W_QKV`` and ``W_in`` as :class:`~dejavu_lab.quant.Int4Rows`, one row per
output; ``method="cats"``: ``W_in`` so; ``W_O^T`` and ``W2^T`` are rows of the transposes
either way), and these blocks run the int4 kernels (:mod:`dejavu_lab.kernels.int4`):

- :class:`Int4KeptHeads` — DejaVu's attention (§4.2-4.3): the kept heads' rows of ``W_QKV``
  (:func:`~dejavu_lab.kernels.int4.int4_kept_up`, ``rows_per_index = d_head``), RoPE and the
  deferred K/V window as :class:`~dejavu_lab.engine.kept_heads.KeptHeads`' unfused step, the
  kept heads' rows of ``W_O^T`` (:func:`~dejavu_lab.kernels.int4.int4_rows_gemv`);
- :class:`Int4KeptMLP` — DejaVu's MLP (§4.3): the kept neurons' gate and up rows
  (:func:`~dejavu_lab.kernels.int4.int4_kept_up`), then their rows of ``W2^T``
  (:func:`~dejavu_lab.kernels.int4.int4_rows_gemv`);
- :class:`Int4CatsMLP` — CATS: every gate row and the kept neurons' up rows in one launch
  (:func:`~dejavu_lab.kernels.int4.int4_cats_up`), then the kept rows of ``W2^T``
  (:func:`~dejavu_lab.kernels.int4.int4_threshold_gemv` at threshold 0: a dropped neuron's
  activation is exactly 0, its row is never read).

Their outputs are finished tensors, so CATS's one-token step goes through the fused residual
add + norm (:mod:`~dejavu_lab.engine.fused_step`) as the dense int4 blocks do. :func:`int4_blocks`
picks each layer's blocks for a decoder over int4 weights, whatever the method.

>>> from dejavu_lab.engine import Decoder, SparseConfig
>>> from dejavu_lab.models import random_model
>>> m, ids = random_model("tiny-llama", dtype=torch.float16).model, torch.tensor([[1, 2, 3]])
>>> sp = SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5)
>>> dec = Decoder(m, max_seq_len=8, sparse=sp, weights="int4", group=64)
>>> type(dec.attn[0]).__name__, type(dec.mlp[0]).__name__, type(dec.w.layers[0].w_in).__name__
('Int4KeptHeads', 'Int4KeptMLP', 'Int4Rows')
>>> dec.generate(ids, 3).shape
torch.Size([1, 6])
"""

from __future__ import annotations

import torch

from ..kernels.int4 import int4_cats_up, int4_kept_up, int4_rows_gemv, int4_threshold_gemv
from .int4 import Int4Attention, Int4MLP
from .kept_heads import KeptHeads
from .mlp import DenseMLP
from .weights import DecoderWeights, linear_t

__all__ = ["Int4CatsMLP", "Int4KeptHeads", "Int4KeptMLP", "int4_blocks"]


class Int4KeptHeads(KeptHeads):
    """Layer ``i``'s kept heads over int4 ``W_QKV`` (rows) and ``W_O^T``: the unfused step of
    :class:`~dejavu_lab.engine.kept_heads.KeptHeads` with its three weight reads in 4 bits.

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 4 heads of 16
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5),
    ...               weights="int4", group=64)
    >>> dec.set_indices(0, heads=[1, 3])
    >>> _ = dec.prefill(torch.tensor([[1, 2, 3]])); dec._per_step()
    >>> x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> dec.attn[0]._qkv_rows(x).shape  # kept q heads 1, 3, then their K and V (deferred KV)
    torch.Size([1, 96])
    """

    def __init__(self, lw, kv: torch.Tensor, st, i: int, sets):
        super().__init__(lw, kv, st, i, sets, fused=False)
        H, Hkv = st.H, st.Hkv  # the K and V blocks of every head, for the window's flush
        self.kv_blocks = torch.arange(H, H + 2 * Hkv, device=kv.device, dtype=torch.int32)

    def _qkv_rows(self, xb: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        return int4_kept_up(xb, lw.w_qkv, self.sets.qkv_idx[self.i], bias=lw.b_qkv,
                            rows_per_index=self.st.dh, validate=False)  # fmt: skip

    def _out(self, o: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        return int4_rows_gemv(o, lw.w_o_t, heads, bias=lw.b_o, rows_per_index=self.st.dh,
                              validate=False)  # fmt: skip

    def _kv_rows(self, hwin: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        return int4_kept_up(hwin, lw.w_qkv, self.kv_blocks, bias=lw.b_qkv,
                            rows_per_index=self.st.dh, validate=False)  # fmt: skip


class Int4KeptMLP(DenseMLP):
    """DejaVu's MLP over layer ``i``'s kept neurons ``sets.mlp_idx[i]`` (read at each call) on
    int4 ``W_in`` (rows: gate then up, or fc1) and ``W2^T``.

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model  # 192 neurons
    >>> dec = Decoder(m, max_seq_len=8, sparse=SparseConfig(mlp_sparsity=0.75), weights="int4",
    ...               group=64)
    >>> mlp, x = dec.mlp[0], torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> idx = mlp.sets.mlp_idx[0]  # 48 neurons: the dense int4 MLP over those rows only
    >>> dense = mlp.hidden(x)[:, idx].float() @ mlp.lw.w_down_t.dequantize(torch.float32)[idx]
    >>> torch.allclose(mlp(x).float(), dense, atol=1e-2)
    True
    """

    def __init__(self, lw, w: DecoderWeights, i: int, sets):
        super().__init__(lw, w)
        self.i, self.sets = i, sets

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lw, idx = self.lw, self.sets.mlp_idx[self.i]
        h = int4_kept_up(x, lw.w_in, idx, activation=self.activation, gated=self.gated,
                         bias=lw.b_in, validate=False)  # fmt: skip
        return int4_rows_gemv(h, lw.w_down_t, idx, bias=lw.b_down, validate=False)

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP (every neuron) over the same int4 weights."""
        return linear_t(self.hidden(x), self.lw.w_down_t, self.lw.b_down)


class Int4CatsMLP(DenseMLP):
    """CATS on int4 weights: every gate row, the up rows of the neurons with
    ``|act(gate)| > gate`` (a :class:`~dejavu_lab.engine.site_thresholds.Threshold`; the kernel
    reads its vector), then their rows of ``W2^T``.

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> cats = SparseConfig(method="cats", thresholds=keep_all(m, "cats"))
    >>> dec = Decoder(m, max_seq_len=8, sparse=cats, weights="int4", group=64)
    >>> mlp, x = dec.mlp[0], torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> type(mlp).__name__, torch.allclose(mlp(x), mlp.torch(x), atol=1e-2)  # all kept: dense
    ('Int4CatsMLP', True)
    """

    def __init__(self, lw, w: DecoderWeights, gate):
        super().__init__(lw, w)
        self.gate = gate.vector

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        h = int4_cats_up(x, lw.w_in, self.gate, activation=self.activation, bias=lw.b_in)
        return int4_threshold_gemv(h, lw.w_down_t, 0.0, bias=lw.b_down)

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP (every neuron) over the same int4 weights."""
        return linear_t(self.hidden(x), self.lw.w_down_t, self.lw.b_down)


def int4_blocks(w: DecoderWeights, kv: torch.Tensor, st, thresholds: list[dict], *,
                method: str = "dense", sets=None) -> tuple[list, list]:  # fmt: skip
    """Each layer's (attention, MLP) blocks over int4 weights: ``kv`` the cache [L, ...],
    ``st`` the decoder's :class:`~dejavu_lab.engine.attention.StepState`, ``thresholds`` its
    per-layer ``{site: Threshold or None}``, ``method`` its method, ``sets`` DejaVu's
    :class:`~dejavu_lab.engine.sets.KeptSets`.

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama", dtype=torch.float16).model, max_seq_len=8,
    ...               weights="int4", group=64)
    >>> attn, mlp = int4_blocks(dec.w, dec.kv, dec.st, dec.site_thresholds)
    >>> [type(b).__name__ for b in (attn[1], mlp[1])]
    ['Int4Attention', 'Int4MLP']
    """
    L = range(len(w.layers))
    if method == "dejavu":
        attn = [Int4KeptHeads(w.layers[i], kv[i], st, i, sets) for i in L]
        return attn, [Int4KeptMLP(w.layers[i], w, i, sets) for i in L]
    attn, mlp = [], []
    for i, lw in enumerate(w.layers):
        t = thresholds[i]
        attn.append(Int4Attention(lw, kv[i], st, t["attn_in"], t["o_in"]))
        if method == "cats" and t["gate"] is not None:
            mlp.append(Int4CatsMLP(lw, w, t["gate"]))
        else:  # W_in in the rows layout (CATS's weights) runs dense
            t_in = t["mlp_in"] if lw.w_in_t is not None else None
            mlp.append(Int4MLP(lw, w, t_in, t["down_in"]))
    return attn, mlp
