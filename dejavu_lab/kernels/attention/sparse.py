"""Sparse multi-head attention for decoding: only the selected heads are projected and attended.

Deja Vu §4.2 and Appendix E: attention heads are contextually sparse too, and in decoding the
attention block is dominated by reading ``W_QKV`` and ``W_O``. One decode step for the selected
query heads ``heads`` (shared by a union batch of 1-32 sequences, each with its own KV cache):

1. QKV projection of the selected heads' rows of ``W_QKV`` (``d_head`` rows per head) with
   :func:`sparse_mlp_up` (no activation). GQA-aware: a KV head is projected if any query head
   of its group is selected.
2. :func:`~dejavu_lab.kernels.attention.core.sparse_attention_core`: one program per (sequence, needed KV head,
   context split). It appends the new key/value to the cache at position ``seqlens - 1`` and
   attends for every selected query head of its group, reading each cached key/value once
   (online softmax, fp32).
3. Output projection over the selected heads' rows of ``W_O^T`` (stored transposed at load
   time, like W2) with :func:`sparse_mlp_down`.

Skipped heads' keys and values are not written (Deja Vu defers them, §4.2).

In a batch each sequence keeps its own heads (attention needs no union: each sequence reads
only its own cache). ``head_mask`` [B, h] says which of the ``heads`` (the batch's union, whose
rows the projections read) sequence b attends: a program whose sequence keeps none of its KV
head's query heads reads no cache (it still appends the new key/value: a head's K/V is written
whenever its rows are projected), and a head a sequence skips outputs zeros, so ``W_O``'s rows
of the union add nothing for it.
"""

from __future__ import annotations

import math

import torch

from .._common import (
    as_batch,
    check_device,
    check_float,
    check_index,
    check_out,
    check_rowmajor,
    check_shape,
    use_triton,
)
from ..mlp.down import sparse_mlp_down
from ..mlp.up import sparse_mlp_up
from .core import needed_kv_heads, sparse_attention_core

__all__ = ["sparse_attention", "sparse_attention_ref"]


def _check_mask(head_mask, batch, n_q, device):
    """head_mask: None, or a [B, h] bool/int tensor on ``device`` with contiguous rows."""
    if head_mask is None:
        return
    if not isinstance(head_mask, torch.Tensor) or head_mask.dtype.is_floating_point:
        raise TypeError("head_mask must be a bool or integer tensor [B, h] (1 = attend).")
    check_device(device, head_mask=head_mask)
    check_shape("head_mask", head_mask, (batch, n_q))
    if head_mask.stride(1) != 1:
        raise ValueError("head_mask needs contiguous rows; pass head_mask.contiguous().")


