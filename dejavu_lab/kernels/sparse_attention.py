"""Sparse multi-head attention for decoding: only the selected heads are projected and attended.

Deja Vu §4.2 and Appendix E: attention heads are contextually sparse too, and in decoding the
attention block is dominated by reading ``W_QKV`` and ``W_O``. One decode step for the selected
query heads ``heads`` (shared by a union batch of 1-32 sequences, each with its own KV cache):

1. QKV projection of the selected heads' rows of ``W_QKV`` (``d_head`` rows per head) with
   :func:`sparse_mlp_up` (no activation). GQA-aware: a KV head is projected if any query head
   of its group is selected.
2. ``sparse_attention_kernel``: one program per (sequence, needed KV head). It appends the new
   key/value to the cache at position ``seqlens - 1`` and attends for every selected query
   head of its group, reading each cached key/value once (online softmax, fp32).
3. Output projection over the selected heads' rows of ``W_O^T`` (stored transposed at load
   time, like W2) with :func:`sparse_mlp_down`.

Skipped heads' keys and values are not written (Deja Vu defers them; see Knowl 5).

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
import triton
import triton.language as tl

from ._common import (
    as_batch,
    check_device,
    check_float,
    check_index,
    check_out,
    check_rowmajor,
    check_shape,
    dot_acc,
    next_pow2,
    upcast_dot,
    use_triton,
)
from .sparse_mlp_down import sparse_mlp_down
from .sparse_mlp_up import sparse_mlp_up

__all__ = [
    "sparse_attention",
    "sparse_attention_core",
    "sparse_attention_core_ref",
    "sparse_attention_kernel",
    "sparse_attention_ref",
]


@triton.jit
def sparse_attention_kernel(
    qkv_ptr,  # [B, (n_q + 2 n_kv) * DH] selected q heads, then k, then v (projection output)
    kc_ptr,  # [B, H_kv, T_max, DH] key cache
    vc_ptr,  # [B, H_kv, T_max, DH] value cache
    seqlens_ptr,  # [B] lengths including the new token
    kv_heads_ptr,  # [n_kv] needed KV heads
    q_slot_ptr,  # [H] column block of each query head in qkv (-1: not selected)
    o_ptr,  # [B, n_q * DH] attention output of the selected heads
    n_q,
    n_kv,
    stride_qkv,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_o,
    qk_scale,  # softmax scale * log2(e)
    chunk,  # cached positions per split (a multiple of BLOCK_T)
    part_ptr,  # [B * n_kv * n_split, BLOCK_G, DH + 2] fp32 partial (acc, m, l) per split
    mask_ptr,  # [B, n_q] per-sequence head mask (HAS_MASK): 0 = this sequence skips the head
    stride_mask,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP (rows of a partial state)
    BLOCK_H: tl.constexpr,  # max(16, BLOCK_G): the query tile of the tensor-core products
    DH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PARTIAL: tl.constexpr,  # several splits of the context (flash-decoding); combine after
    DIRECT: tl.constexpr,  # GROUP == 1 and kv_heads == heads: program s serves query slot s
    HAS_MASK: tl.constexpr,  # per-sequence heads (mask_ptr)
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
):
    """One (sequence, KV head, context split): the group's query heads against the cache.

    The group's query heads are one [BLOCK_H, DH] tile (padded to 16 rows) and every step is
    two tensor-core products, ``q @ K^T`` and ``p @ V``, over ``BLOCK_T`` cached positions, so
    each key and value is read once for the whole group and the loads pipeline through shared
    memory (an FMA broadcast over [group, BLOCK_T, DH] kept too few bytes in flight)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    split = tl.program_id(2)
    kvh = tl.load(kv_heads_ptr + s).to(tl.int64)
    seqlen = tl.load(seqlens_ptr + b)
    offs_dh = tl.arange(0, DH)
    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < GROUP
    if DIRECT:
        slot = tl.where(mask_g, s, -1)
    else:
        slot = tl.load(q_slot_ptr + kvh * GROUP + offs_g, mask=mask_g, other=-1)
    sel = slot >= 0
    keep = sel
    if HAS_MASK:  # the union's heads this sequence attends
        keep = sel & (tl.load(mask_ptr + b * stride_mask + slot, mask=sel, other=0) != 0)
    row = qkv_ptr + b * stride_qkv
    q = tl.load(row + slot[:, None].to(tl.int64) * DH + offs_dh[None, :], mask=sel[:, None],
                other=0.0)  # [BLOCK_H, DH] in the model's dtype  # fmt: skip
    kc = kc_ptr + b * stride_kb + kvh * stride_kh
    vc = vc_ptr + b * stride_vb + kvh * stride_vh
    last = (seqlen - 1).to(tl.int64)
    if split == 0:
        # the new token: appended to the cache and attended from registers, so no program
        # reads what another one writes (the others read positions < seqlen - 1 only)
        k_new = tl.load(row + (n_q + s) * DH + offs_dh)
        v_new = tl.load(row + (n_q + n_kv + s) * DH + offs_dh)
        tl.store(kc + last * stride_kt + offs_dh, k_new.to(kc_ptr.dtype.element_ty))
        tl.store(vc + last * stride_vt + offs_dh, v_new.to(vc_ptr.dtype.element_ty))
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        l_sum = tl.full((BLOCK_H,), 1.0, tl.float32)
        acc = tl.zeros((BLOCK_H, DH), tl.float32) + v_new.to(tl.float32)[None, :]
    else:
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, DH), tl.float32)
    lo = split * chunk
    hi = tl.minimum(seqlen - 1, lo + chunk)
    if HAS_MASK:  # no kept query head in this group: read none of its cache
        hi = tl.where(tl.sum(keep.to(tl.int32), axis=0) > 0, hi, lo)
    offs_tt = tl.arange(0, BLOCK_T)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + offs_tt
        mask_t = offs_t < hi
        t64 = offs_t.to(tl.int64)
        k_t = tl.load(kc + offs_dh[:, None] + t64[None, :] * stride_kt, mask=mask_t[None, :],
                      other=0.0)  # [DH, BLOCK_T]: K transposed  # fmt: skip
        v = tl.load(vc + t64[:, None] * stride_vt + offs_dh[None, :], mask=mask_t[:, None],
                    other=0.0)  # fmt: skip
        sc = dot_acc(q, k_t, tl.zeros((BLOCK_H, BLOCK_T), tl.float32), UPCAST) * qk_scale
        sc = tl.where(mask_t[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
        m = m_new
    if PARTIAL:
        in_g = offs_g < BLOCK_G
        base = part_ptr + ((b * n_kv + s) * tl.num_programs(2) + split) * (BLOCK_G * (DH + 2))
        rows = base + offs_g[:, None] * (DH + 2)
        tl.store(rows + offs_dh[None, :], acc, mask=in_g[:, None])
        tl.store(base + offs_g * (DH + 2) + DH, m, mask=in_g)
        tl.store(base + offs_g * (DH + 2) + DH + 1, l_sum, mask=in_g)
    else:
        o = tl.where(keep[:, None], acc / l_sum[:, None], 0.0)  # a skipped head outputs zeros
        o_ptrs = o_ptr + b * stride_o + slot[:, None].to(tl.int64) * DH + offs_dh[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=sel[:, None])


@triton.jit
def sparse_attention_combine_kernel(
    part_ptr,  # [B * n_kv * n_split, BLOCK_G, DH + 2] fp32 (acc, m, l)
    kv_heads_ptr,
    q_slot_ptr,
    o_ptr,
    n_kv,
    n_split,
    stride_o,
    mask_ptr,
    stride_mask,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DH: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= n_split
):
    """Merge the splits' online-softmax states: o = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.

    One program per (sequence, KV head, query head of its group); every split's state is loaded
    in one [BLOCK_S, DH] tile, so the loads are issued together rather than one split at a time
    (a loop over 40 splits was a chain of 80 dependent loads: 16 us per layer at Llama-3-8B)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    g = tl.program_id(2)
    kvh = tl.load(kv_heads_ptr + s).to(tl.int64)
    if DIRECT:
        slot = s
    else:
        slot = tl.load(q_slot_ptr + kvh * GROUP + g)
    if slot >= 0:
        offs_dh = tl.arange(0, DH)
        offs_s = tl.arange(0, BLOCK_S)
        live = offs_s < n_split
        row = BLOCK_G * (DH + 2)
        base = part_ptr + (b * n_kv + s) * n_split * row + offs_s * row + g * (DH + 2)
        m = tl.load(base + DH, mask=live, other=float("-inf"))  # [BLOCK_S]
        big_m = tl.max(m, axis=0)
        w = tl.where(live, tl.exp2(m - big_m), 0.0)  # 0 for an empty split (m = -inf)
        l_sum = tl.sum(w * tl.load(base + DH + 1, mask=live, other=0.0), axis=0)
        acc = tl.load(base[:, None] + offs_dh[None, :], mask=live[:, None], other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0) / l_sum  # [DH]
        if HAS_MASK:  # a head this sequence skips outputs zeros
            o = tl.where(tl.load(mask_ptr + b * stride_mask + slot) != 0, o, 0.0)
        tl.store(o_ptr + b * stride_o + slot.to(tl.int64) * DH + offs_dh,
                 o.to(o_ptr.dtype.element_ty))  # fmt: skip


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _kv_heads(heads, n_heads, n_kv, kv_heads):
    """The needed KV heads; None when each selected query head is its own KV head (multi-head
    attention, unless the caller names them): then program s serves query head heads[s]."""
    if kv_heads is not None:
        return kv_heads.to(heads.dtype)
    if n_heads == n_kv:
        return None
    return torch.unique(heads // (n_heads // n_kv)).to(heads.dtype)


def _q_slot(heads, n_heads):
    """[n_heads] int32: the column block of each query head in qkv, -1 where not selected."""
    q_slot = torch.full((n_heads,), -1, dtype=torch.int32, device=heads.device)
    q_slot[heads.long()] = torch.arange(heads.numel(), dtype=torch.int32, device=heads.device)
    return q_slot


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
    kvh = _kv_heads(heads, n_heads, n_kv, kv_heads)
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


def sparse_attention_core_ref(qkv, k_cache, v_cache, seqlens, heads, *, n_heads, kv_heads=None,
                              scale=None, head_mask=None):  # fmt: skip
    """Plain-PyTorch reference of :func:`sparse_attention_core` (fp32 math); updates the caches.

    >>> H, dh, f16 = 4, 16, torch.float16
    >>> heads = torch.tensor([2, 0])  # q blocks of heads 2, 0; then their K blocks, V blocks
    >>> qkv = torch.randn(1, 6 * dh, dtype=f16)
    >>> kc, vc = torch.zeros(2, 1, H, 8, dh, dtype=f16)  # [B, n_kv, T, d_head] each
    >>> o = sparse_attention_core_ref(qkv, kc, vc, torch.tensor([1]), heads, n_heads=H)
    >>> o.shape, torch.equal(o[0, :dh], qkv[0, 4 * dh : 5 * dh])  # one key: o = its value
    (torch.Size([1, 32]), True)
    """
    batch, n_kv, dh = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    heads_l = heads.long()
    kvh = _kv_heads(heads_l, n_heads, n_kv, kv_heads)
    kvh = heads_l if kvh is None else kvh
    n_q, n_s = heads_l.numel(), kvh.numel()
    blocks = qkv.float().view(batch, n_q + 2 * n_s, dh)
    out = torch.zeros(batch, n_q, dh, dtype=torch.float32, device=qkv.device)
    for bi in range(batch):
        pos = int(seqlens[bi]) - 1
        k_cache[bi, kvh, pos] = blocks[bi, n_q : n_q + n_s].to(k_cache.dtype)
        v_cache[bi, kvh, pos] = blocks[bi, n_q + n_s :].to(v_cache.dtype)
        kk = k_cache[bi, heads_l // group, : pos + 1].float()  # [n_q, pos + 1, dh]
        vv = v_cache[bi, heads_l // group, : pos + 1].float()
        p = torch.softmax((kk @ blocks[bi, :n_q, :, None])[..., 0] * scale, dim=-1)
        out[bi] = (p[:, None, :] @ vv)[:, 0]
    if head_mask is not None:  # heads a sequence skips output zeros (their K/V still written)
        out *= (head_mask != 0).to(out.device)[:, :, None]
    return out.view(batch, n_q * dh).to(qkv.dtype)


def sparse_attention_core(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    heads: torch.Tensor,
    *,
    n_heads: int,
    kv_heads: torch.Tensor | None = None,
    scale: float | None = None,
    head_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Step 2 of :func:`sparse_attention` alone, for a caller that projects (and rotates) itself.

    qkv: [B, (h + 2 n_s) d_head], contiguous rows: the selected query heads' blocks in ``heads``
    order, then the K blocks and the V blocks of the ``n_s`` needed KV heads (``kv_heads``; by
    default ``heads`` when ``n_heads == n_kv``, else the sorted groups of ``heads``). Appends
    each row's K/V at ``seqlens - 1`` and attends over positions ``< seqlens``; returns the
    attention output [B, h d_head] in ``heads`` order (what ``W_O^T``'s selected rows multiply).
    ``head_mask`` [B, h] (bool or int, contiguous rows): per sequence, which of ``heads`` it
    attends; a skipped head's output is zero and a KV head none of whose kept query heads the
    sequence attends has no cache read (its new K/V is still appended). No input checks (the
    engine calls it inside a CUDA graph); ``sparse_attention`` checks.

    >>> _ = torch.manual_seed(0)
    >>> H, dh, f16 = 4, 16, torch.float16
    >>> heads, qkv = torch.tensor([3, 1]), torch.randn(1, 6 * dh, dtype=f16)
    >>> kc, vc = torch.randn(2, 1, H, 8, dh, dtype=f16)
    >>> o = sparse_attention_core(qkv, kc.clone(), vc.clone(), torch.tensor([5]), heads, n_heads=H)
    >>> ref = sparse_attention_core_ref(qkv, kc, vc, torch.tensor([5]), heads, n_heads=H)
    >>> o.shape, torch.allclose(o, ref, atol=1e-2)
    (torch.Size([1, 32]), True)
    >>> kc2, vc2 = kc.repeat(2, 1, 1, 1), vc.repeat(2, 1, 1, 1)  # two sequences, own heads:
    >>> mask = torch.tensor([[True, True], [False, True]])  # the second attends head 1 only
    >>> o2 = sparse_attention_core(qkv.repeat(2, 1), kc2, vc2, torch.tensor([5, 5]), heads,
    ...                            n_heads=H, head_mask=mask)
    >>> torch.allclose(o2[0], o[0], atol=1e-2), o2[1, :dh].abs().max().item()  # head 3: zeros
    (True, 0.0)
    """
    batch, n_kv, t_max, dh = k_cache.shape
    dtype, device = qkv.dtype, qkv.device
    n_q = heads.numel()
    res = out if out is not None else torch.empty((batch, n_q * dh), dtype=dtype, device=device)
    if not use_triton(device):
        res.copy_(sparse_attention_core_ref(qkv, k_cache, v_cache, seqlens, heads,
                                            n_heads=n_heads, kv_heads=kv_heads, scale=scale,
                                            head_mask=head_mask))  # fmt: skip
        return res
    cfg = config or {}
    group = n_heads // n_kv
    kv_heads = _kv_heads(heads, n_heads, n_kv, kv_heads)
    direct = kv_heads is None
    if direct:
        kv_heads, q_slot = heads, heads  # q_slot is not read
    else:
        q_slot = _q_slot(heads, n_heads)
    block_g = next_pow2(group)
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    block_t = cfg.get("BLOCK_T", 64)
    n_kv_sel = kv_heads.numel()
    # flash-decoding: split the context so that about 4 programs per SM stream the cache
    steps = triton.cdiv(max(t_max - 1, 1), block_t)
    want = cfg.get("kv_splits") or triton.cdiv(
        cfg.get("programs", _programs(device)), batch * n_kv_sel
    )
    n_split = max(1, min(steps, want, 64))  # the combine loads every split in one tile
    chunk = triton.cdiv(steps, n_split) * block_t
    n_split = triton.cdiv(max(t_max - 1, 1), chunk)
    has_mask = head_mask is not None
    mask = res if not has_mask else (head_mask.view(torch.uint8)
                                     if head_mask.dtype == torch.bool else head_mask)  # fmt: skip
    stride_mask = mask.stride(0) if has_mask else 0
    part = (
        torch.empty(
            (batch * n_kv_sel * n_split, block_g, dh + 2), dtype=torch.float32, device=device
        )
        if n_split > 1
        else res
    )
    sparse_attention_kernel[(batch, n_kv_sel, n_split)](
        qkv, k_cache, v_cache, seqlens, kv_heads, q_slot, res, n_q, n_kv_sel, qkv.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], res.stride(0), scale * math.log2(math.e),
        chunk, part, mask, stride_mask, GROUP=group, BLOCK_G=block_g, BLOCK_H=max(16, block_g),
        DH=dh, BLOCK_T=block_t, PARTIAL=n_split > 1, DIRECT=direct, HAS_MASK=has_mask,
        UPCAST=upcast_dot(dtype), num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip
    if n_split > 1:
        sparse_attention_combine_kernel[(batch, n_kv_sel, 1 if direct else group)](
            part, kv_heads, q_slot, res, n_kv_sel, n_split, res.stride(0), mask, stride_mask,
            GROUP=group, BLOCK_G=block_g, DH=dh, DIRECT=direct, HAS_MASK=has_mask,
            BLOCK_S=next_pow2(n_split), num_warps=4 if n_split > 16 else 2,
        )  # fmt: skip
    return res
