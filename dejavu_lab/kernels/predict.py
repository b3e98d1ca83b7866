"""DejaVu's lookahead predictors in two launches: the scores of every neuron and every head.

Each layer's two predictors (§4.1–4.3; :class:`~dejavu_lab.predictors.model.LowRank`) read the
same input: ``up(down(x / rms(x)))`` with a bias on ``up``, fp32 throughout. Run as PyTorch ops
on a decode step's side stream that is about ten launches per layer (a cast, an RMS norm, the
``d -> r`` GEMV, a slice, two ``r -> n`` GEMVs with their biases), each a few microseconds on an
H100 and the norm alone about 14 (one block for one row: ``kernels/profile_engine.py
--predictors``), a chain nearly as long as the layer it should hide behind.

Here :func:`predictor_down_kernel` computes both predictors' ``d -> r`` products for a tile of
their stacked rows, the RMS norm of x accumulated in the same loop (it only scales each dot
product), and :func:`predictor_up_kernel` the ``r -> n`` scores of the neurons and, in its last
programs, of the heads, bias added. Same function as the modules, to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2, use_triton

__all__ = ["predictor_down_kernel", "predictor_scores", "predictor_scores_ref",
           "predictor_up_kernel"]  # fmt: skip

EPS = 1e-6  # LowRank's RMS norm


@triton.jit
def predictor_down_kernel(
    x_ptr,  # [B, d] the layer inputs (any float dtype)
    w_ptr,  # [R, d] fp32: both predictors' down weights, stacked
    z_ptr,  # [B, R] fp32 out: down(x / rms(x))
    R,
    d,
    stride_xb,
    stride_zb,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_r = tl.program_id(0)
    b = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    ss = tl.zeros((BLOCK_D,), tl.float32)
    for k0 in range(0, d, BLOCK_D):
        offs_d = k0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < d
        x = tl.load(x_ptr + b * stride_xb + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_r[:, None].to(tl.int64) * d + offs_d[None, :],
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        acc += w * x[None, :]
        ss += x * x
    scale = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / d + eps)
    tl.store(z_ptr + b * stride_zb + offs_r, tl.sum(acc, axis=1) * scale, mask=mask_r)


@triton.jit
def predictor_up_kernel(
    z_ptr,  # [B, R] fp32: the neurons' r_n entries, then the heads' r_h
    wn_ptr,  # [n, r_n] fp32
    bn_ptr,  # [n] fp32
    wh_ptr,  # [H, r_h] fp32
    bh_ptr,  # [H] fp32
    sn_ptr,  # [B, n] fp32 out: the neurons' scores
    sh_ptr,  # [B, H] fp32 out: the heads'
    n,
    H,
    r_n,
    r_h,
    stride_zb,
    stride_snb,
    stride_shb,
    PROGS_N: tl.constexpr,  # programs over the neurons; the rest take the heads
    BLOCK_N: tl.constexpr,
    BLOCK_RN: tl.constexpr,  # next_pow2(r_n)
    BLOCK_RH: tl.constexpr,  # next_pow2(r_h)
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    if pid < PROGS_N:
        _scores(z_ptr + b * stride_zb, wn_ptr, bn_ptr, sn_ptr + b * stride_snb, pid, n, r_n,
                BLOCK_N, BLOCK_RN)  # fmt: skip
    else:
        _scores(z_ptr + b * stride_zb + r_n, wh_ptr, bh_ptr, sh_ptr + b * stride_shb,
                pid - PROGS_N, H, r_h, BLOCK_N, BLOCK_RH)  # fmt: skip


@triton.jit
def _scores(z_ptr, w_ptr, b_ptr, s_ptr, tile, n, r, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Scores ``tile * BLOCK_N ...`` of one predictor: ``w [n, r] @ z [r] + b``."""
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m, mr = offs < n, offs_r < r
    z = tl.load(z_ptr + offs_r, mask=mr, other=0.0)
    w = tl.load(w_ptr + offs[:, None].to(tl.int64) * r + offs_r[None, :],
                mask=m[:, None] & mr[None, :], other=0.0)  # fmt: skip
    tl.store(s_ptr + offs, tl.sum(w * z[None, :], axis=1) + tl.load(b_ptr + offs, mask=m, other=0.0),
             mask=m)  # fmt: skip


