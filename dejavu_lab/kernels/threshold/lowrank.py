"""R-Sparse's low-rank term for one token, added in place: ``out += U (V x_R)``, ``x_R`` the
entries the threshold drops (``|x_i| <= thr_i``; Zhang et al., ICLR 2025, §3).

Beside TEAL's thresholded product (:func:`~dejavu_lab.kernels.threshold_gemv`, which reads the
columns of the kept entries) the rest of the input goes through a rank-``r`` term. In plain
torch that is six launches per site (the mask's three, two GEMVs, the add); here two:

- :func:`lowrank_partial_kernel` — programs split the input rows of ``v_t = V^T`` [d_in, r]
  in chunks; each masks its chunk of x (only the rows of dropped entries are loaded) and
  writes its partial ``z_s`` [r] (fp32) to a per-device scratch;
- :func:`lowrank_out_kernel` — programs tile the outputs; each sums the partials into ``z``
  and adds ``z @ u_t`` (``u_t = U^T`` [r, d_out]) to ``out`` in place: fp32 sums a fused
  epilogue takes (:func:`~dejavu_lab.kernels.threshold_sums`) or a finished fp16/bf16 output.

No host synchronisation and a launch shape fixed by the tensor shapes: the pair sits inside
the decode step's CUDA graph. Batches of more than one token (and the CPU without
``TRITON_INTERPRET=1``) run :func:`lowrank_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _workspace
from .._common import next_pow2, use_triton

__all__ = ["lowrank_add", "lowrank_out_kernel", "lowrank_partial_kernel", "lowrank_ref"]

CHUNK = 128  # input rows per program of the first kernel
BLOCK_N = 128  # outputs per program of the second
RB = 32  # ranks per step of the second kernel's loop


@triton.jit
def lowrank_partial_kernel(
    x_ptr,  # [K] one token's input
    thr_ptr,  # [K] fp32 thresholds
    v_ptr,  # [K, R] V^T, row-major
    part_ptr,  # fp32 [n_split, BLOCK_R] partials
    K,
    R,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    s = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        kk = s * CHUNK + k0 + tl.arange(0, BLOCK_K)
        mk = kk < K
        x = tl.load(x_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        t = tl.load(thr_ptr + kk, mask=mk, other=0.0)
        drop = mk & (tl.abs(x) <= t)  # the entries the threshold GEMV leaves out
        v = tl.load(v_ptr + kk[:, None] * R + rr[None, :],
                    mask=drop[:, None] & (rr[None, :] < R), other=0.0)  # fmt: skip
        acc += tl.sum(tl.where(drop, x, 0.0)[:, None] * v.to(tl.float32), axis=0)
    tl.store(part_ptr + s * BLOCK_R + rr, acc)


@triton.jit
def lowrank_out_kernel(
    part_ptr,  # fp32 [n_split, BLOCK_R] partials
    u_ptr,  # [R, N] U^T, row-major
    out_ptr,  # [N] added to in place (fp32 sums or the output's dtype)
    R,
    N,
    n_split,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    nn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = nn < N
    ss = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, BLOCK_R, RB):
        r = r0 + tl.arange(0, RB)
        p = tl.load(part_ptr + ss[:, None] * BLOCK_R + r[None, :], mask=ss[:, None] < n_split,
                    other=0.0)  # fmt: skip
        z = tl.sum(p, axis=0)  # [RB] this chunk of V x_R
        u = tl.load(u_ptr + r[:, None] * N + nn[None, :], mask=(r[:, None] < R) & mn[None, :],
                    other=0.0)  # fmt: skip
        acc += tl.sum(z[:, None] * u.to(tl.float32), axis=0)
    o = tl.load(out_ptr + nn, mask=mn, other=0.0).to(tl.float32)
    tl.store(out_ptr + nn, (o + acc).to(out_ptr.dtype.element_ty), mask=mn)


def lowrank_ref(x: torch.Tensor, thr, v_t: torch.Tensor, u_t: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference (fp32): ``(x * (|x| <= thr)) @ v_t @ u_t``, [B, d_out].

    >>> x = torch.tensor([[1.0, 0.25, -0.5, 2.0]])
    >>> lowrank_ref(x, 0.5, torch.ones(4, 2), torch.ones(2, 3))  # 0.25 - 0.5, twice
    tensor([[-0.5000, -0.5000, -0.5000]])
    """
    xf = x.float()
    t = torch.as_tensor(thr, dtype=torch.float32, device=x.device)
    return torch.where(xf.abs() > t, 0.0, xf) @ v_t.float() @ u_t.float()


def lowrank_add(x: torch.Tensor, thr: torch.Tensor, v_t: torch.Tensor, u_t: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``out += (x * (|x| <= thr)) @ v_t @ u_t`` in place, and return ``out``.

    x: [1, d_in] or [d_in] (one token; [B, d_in] runs the reference), thr: fp32 [d_in];
    v_t: [d_in, r] and u_t: [r, d_out] row-major; out: [d_out] or [B, d_out], contiguous (fp32
    sums or fp16/bf16). No input checks beyond shapes (the engine calls it inside a CUDA graph).

    >>> x = torch.randn(1, 300).half()
    >>> v_t, u_t = torch.randn(300, 40).half() / 20, torch.randn(40, 200).half() / 8
    >>> thr = torch.full((300,), 0.7)
    >>> out = torch.zeros(200)  # under TRITON_INTERPRET=1 the Triton kernels on CPU
    >>> torch.allclose(lowrank_add(x, thr, v_t, u_t, out), lowrank_ref(x, thr, v_t, u_t)[0],
    ...                atol=1e-2)
    True
    """
    d_in, r = v_t.shape
    if u_t.shape[0] != r or x.shape[-1] != d_in or out.shape[-1] != u_t.shape[1]:
        raise ValueError(
            f"shapes do not chain: x [..., {x.shape[-1]}], v_t {tuple(v_t.shape)}, u_t "
            f"{tuple(u_t.shape)}, out [..., {out.shape[-1]}]; pass x [d_in], v_t [d_in, r], "
            "u_t [r, d_out], out [d_out]."
        )
    xb = x.reshape(-1, d_in)
    if xb.shape[0] != 1 or not use_triton(x.device) or r == 0:
        return out.add_(lowrank_ref(xb, thr, v_t, u_t).view(out.shape).to(out.dtype))
    n_split = triton.cdiv(d_in, CHUNK)
    block_r = max(RB, next_pow2(r))
    part = _workspace.buffer(x.device, "lowrank", n_split * block_r, torch.float32)
    lowrank_partial_kernel[(n_split,)](xb, thr, v_t, part, d_in, r, CHUNK=CHUNK, BLOCK_K=32,
                                       BLOCK_R=block_r)  # fmt: skip
    n = u_t.shape[1]
    lowrank_out_kernel[(triton.cdiv(n, BLOCK_N),)](
        part, u_t, out, r, n, n_split, BLOCK_S=max(2, next_pow2(n_split)), BLOCK_R=block_r,
        RB=RB, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
