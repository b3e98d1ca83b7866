"""The attention core of one decoding step: append this token's K/V, attend the kept heads.

:func:`sparse_attention_core` is step 2 of :func:`~dejavu_lab.kernels.attention.sparse.sparse_attention` (Deja Vu
§4.2, Appendix E), on its own for callers that project and rotate Q/K/V themselves (the
engine). ``sparse_attention_kernel`` runs one program per (sequence, needed KV head, context
split): the query heads of the KV head's group are one tensor-core tile against the cache, so
each cached key and value is read once for the whole group (online softmax, fp32). The new
token's key and value are appended at ``seqlens - 1`` by the first split, which attends them
from registers. With several splits (flash-decoding) ``sparse_attention_combine_kernel`` merges
the splits' softmax states.

Per-sequence heads: ``head_mask`` [B, h] says which of the ``heads`` sequence b attends. A
program whose sequence keeps none of its KV head's query heads reads no cache (it still appends
the new key/value), and a head a sequence skips outputs zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._common import dot_acc, next_pow2, upcast_dot, use_triton
from ..pdl import await_inputs, pdl_args

__all__ = [
    "sparse_attention_combine_kernel",
    "sparse_attention_core",
    "sparse_attention_core_ref",
    "sparse_attention_kernel",
    "needed_kv_heads",
    "query_slots",
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
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    """One (sequence, KV head, context split): the group's query heads against the cache.

    The group's query heads are one [BLOCK_H, DH] tile (padded to 16 rows) and every step is
    two tensor-core products, ``q @ K^T`` and ``p @ V``, over ``BLOCK_T`` cached positions, so
    each key and value is read once for the whole group and the loads pipeline through shared
    memory (an FMA broadcast over [group, BLOCK_T, DH] kept too few bytes in flight)."""
    if PDL:
        await_inputs(PDL)
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
    q = tl.load(
        row + slot[:, None].to(tl.int64) * DH + offs_dh[None, :], mask=sel[:, None], other=0.0
    )  # [BLOCK_H, DH] in the model's dtype
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
        k_t = tl.load(
            kc + offs_dh[:, None] + t64[None, :] * stride_kt, mask=mask_t[None, :], other=0.0
        )  # [DH, BLOCK_T]: K transposed
        v = tl.load(
            vc + t64[:, None] * stride_vt + offs_dh[None, :], mask=mask_t[:, None], other=0.0
        )
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
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    """Merge the splits' online-softmax states: o = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.

    One program per (sequence, KV head, query head of its group); every split's state is loaded
    in one [BLOCK_S, DH] tile, so the loads are issued together rather than one split at a time
    (a loop over 40 splits was a chain of 80 dependent loads: 16 us per layer at Llama-3-8B)."""
    if PDL:
        await_inputs(PDL)
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
        tl.store(
            o_ptr + b * stride_o + slot.to(tl.int64) * DH + offs_dh, o.to(o_ptr.dtype.element_ty)
        )


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def needed_kv_heads(heads, n_heads, n_kv, kv_heads):
    """The needed KV heads; None when each selected query head is its own KV head (multi-head
    attention, unless the caller names them): then program s serves query head heads[s].

    >>> needed_kv_heads(torch.tensor([0, 1, 5]), 8, 2, None)  # 4 query heads per KV head
    tensor([0, 1])
    """
    if kv_heads is not None:
        return kv_heads.to(heads.dtype)
    if n_heads == n_kv:
        return None
    return torch.unique(heads // (n_heads // n_kv)).to(heads.dtype)


def query_slots(heads: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads] int32: the column block of each query head in qkv, -1 where not selected.

    >>> query_slots(torch.tensor([3, 1]), 4).tolist()
    [-1, 1, -1, 0]
    """
    q_slot = torch.full((n_heads,), -1, dtype=torch.int32, device=heads.device)
    q_slot[heads.long()] = torch.arange(heads.numel(), dtype=torch.int32, device=heads.device)
    return q_slot


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
    kvh = needed_kv_heads(heads_l, n_heads, n_kv, kv_heads)
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
    q_slot: torch.Tensor | None = None,
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
    engine calls it inside a CUDA graph); ``sparse_attention`` checks. ``q_slot``: the
    [n_heads] int32 column block of each query head (:func:`query_slots`) for a caller whose
    ``heads`` never change: with grouped KV heads it is otherwise rebuilt on every call (three
    small launches: 75 µs of a Llama-3-8B step, ``results/engine_profile.json``).

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
    kv_heads = needed_kv_heads(heads, n_heads, n_kv, kv_heads)
    direct = kv_heads is None
    if direct:
        kv_heads, q_slot = heads, heads  # q_slot is not read
    elif q_slot is None:
        q_slot = query_slots(heads, n_heads)
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
        num_stages=cfg.get("num_stages", 2), **pdl_args(device),
    )  # fmt: skip
    if n_split > 1:
        sparse_attention_combine_kernel[(batch, n_kv_sel, 1 if direct else group)](
            part, kv_heads, q_slot, res, n_kv_sel, n_split, res.stride(0), mask, stride_mask,
            GROUP=group, BLOCK_G=block_g, DH=dh, DIRECT=direct, HAS_MASK=has_mask,
            BLOCK_S=next_pow2(n_split), num_warps=4 if n_split > 16 else 2, **pdl_args(device),
        )  # fmt: skip
    return res
