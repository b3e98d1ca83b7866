"""Rotary position embedding of the query and key blocks of a decode step, in place, one launch.

RoPE (Su et al. 2021) in Hugging Face's half-split form rotates each query/key head of a token
at its position: ``y = x * cos[p] + rotate_half(x) * sin[p]``. In PyTorch that is a gather of
the cos/sin rows and about six elementwise kernels per layer (chunk, negate, cat, two products,
a sum, the write back); here it is one program per (token, rotated head), reading the cos/sin
table at each token's position from a device tensor, so a CUDA graph replays it at any position.
The engine's dense and thresholded attention blocks use it (the kept-heads block fuses the
rotation into its projection instead: :mod:`~dejavu_lab.kernels.rope.qkv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import use_triton
from ..pdl import await_inputs, pdl_args

__all__ = ["rope_", "rope_kernel", "rope_ref"]


@triton.jit
def rope_kernel(
    qkv_ptr,  # [B, n_blocks * DH] heads of each token; blocks 0 .. n_rot-1 are rotated
    cos_ptr,  # [T, DH] cos table
    sin_ptr,  # [T, DH] sin table
    pos_ptr,  # [B] position of each token
    stride_b,
    stride_cos,
    stride_sin,
    DH: tl.constexpr,
    HALF: tl.constexpr,  # DH // 2
    BLOCK: tl.constexpr,  # next power of two >= HALF
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    p = tl.load(pos_ptr + b).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = qkv_ptr + b.to(tl.int64) * stride_b + j.to(tl.int64) * DH
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + p * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + p * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + p * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + p * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    ty = qkv_ptr.dtype.element_ty
    tl.store(row + offs, (x1 * c1 - x2 * s1).to(ty), mask=mask)
    tl.store(row + HALF + offs, (x2 * c2 + x1 * s2).to(ty), mask=mask)


def rope_ref(qkv, cos, sin, positions, *, n_rot: int) -> torch.Tensor:
    """Plain-PyTorch reference (fp32 math): the first ``n_rot`` blocks rotated, a new tensor.

    >>> qkv = torch.tensor([[1.0, 0.0, 5.0, 5.0]])  # one token, 2 blocks of d_head = 2
    >>> cos, sin = torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    >>> rope_ref(qkv, cos, sin, torch.tensor([1]), n_rot=1)  # position 1: a quarter turn
    tensor([[0., 1., 5., 5.]])
    """
    dh = cos.shape[-1]
    b = qkv.shape[0]
    blocks = qkv.float().view(b, -1, dh)
    x = blocks[:, :n_rot]
    c, s = cos[positions.long()].float()[:, None], sin[positions.long()].float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * c + torch.cat((-x2, x1), dim=-1) * s
    out = torch.cat((rotated, blocks[:, n_rot:]), dim=1)
    return out.reshape(b, -1).to(qkv.dtype)


def rope_(qkv, cos, sin, positions, *, n_rot: int) -> torch.Tensor:
    """Rotate the first ``n_rot`` d_head-blocks of each row of ``qkv`` in place; returns qkv.

    qkv: [B, n_blocks * d_head] contiguous rows (query heads, then key heads, then values:
    ``n_rot = n_heads + n_kv_heads``); cos, sin: [T, d_head] tables (HF's rotary embedding at
    positions 0..T-1); positions: [B] int device tensor. No input checks (the engine calls it
    inside a CUDA graph); fp16/bf16 run the Triton kernel on CUDA (or under the interpreter),
    anything else the reference.

    >>> _ = torch.manual_seed(0)
    >>> qkv = torch.randn(2, 3 * 16, dtype=torch.float16)  # 2 tokens: q, k, v of d_head 16
    >>> ang = torch.arange(8.0)[:, None] * torch.linspace(0.1, 1, 8).repeat(2)[None]
    >>> cos, sin = ang.cos().half(), ang.sin().half()  # [T = 8, 16]
    >>> pos = torch.tensor([3, 5])
    >>> ref = rope_ref(qkv, cos, sin, pos, n_rot=2)
    >>> torch.allclose(rope_(qkv, cos, sin, pos, n_rot=2), ref, atol=1e-3)
    True
    """
    if qkv.numel() == 0 or n_rot == 0:
        return qkv
    fast = qkv.dtype in (torch.float16, torch.bfloat16) and use_triton(qkv.device)
    if not fast:
        qkv.copy_(rope_ref(qkv, cos, sin, positions, n_rot=n_rot))
        return qkv
    dh = cos.shape[-1]
    half = dh // 2
    rope_kernel[(qkv.shape[0], n_rot)](
        qkv, cos, sin, positions, qkv.stride(0), cos.stride(0), sin.stride(0),
        DH=dh, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1, **pdl_args(qkv.device),
    )  # fmt: skip
    return qkv
