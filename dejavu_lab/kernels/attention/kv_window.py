"""Write the kept heads' keys and values of the deferred-KV window into the cache, in one launch.

Deja Vu §4.2: a head skipped for a token writes no K/V for it; when the head is next kept,
its K/V over the recent tokens are computed then. The engine projects the kept heads' K/V for
the whole window (the last ``W`` tokens) in one gather-GEMV and must scatter them to cache
positions ``base .. base + W - 1`` of each kept head. In PyTorch that is two ``index_put_`` with
broadcast (head, position) indices: about six small kernels per layer; here it is one program
per (window row, kept head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import use_triton

__all__ = ["kv_window_write", "kv_window_write_kernel", "kv_window_write_ref"]


@triton.jit
def kv_window_write_kernel(
    qkv_ptr,  # [W, (n_q + 2 n_s) * DH] projected rows: q blocks, then K blocks, then V blocks
    kc_ptr,  # [H_kv, T, DH] key cache of one layer
    vc_ptr,  # [H_kv, T, DH] value cache
    heads_ptr,  # [n_s] KV head of each K/V block
    base_ptr,  # [1] cache position of window row 0
    n_q,
    n_s,
    stride_qkv,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    DH: tl.constexpr,
):
    r = tl.program_id(0)  # window row
    j = tl.program_id(1)  # K/V block
    h = tl.load(heads_ptr + j).to(tl.int64)
    t = (tl.load(base_ptr) + r).to(tl.int64)
    offs = tl.arange(0, DH)
    row = qkv_ptr + r.to(tl.int64) * stride_qkv
    k = tl.load(row + (n_q + j) * DH + offs)
    v = tl.load(row + (n_q + n_s + j) * DH + offs)
    tl.store(kc_ptr + h * stride_kh + t * stride_kt + offs, k.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + h * stride_vh + t * stride_vt + offs, v.to(vc_ptr.dtype.element_ty))


def kv_window_write_ref(qkv, k_cache, v_cache, heads, base, *, n_q: int) -> None:
    """PyTorch reference: the same writes with ``index_put_``.

    >>> dh, qkv = 16, torch.arange(2 * 3 * 16.0).view(2, 48)  # 2 rows: 1 q, 1 K, 1 V block
    >>> kc, vc = torch.zeros(2, 2, 4, dh)  # [n_kv, T, d_head] each
    >>> kv_window_write_ref(qkv, kc, vc, torch.tensor([1]), torch.tensor([2]), n_q=1)
    >>> kc[1, 2:, 0].tolist(), vc[1, 2:, 0].tolist()  # head 1, positions 2 and 3
    ([16.0, 64.0], [32.0, 80.0])
    """
    rows, n_s = qkv.shape[0], heads.numel()
    dh = k_cache.shape[-1]
    blocks = qkv.view(rows, -1, dh)
    where = (heads.long()[:, None], base.long() + torch.arange(rows, device=qkv.device)[None, :])
    k_cache.index_put_(where, blocks[:, n_q : n_q + n_s].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_put_(where, blocks[:, n_q + n_s :].transpose(0, 1).to(v_cache.dtype))


def kv_window_write(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: torch.Tensor,
    base: torch.Tensor,
    *,
    n_q: int,
) -> None:
    """K/V blocks of every row of ``qkv`` into the caches at positions ``base + row``.

    qkv: [W, (n_q + 2 n_s) d_head] with contiguous rows (``n_q`` query blocks, then the K and
    the V blocks of ``heads``); k_cache, v_cache: [n_kv, T, d_head] with a contiguous last
    dimension; heads: [n_s] KV heads; base: [1] int tensor (a device tensor, so a CUDA graph
    can replay the write at a new position). No input checks: the engine calls it in a graph.

    >>> dh, qkv = 16, torch.randn(3, 5 * 16, dtype=torch.float16)  # 1 q + 2 K + 2 V blocks
    >>> kc, vc = torch.zeros(2, 4, 8, dh, dtype=torch.float16)
    >>> heads, base = torch.tensor([3, 0]), torch.tensor([4])
    >>> kv_window_write(qkv, kc, vc, heads, base, n_q=1)
    >>> torch.equal(kc[3, 4:7], qkv[:, 16:32]), torch.equal(vc[0, 4:7], qkv[:, 64:80])
    (True, True)
    """
    if not use_triton(qkv.device):
        kv_window_write_ref(qkv, k_cache, v_cache, heads, base, n_q=n_q)
        return
    n_s, dh = heads.numel(), k_cache.shape[-1]
    if qkv.shape[0] == 0 or n_s == 0:
        return
    kv_window_write_kernel[(qkv.shape[0], n_s)](
        qkv, k_cache, v_cache, heads, base, n_q, n_s, qkv.stride(0), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), DH=dh, num_warps=1,
    )  # fmt: skip
