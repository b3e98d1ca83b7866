"""The decode step's epilogues with a threshold GEMV's sums finished inside them: RoPE after
q/k/v, and the residual add with the next norm after o and down.

The batch-1 threshold GEMV (:mod:`~dejavu_lab.kernels.threshold.tile`) leaves its output as fp32 sums in a
workspace, and a finalize launch turns them into the output dtype (plus the bias). At
Llama-2-13B with TEAL at 50% those finalizes cost 0.26 ms of a 4.4 ms step on an H200
(``results/engine_profile.json``): 160 launches of ~1.6 µs, each followed by the op that reads
its output, a rotation or a residual add and a norm of one row. Here the op reads the sums
itself and leaves zeros behind:

- :func:`rope_sums`: ``qkv = rope(sums + bias)`` for the query and key blocks, the value
  blocks copied: one launch instead of finalize + :func:`~dejavu_lab.kernels.rope.rotate.rope_`;
- :func:`residual_norm`: ``h = x + (src + bias)`` and ``y = norm(h)`` in one program over the
  row, from the sums or from an ordinary tensor (a cuBLAS output): one launch instead of
  finalize + add + :func:`~dejavu_lab.kernels.norm.row_norm` (two for the dense path: add + norm).

The residual is rounded to the model's dtype once, where the unfused path rounds the block's
output and then the sum; the norm reads the rounded residual, as the unfused path does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import next_pow2, use_triton
from ..int4.lists import kept_lists
from ..int4.norm_lists import norm_lists
from ..norm import KINDS, normed, row_norm_ref
from ..pdl import await_inputs, pdl_args
from .rotate import rope_ref

__all__ = ["residual_norm", "residual_norm_kernel", "rope_sums", "rope_sums_kernel"]


@triton.jit
def _take(ptrs, mask, FROM_SUMS: tl.constexpr):
    """fp32 values at ``ptrs``: workspace sums (left at zero for the next launch) or a tensor.

    Each element belongs to one program, so a barrier between the load and the zeros orders
    them: every thread has read before any thread stores (a bare load-then-store races when
    the two get different thread layouts; see :func:`._reduce.take_zero`)."""
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if FROM_SUMS:
        tl.debug_barrier()
        tl.store(ptrs, tl.zeros_like(v), mask=mask)
    return v


@triton.jit
def rope_sums_kernel(
    ws_ptr,  # [n_blocks * DH] fp32 sums of q | k | v, zero after this launch
    b_ptr,  # [n_blocks * DH] bias (HAS_BIAS)
    out_ptr,  # [n_blocks * DH] the rotated qkv of the token
    cos_ptr,  # [T, DH]
    sin_ptr,  # [T, DH]
    pos_ptr,  # [1] the token's position
    n_rot,  # blocks 0 .. n_rot - 1 are rotated (queries, then keys)
    HAS_BIAS: tl.constexpr,
    DH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HALF
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    j = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = j * DH
    x1 = _take(ws_ptr + base + offs, mask, True)
    x2 = _take(ws_ptr + base + HALF + offs, mask, True)
    if HAS_BIAS:
        x1 += tl.load(b_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(b_ptr + base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # the unfused path rounds q/k/v to the model's dtype before it rotates them
    x1 = x1.to(ty).to(tl.float32)
    x2 = x2.to(ty).to(tl.float32)
    if j < n_rot:
        p = tl.load(pos_ptr).to(tl.int64)
        c1 = tl.load(cos_ptr + p * DH + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + p * DH + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + p * DH + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + p * DH + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    tl.store(out_ptr + base + offs, x1.to(ty), mask=mask)
    tl.store(out_ptr + base + HALF + offs, x2.to(ty), mask=mask)


def rope_sums(ws: torch.Tensor, bias, out: torch.Tensor, cos, sin, positions, *,
              n_rot: int) -> torch.Tensor:  # fmt: skip
    """``out = rope(ws + bias)`` for one token: ws [n_blocks * d_head] fp32 sums (left at
    zero), out [1, n_blocks * d_head] in the model's dtype, the first ``n_rot`` blocks rotated
    at ``positions[0]`` with the [T, d_head] cos/sin tables (contiguous). No input checks (the
    engine calls it inside a CUDA graph); the CPU without the interpreter runs PyTorch.

    >>> from dejavu_lab.kernels import rope_ref
    >>> ws = torch.randn(3 * 4)  # 3 blocks of d_head = 4: q, k, v
    >>> cos, sin = torch.rand(8, 4).half(), torch.rand(8, 4).half()
    >>> out = torch.empty(1, 12, dtype=torch.float16)
    >>> want = rope_ref(ws.half()[None], cos, sin, torch.tensor([5]), n_rot=2)
    >>> torch.allclose(rope_sums(ws, None, out, cos, sin, torch.tensor([5]), n_rot=2), want,
    ...                atol=1e-2), bool((ws == 0).all())
    (True, True)
    """
    dh = cos.shape[-1]
    if not use_triton(ws.device):
        y = ws if bias is None else ws + bias.float()
        out.copy_(rope_ref(y.to(out.dtype)[None], cos, sin, positions, n_rot=n_rot))
        ws.zero_()
        return out
    rope_sums_kernel[(ws.numel() // dh,)](
        ws, bias if bias is not None else ws, out, cos, sin, positions, n_rot,
        HAS_BIAS=bias is not None, DH=dh, HALF=dh // 2, BLOCK=next_pow2(dh // 2), num_warps=1,
        **pdl_args(ws.device),
    )  # fmt: skip
    return out


@triton.jit
def residual_norm_kernel(
    src_ptr,  # [N] the block's output: fp32 sums (FROM_SUMS, zero after) or the model's dtype
    b_ptr,  # [N] the block's output bias (HAS_BIAS)
    res_ptr,  # [N] the residual stream before the block
    h_ptr,  # [N] the residual stream after it
    w_ptr,  # [N] the next norm's scale (NORM)
    nb_ptr,  # [N] the next norm's shift (HAS_NB)
    y_ptr,  # [N] norm(h) (NORM)
    z_ptr,  # [n_zero] fp32 sums an earlier launch consumed, zeroed by programs 1..
    n,
    eps,
    n_zero,
    FROM_SUMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    RMS: tl.constexpr,
    HAS_NB: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row in one program
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    offs = tl.arange(0, BLOCK)
    pid = tl.program_id(0)
    if pid > 0:  # the other programs leave a consumed workspace at zero
        zo = (pid - 1) * BLOCK + offs
        tl.store(z_ptr + zo, tl.zeros((BLOCK,), tl.float32), mask=zo < n_zero)
    else:
        mask = offs < n
        a = _take(src_ptr + offs, mask, FROM_SUMS)
        if HAS_BIAS:
            a += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ty = h_ptr.dtype.element_ty
        h = (tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32) + a).to(ty)
        tl.store(h_ptr + offs, h, mask=mask)
        if NORM:  # the norm of the rounded residual, as the unfused path reads it
            y = normed(h.to(tl.float32), w_ptr, nb_ptr, offs, mask, n, eps, RMS, HAS_NB)
            tl.store(y_ptr + offs, y.to(ty), mask=mask)


def residual_norm(src: torch.Tensor, bias, residual: torch.Tensor, norm=None, *,
                  kind: str = "rms", from_sums: bool = False, zero: torch.Tensor | None = None,
                  lists: tuple | None = None):  # fmt: skip
    """One token's residual add and the next norm: ``h = residual + (src + bias)``, and
    ``norm(h)`` with ``norm = (weight, shift or None, eps)`` of ``kind`` "rms" or "layer"
    (None: h only). ``src`` is a tensor in the model's dtype, or (``from_sums``) the fp32 sums
    of a threshold GEMV, left at zero; residual [1, N]. ``zero``: fp32 sums an earlier launch
    read without zeroing (the MLP's gate/up sums, finished inside the down GEMV:
    :func:`~dejavu_lab.kernels.threshold.fused.threshold_sums`), zeroed here by the launch's other programs. ``lists``: ``(thr, kept)`` —
    the rows of ``norm(h)`` that pass ``|y| > thr`` (a float, or fp32 [N]) listed into ``kept``
    (:class:`~dejavu_lab.kernels.int4.lists.KeptLists`) for the int4 threshold product that
    reads ``norm(h)`` next. Returns (h, norm(h) or None), both new [1, N] tensors. No
    input checks (the engine calls it inside a CUDA graph).

    >>> x = torch.randn(1, 96).half()
    >>> ws = torch.randn(96)  # sums left by a threshold GEMV
    >>> w, want = torch.rand(96).half(), x.float() + ws
    >>> h, y = residual_norm(ws, None, x, (w, None, 1e-5), from_sums=True)
    >>> torch.allclose(h.float(), want, atol=1e-2), bool((ws == 0).all())
    (True, True)
    >>> torch.allclose(y.float(), row_norm_ref(want, w.float(), kind="rms"), atol=2e-2)
    True
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}.")
    n = residual.shape[-1]
    h = torch.empty_like(residual)
    y = torch.empty_like(residual) if norm is not None else None
    if not use_triton(src.device):
        a = src.float() if bias is None else src.float() + bias.float()
        h.copy_((residual.float() + a.view(1, n)).to(h.dtype))
        if from_sums:
            src.zero_()
        if zero is not None:
            zero.zero_()
        if norm is not None:
            w, b, eps = norm
            y.copy_(row_norm_ref(h.float(), w.float(), None if b is None else b.float(),
                                 eps=eps, kind=kind).to(y.dtype))  # fmt: skip
            if lists is not None:  # (on the CPU, kept_lists runs its reference)
                kept_lists(y, lists[0], out=lists[1], rows=lists[1].rows)
        return h, y
    if lists is not None:  # the listing programs (:mod:`~dejavu_lab.kernels.int4.norm_lists`)
        if norm is None:
            raise ValueError("kept lists are made from norm(h): pass the next norm too.")
        norm_lists(src, bias, residual, h, y, norm, kind, from_sums, zero, lists)
        return h, y
    w, nb, eps = norm if norm is not None else (h, None, 0.0)
    block = next_pow2(n)
    n_zero = zero.numel() if zero is not None else 0
    residual_norm_kernel[(1 + triton.cdiv(n_zero, block),)](
        src, bias if bias is not None else src, residual, h, w, nb if nb is not None else w,
        y if y is not None else h, zero if zero is not None else src, n, eps, n_zero,
        FROM_SUMS=from_sums, HAS_BIAS=bias is not None,
        NORM=norm is not None, RMS=kind == "rms", HAS_NB=nb is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **pdl_args(h.device),
    )  # fmt: skip
    return h, y
