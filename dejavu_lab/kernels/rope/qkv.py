"""The kept heads' QKV projection with RoPE and the KV-cache write fused, one launch per layer.

Deja Vu's sparse attention block (§4.2, §4.4) starts with a gather-GEMV over the kept heads'
rows of ``W_QKV`` for a union batch (this token, or the deferred-KV window's last ``W`` tokens);
the query and key heads are then rotated (RoPE, HF's half-split form) and, with deferred KV, the
kept heads' keys and values over the window are written to the cache. Unfused that is one
gather-GEMV, a cos/sin gather, ~6 elementwise kernels and a scatter per layer — launches that
cost more than their bytes at d = 4-5k. Here one program computes rows ``r`` and ``r + d_head/2``
of one kept block (the pair RoPE mixes) for every token of the batch, rotates them at each
token's position (read from a device tensor: replayable in a CUDA graph), writes the projected
row and, when caches are given, the key or value into the cache at that position.

Blocks are indices into ``W_QKV``'s head blocks: query heads ``0..H-1``, key heads
``H..H+Hkv-1``, value heads ``H+Hkv..H+2Hkv-1`` — what the engine's kept sets already hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import (
    as_batch,
    batch_block,
    check_device,
    check_float,
    check_rowmajor,
    dot_acc,
    next_pow2,
    upcast_dot,
    use_triton,
)

__all__ = ["qkv_rope", "qkv_rope_kernel", "qkv_rope_ref"]


@triton.jit
def qkv_rope_kernel(
    x_ptr,  # [B, D] tokens' attention inputs
    w_ptr,  # [(H + 2 HKV) * DH, D] W_QKV, row-major
    b_ptr,  # [(H + 2 HKV) * DH] its bias (optional)
    blk_ptr,  # [NB] head blocks of W_QKV to project
    cos_ptr,  # [T, DH]
    sin_ptr,  # [T, DH]
    pos_ptr,  # [B] position of each token
    kc_ptr,  # [HKV, T, DH] key cache of the layer (optional)
    vc_ptr,  # [HKV, T, DH] value cache (optional)
    out_ptr,  # [B, NB * DH] projected (and rotated) blocks in blk order
    B,
    D,
    H,
    HKV,
    stride_xb,
    stride_w,
    stride_ob,
    stride_cos,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    DH: tl.constexpr,
    HALF: tl.constexpr,  # DH // 2
    HAS_BIAS: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_R: tl.constexpr,  # rows of each half per program
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    j = tl.program_id(0)  # output block
    c = tl.program_id(1)  # chunk of the block's first half
    blk = tl.load(blk_ptr + j).to(tl.int64)
    offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < HALF
    rows1 = blk * DH + offs_r
    rows2 = rows1 + HALF
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    offs_k = tl.arange(0, BLOCK_D)
    w1_rows = w_ptr + rows1[:, None] * stride_w
    w2_rows = w_ptr + rows2[:, None] * stride_w
    if BLOCK_B == 1:
        acc1 = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        acc2 = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + offs_k
            mask_d = offs_d < D
            m = mask_r[:, None] & mask_d[None, :]
            w1 = tl.load(
                w1_rows + offs_d[None, :], mask=m, other=0.0, eviction_policy="evict_first"
            )
            w2 = tl.load(
                w2_rows + offs_d[None, :], mask=m, other=0.0, eviction_policy="evict_first"
            )
            xv = tl.load(x_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
            acc1 += w1.to(tl.float32) * xv
            acc2 += w2.to(tl.float32) * xv
        y1 = tl.sum(acc1, axis=1)[:, None]  # [BLOCK_R, 1]
        y2 = tl.sum(acc2, axis=1)[:, None]
    else:
        acc1 = tl.zeros((BLOCK_R, BLOCK_B), tl.float32)
        acc2 = tl.zeros((BLOCK_R, BLOCK_B), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + offs_k
            mask_d = offs_d < D
            m = mask_r[:, None] & mask_d[None, :]
            w1 = tl.load(w1_rows + offs_d[None, :], mask=m, other=0.0)
            w2 = tl.load(w2_rows + offs_d[None, :], mask=m, other=0.0)
            xt = tl.load(x_ptr + offs_b[:, None] * stride_xb + offs_d[None, :],
                         mask=mask_b[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
            acc1 = dot_acc(w1, tl.trans(xt), acc1, UPCAST)
            acc2 = dot_acc(w2, tl.trans(xt), acc2, UPCAST)
        y1 = acc1  # [BLOCK_R, BLOCK_B]
        y2 = acc2
    if HAS_BIAS:
        y1 += tl.load(b_ptr + rows1, mask=mask_r, other=0.0).to(tl.float32)[:, None]
        y2 += tl.load(b_ptr + rows2, mask=mask_r, other=0.0).to(tl.float32)[:, None]
    p = tl.load(pos_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)  # [BLOCK_B]
    m2 = mask_r[:, None] & mask_b[None, :]
    if ROPE:  # queries and keys turn at their token's position; values stay
        tab = p[None, :] * stride_cos + offs_r[:, None]
        c1 = tl.load(cos_ptr + tab, mask=m2, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tab + HALF, mask=m2, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tab, mask=m2, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tab + HALF, mask=m2, other=0.0).to(tl.float32)
        rot = blk < H + HKV
        r1 = y1 * c1 - y2 * s1
        r2 = y2 * c2 + y1 * s2
        y1 = tl.where(rot, r1, y1)
        y2 = tl.where(rot, r2, y2)
    ty = out_ptr.dtype.element_ty
    o = out_ptr + offs_b[None, :] * stride_ob + (j * DH + offs_r)[:, None]
    tl.store(o, y1.to(ty), mask=m2)
    tl.store(o + HALF, y2.to(ty), mask=m2)
    if WRITE_KV:
        if blk >= H + HKV:  # a value head
            cv = vc_ptr + (blk - H - HKV) * stride_vh + p[None, :] * stride_vt + offs_r[:, None]
            tl.store(cv, y1.to(vc_ptr.dtype.element_ty), mask=m2)
            tl.store(cv + HALF, y2.to(vc_ptr.dtype.element_ty), mask=m2)
        elif blk >= H:  # a key head
            ck = kc_ptr + (blk - H) * stride_kh + p[None, :] * stride_kt + offs_r[:, None]
            tl.store(ck, y1.to(kc_ptr.dtype.element_ty), mask=m2)
            tl.store(ck + HALF, y2.to(kc_ptr.dtype.element_ty), mask=m2)


def qkv_rope_ref(x, w_qkv, blocks, *, n_heads, n_kv_heads, positions, bias=None, cos=None,
                 sin=None, k_cache=None, v_cache=None):  # fmt: skip
    """Plain-PyTorch reference (fp32 math); writes the caches in place when given.

    >>> w = torch.eye(4).repeat(3, 1)  # H = Hkv = 1, d_head = d = 4: q = k = v = x
    >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    >>> cos, sin = torch.zeros(2, 4), torch.ones(2, 4)  # a quarter turn at every position
    >>> qkv_rope_ref(x, w, torch.tensor([0, 2]), n_heads=1, n_kv_heads=1,
    ...              positions=torch.tensor([1]), cos=cos, sin=sin)  # q rotated; v as is
    tensor([[-3., -4.,  1.,  2.,  1.,  2.,  3.,  4.]])
    """
    xb = x if x.dim() == 2 else x[None]
    dh = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    blocks = blocks.long()
    rows = (blocks[:, None] * dh + torch.arange(dh, device=x.device)).reshape(-1)
    y = xb.float() @ w_qkv[rows].float().T
    if bias is not None:
        y = y + bias[rows].float()
    y = y.view(xb.shape[0], -1, dh)
    pos = positions.long()
    if cos is not None:
        c, s = cos[pos].float()[:, None], sin[pos].float()[:, None]
        y1, y2 = y.chunk(2, dim=-1)
        turned = y * c + torch.cat((-y2, y1), dim=-1) * s
        y = torch.where((blocks < n_heads + n_kv_heads)[None, :, None], turned, y)
    y = y.to(x.dtype)
    if k_cache is not None:
        for cache, lo in ((k_cache, n_heads), (v_cache, n_heads + n_kv_heads)):
            sel = ((blocks >= lo) & (blocks < lo + n_kv_heads)).nonzero().flatten()
            where = ((blocks[sel] - lo)[:, None], pos[None, :])
            cache.index_put_(where, y[:, sel].transpose(0, 1).to(cache.dtype))
    y = y.reshape(xb.shape[0], -1)
    return y if x.dim() == 2 else y[0]


def default_config(batch: int, d: int, d_head: int) -> dict:
    """Tiles (untuned: any valid choice computes the same thing; these decide the speed).

    >>> default_config(1, 5120, 128)
    {'BLOCK_R': 16, 'BLOCK_D': 256, 'num_warps': 4}
    >>> default_config(16, 5120, 128)["BLOCK_R"]  # tensor-core path: rows padded to 16
    16
    """
    half = d_head // 2
    if batch == 1:
        # two [BLOCK_R, BLOCK_D] fp32 accumulators: 64 registers a thread at 4 warps
        return {"BLOCK_R": min(16, next_pow2(half)), "BLOCK_D": min(256, max(16, next_pow2(d))),
                "num_warps": 4}  # fmt: skip
    return {"BLOCK_R": 16, "BLOCK_D": min(64, max(16, next_pow2(d))), "num_warps": 4}


def qkv_rope(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    blocks: torch.Tensor,
    *,
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor,
    bias: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Head blocks ``blocks`` of ``x @ W_QKV^T + b``, queries and keys rotated at ``positions``,
    keys and values written to the caches at those positions when caches are given.

    x: [d] or [B, d] (B <= 32, fp16/bf16); w_qkv: [(H + 2 Hkv) d_head, d] row-major; blocks:
    [nb] int head blocks (see module doc); positions: [B] int device tensor; cos, sin: [T,
    d_head] (None: no rotation, OPT); k_cache, v_cache: [Hkv, T, d_head], last dim contiguous.
    Returns [nb d_head] or [B, nb d_head] in ``blocks`` order. Shapes and dtypes are checked,
    index values are not (the engine calls it inside a CUDA graph).

    >>> _ = torch.manual_seed(0)
    >>> H, Hkv, dh, d, f16 = 4, 2, 16, 32, torch.float16
    >>> w = torch.randn((H + 2 * Hkv) * dh, d, dtype=f16) / 4
    >>> x, blocks = torch.randn(2, d, dtype=f16), torch.tensor([3, 1, 4, 5, 6, 7])
    >>> ang = torch.arange(8.0)[:, None] * torch.linspace(0.1, 1, dh // 2).repeat(2)[None]
    >>> cos, sin, pos = ang.cos().half(), ang.sin().half(), torch.tensor([5, 6])
    >>> kc, vc = torch.zeros(2, Hkv, 8, dh, dtype=f16)
    >>> y = qkv_rope(x, w, blocks, n_heads=H, n_kv_heads=Hkv, positions=pos, cos=cos, sin=sin,
    ...              k_cache=kc, v_cache=vc)
    >>> ref = qkv_rope_ref(x, w, blocks, n_heads=H, n_kv_heads=Hkv, positions=pos, cos=cos,
    ...                    sin=sin)
    >>> torch.allclose(y, ref, atol=1e-2), torch.equal(kc[1, 5:7], y[:, 48:64])  # key head 1
    (True, True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_device(device, w_qkv=w_qkv, blocks=blocks, positions=positions, bias=bias, cos=cos,
                 sin=sin, k_cache=k_cache, v_cache=v_cache)  # fmt: skip
    check_float("w_qkv", w_qkv, dtype)
    check_rowmajor("w_qkv", w_qkv)
    n_blocks = n_heads + 2 * n_kv_heads
    if w_qkv.shape[0] % n_blocks:
        raise ValueError(f"w_qkv has {w_qkv.shape[0]} rows, not a multiple of {n_blocks} heads.")
    dh, d = w_qkv.shape[0] // n_blocks, w_qkv.shape[1]
    if dh % 2:
        raise ValueError(f"d_head = {dh} is odd; RoPE pairs its two halves.")
    xb, squeeze = as_batch("x", x, d)
    batch, nb = xb.shape[0], blocks.numel()
    if positions.numel() != batch:
        raise ValueError(f"positions has {positions.numel()} entries for a batch of {batch}.")
    if (cos is None) != (sin is None) or (k_cache is None) != (v_cache is None):
        raise ValueError("pass cos with sin, and k_cache with v_cache (or neither).")
    for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None and (t.shape[-1] != dh or t.stride(-1) != 1):
            raise ValueError(f"{name} must end in a contiguous d_head = {dh} dimension.")
    if cos is not None and sin.stride() != cos.stride():
        raise ValueError("sin must have cos's shape and strides (both [T, d_head]).")
    shape = (batch, nb * dh)
    res = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    if not use_triton(device):
        res.copy_(qkv_rope_ref(xb, w_qkv, blocks, n_heads=n_heads, n_kv_heads=n_kv_heads,
                               positions=positions, bias=bias, cos=cos, sin=sin,
                               k_cache=k_cache, v_cache=v_cache))  # fmt: skip
        return res[0] if squeeze else res
    if nb:
        cfg = {**default_config(batch, d, dh), **(config or {})}
        half = dh // 2
        kc = k_cache if k_cache is not None else res
        vc = v_cache if v_cache is not None else res
        kst = (kc.stride(0), kc.stride(1)) if k_cache is not None else (0, 0)
        vst = (vc.stride(0), vc.stride(1)) if v_cache is not None else (0, 0)
        grid = (nb, triton.cdiv(half, cfg["BLOCK_R"]))
        qkv_rope_kernel[grid](
            xb, w_qkv, bias if bias is not None else w_qkv, blocks,
            cos if cos is not None else res, sin if sin is not None else res, positions, kc, vc,
            res, batch, d, n_heads, n_kv_heads, xb.stride(0), w_qkv.stride(0), res.stride(0),
            cos.stride(0) if cos is not None else 0, *kst, *vst, DH=dh, HALF=half,
            HAS_BIAS=bias is not None, ROPE=cos is not None, WRITE_KV=k_cache is not None,
            BLOCK_B=batch_block(batch), BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
            UPCAST=upcast_dot(dtype), num_warps=cfg["num_warps"],
        )  # fmt: skip
    return res[0] if squeeze else res