def predictor_scores_ref(x, down, wn, bn, wh, bh):
    """The modules' function in PyTorch: (neuron scores [B, n], head scores [B, H]), fp32.

    >>> x, down = torch.ones(1, 4), torch.ones(3, 4)  # r_n = 2, r_h = 1
    >>> predictor_scores_ref(x, down, torch.ones(5, 2), torch.zeros(5), torch.ones(2, 1),
    ...                      torch.ones(2))[1].tolist()
    [[5.0, 5.0]]
    """
    z = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=EPS) @ down.t()
    r = wn.shape[1]
    return torch.nn.functional.linear(z[:, :r], wn, bn), torch.nn.functional.linear(
        z[:, r:], wh, bh
    )


def predictor_scores(x: torch.Tensor, down: torch.Tensor, wn: torch.Tensor, bn: torch.Tensor,
                     wh: torch.Tensor, bh: torch.Tensor, z: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
    """Both predictors' scores at x [B, d]: ``down`` [r_n + r_h, d] (the neurons' rows first),
    ``wn`` [n, r_n], ``bn`` [n], ``wh`` [H, r_h], ``bh`` [H], all fp32 and contiguous; ``z``
    [B, r_n + r_h] and ``out`` ([B, n], [B, H]) fp32 buffers to reuse (a CUDA graph's).
    Two launches (or :func:`predictor_scores_ref` on the CPU without the interpreter).

    >>> x = torch.randn(2, 64)
    >>> w = [torch.randn(*s) for s in ((12, 64), (100, 8), (100,), (4, 4), (4,))]
    >>> n, h = predictor_scores(x, *w)
    >>> all(torch.allclose(a, b, atol=1e-4) for a, b in zip((n, h), predictor_scores_ref(x, *w)))
    True
    """
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; pass [B, d].")
    B, d = x.shape
    (n, r_n), (H, r_h) = wn.shape, wh.shape
    for name, t, shape in (("down", down, (r_n + r_h, d)), ("wn", wn, (n, r_n)), ("bn", bn, (n,)),
                           ("wh", wh, (H, r_h)), ("bh", bh, (H,))):  # fmt: skip
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}; "
                             f"got {tuple(t.shape)} {t.dtype}.")  # fmt: skip
    check_device(x.device, down=down, wn=wn, bn=bn, wh=wh, bh=bh)
    if not use_triton(x.device):
        sn, sh = predictor_scores_ref(x, down, wn, bn, wh, bh)
        if out is None:
            return sn, sh
        out[0].copy_(sn)
        out[1].copy_(sh)
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    R = r_n + r_h
    if z is None:
        z = torch.empty(B, R, dtype=torch.float32, device=x.device)
    sn, sh = out if out is not None else (torch.empty(B, n, device=x.device),
                                          torch.empty(B, H, device=x.device))  # fmt: skip
    block_r = 4
    predictor_down_kernel[(triton.cdiv(R, block_r), B)](
        x, down, z, R, d, x.stride(0), z.stride(0), EPS, BLOCK_R=block_r, BLOCK_D=512,
        num_warps=4,
    )  # fmt: skip
    block_n = 128
    progs_n, progs_h = triton.cdiv(n, block_n), triton.cdiv(H, block_n)
    predictor_up_kernel[(progs_n + progs_h, B)](
        z, wn, bn, wh, bh, sn, sh, n, H, r_n, r_h, z.stride(0), sn.stride(0), sh.stride(0),
        PROGS_N=progs_n, BLOCK_N=block_n, BLOCK_RN=next_pow2(r_n), BLOCK_RH=next_pow2(r_h),
        num_warps=4,
    )  # fmt: skip
    return sn, sh