def sparse_attention_ref(
    x, w_qkv, w_o_t, k_cache, v_cache, seqlens, heads, *, n_heads, b_qkv=None, b_o=None,
    scale=None, head_mask=None,
):  # fmt: skip
    """Plain-PyTorch reference (fp32 math); updates the caches of the needed KV heads in place.

    >>> H, dh, T, f16 = 4, 16, 8, torch.float16  # 4 heads of 16, d = 64, cache of 8 positions
    >>> x, w_qkv, w_o_t = (torch.randn(n, 64, dtype=f16) for n in (1, 3 * 64, 64))
    >>> kc, vc = torch.zeros(2, 1, H, T, dh, dtype=f16)  # [B, n_kv, T, d_head] each
    >>> seqlens, heads = torch.tensor([5]), torch.tensor([0, 2])
    >>> _ = sparse_attention_ref(x, w_qkv, w_o_t, kc, vc, seqlens, heads, n_heads=H)
    >>> kc[0].any(-1).nonzero().tolist()  # (head, position) written: kept heads, position 4
    [[0, 4], [2, 4]]
    """
    batch, d = x.shape
    n_kv, dh = k_cache.shape[1], k_cache.shape[3]
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    heads_l = heads.long()
    kv_heads = torch.unique(heads_l // group)
    qkv = x.float() @ w_qkv.float().T + (b_qkv.float() if b_qkv is not None else 0.0)
    qkv = qkv.to(x.dtype).float()  # the kernel keeps the projection in x's dtype
    q = qkv[:, : n_heads * dh].view(batch, n_heads, dh)
    k = qkv[:, n_heads * dh : (n_heads + n_kv) * dh].view(batch, n_kv, dh)
    v = qkv[:, (n_heads + n_kv) * dh :].view(batch, n_kv, dh)
    rows = (heads_l[:, None] * dh + torch.arange(dh, device=x.device)).reshape(-1)
    attn = torch.zeros(batch, n_heads, dh, dtype=torch.float32, device=x.device)
    for bi in range(batch):
        pos = int(seqlens[bi]) - 1
        k_cache[bi, kv_heads, pos] = k[bi, kv_heads].to(k_cache.dtype)
        v_cache[bi, kv_heads, pos] = v[bi, kv_heads].to(v_cache.dtype)
        for j, h in enumerate(heads_l.tolist()):
            if head_mask is not None and not head_mask[bi, j]:
                continue  # this sequence skips head h: zeros
            kk = k_cache[bi, h // group, : pos + 1].float()
            vv = v_cache[bi, h // group, : pos + 1].float()
            p = torch.softmax(kk @ q[bi, h] * scale, dim=0)
            attn[bi, h] = p @ vv
    attn = attn.to(x.dtype).float().view(batch, n_heads * dh)  # the kernel rounds here too
    y = attn[:, rows] @ w_o_t[rows].float() + (b_o.float() if b_o is not None else 0.0)
    return y.to(x.dtype)


def sparse_attention(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    w_o_t: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    heads: torch.Tensor,
    *,
    n_heads: int,
    b_qkv: torch.Tensor | None = None,
    b_o: torch.Tensor | None = None,
    kv_heads: torch.Tensor | None = None,
    scale: float | None = None,
    head_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """One decoding step of attention over the selected query ``heads``; returns [B, d].

    x: [B, d] (B <= 32) or [d]; w_qkv: [(n_heads + 2 n_kv) d_head, d] = cat(W_q, W_k, W_v) rows;
    w_o_t: [n_heads d_head, d] = ``o_proj.weight.T`` made contiguous at load time;
    k_cache, v_cache: [B, n_kv, T_max, d_head] (written at ``seqlens - 1`` for needed KV heads);
    seqlens: [B] int lengths including the new token; heads: [h] distinct query heads.
    ``kv_heads`` (the sorted needed KV heads) avoids a host sync for GQA models under CUDA
    graphs; for multi-head attention it equals ``heads``. ``head_mask`` [B, h] (bool or int):
    which of ``heads`` each sequence attends (the rest output zeros; see the module doc).
    ``config`` tunes the projections.

    >>> _ = torch.manual_seed(0)
    >>> H, dh, T, f16 = 4, 16, 8, torch.float16  # 4 heads of 16, d = 64, cache of 8 positions
    >>> x = torch.randn(1, 64, dtype=f16)
    >>> w_qkv, w_o_t = torch.randn(3 * 64, 64, dtype=f16) / 8, torch.randn(64, 64, dtype=f16) / 8
    >>> kc, vc = torch.randn(2, 1, H, T, dh, dtype=f16)  # [B, n_kv, T, d_head] each
    >>> seqlens, heads = torch.tensor([5]), torch.tensor([0, 2])  # 5 tokens with the new one
    >>> y = sparse_attention(x, w_qkv, w_o_t, kc.clone(), vc.clone(), seqlens, heads, n_heads=H)
    >>> ref = sparse_attention_ref(x, w_qkv, w_o_t, kc, vc, seqlens, heads, n_heads=H)
    >>> y.shape, torch.allclose(y, ref, atol=1e-2)
    (torch.Size([1, 64]), True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_device(device, w_qkv=w_qkv, w_o_t=w_o_t, k_cache=k_cache, v_cache=v_cache,
                 seqlens=seqlens, heads=heads, b_qkv=b_qkv, b_o=b_o, kv_heads=kv_heads)  # fmt: skip
    for name, t in (("w_qkv", w_qkv), ("w_o_t", w_o_t), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t, dtype)
    check_rowmajor("w_qkv", w_qkv)
    check_rowmajor("w_o_t", w_o_t)
    d = w_qkv.shape[1]
    xb, squeeze = as_batch("x", x, d)
    batch = xb.shape[0]
    if k_cache.dim() != 4 or k_cache.shape[0] != batch:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)}; expected [{batch}, n_kv, T_max, d_head]."
        )
    n_kv, t_max, dh = k_cache.shape[1:]
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (d_head) dimension.")
    if n_heads % n_kv or dh & (dh - 1) or dh < 16:
        raise ValueError(
            f"n_heads={n_heads} must be a multiple of n_kv={n_kv}, d_head={dh} a power of two >= 16."
        )
    check_shape("w_qkv", w_qkv, ((n_heads + 2 * n_kv) * dh, d))
    check_shape("w_o_t", w_o_t, (n_heads * dh, d))
    if b_qkv is not None:
        check_float("b_qkv", b_qkv, dtype)
        check_shape("b_qkv", b_qkv, ((n_heads + 2 * n_kv) * dh,))
    if b_o is not None:
        check_float("b_o", b_o, dtype)
        check_shape("b_o", b_o, (d,))
    if not isinstance(seqlens, torch.Tensor) or seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError("seqlens must be an int32 or int64 tensor of sequence lengths.")
    check_shape("seqlens", seqlens, (batch,))
    check_index("heads", heads, n_heads, device, validate)
    if kv_heads is not None:
        check_index("kv_heads", kv_heads, n_kv, device, validate)
    _check_mask(head_mask, batch, heads.numel(), device)
    if validate is not False and not (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    ):
        if batch and (int(seqlens.min()) < 1 or int(seqlens.max()) > t_max):
            raise ValueError(f"seqlens must lie in [1, {t_max}] (the cache length).")
    shape = (d,) if squeeze else (batch, d)
    check_out(out, shape, dtype, device)
    res = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    res2 = res.view(batch, d)
    if not use_triton(device):
        res2.copy_(sparse_attention_ref(xb, w_qkv, w_o_t, k_cache, v_cache, seqlens, heads,
                                        n_heads=n_heads, b_qkv=b_qkv, b_o=b_o, scale=scale,
                                        head_mask=head_mask))  # fmt: skip
        return res
    if heads.numel() == 0:
        res2.copy_(b_o.expand(batch, d) if b_o is not None else torch.zeros_like(res2))
        return res
    cfg = config or {}
    kvh = needed_kv_heads(heads, n_heads, n_kv, kv_heads)
    kv_blocks = heads if kvh is None else kvh
    qkv_idx = torch.cat([heads, kv_blocks + n_heads, kv_blocks + n_heads + n_kv])
    qkv = sparse_mlp_up(xb, w_qkv, qkv_idx, bias=b_qkv, activation="none", rows_per_index=dh,
                        validate=False, config=cfg.get("up"))  # fmt: skip
    o = sparse_attention_core(qkv, k_cache, v_cache, seqlens, heads, n_heads=n_heads,
                              kv_heads=kvh, scale=scale, head_mask=head_mask,
                              config=cfg)  # fmt: skip
    sparse_mlp_down(o, w_o_t, heads, bias=b_o, rows_per_index=dh, out=res2, validate=False,
                    config=cfg.get("down"))  # fmt: skip
    return res
