"""CATS's middle step: given the dense gate, threshold it and read only the kept up rows.

CATS (Lee et al. 2024, ``lee2024cats``) keeps neuron j of token b iff
``|act(gate_j . x_b)| > thr[j]``. :func:`~dejavu_lab.kernels.cats.mlp.cats_mlp` computes the gate of every
neuron densely with cuBLAS (one contiguous GEMV over the gate rows: the fastest way to stream
them), then this kernel, per block of ``BLOCK_N`` neurons, loads the gate values, forms the
keep mask and reads the up rows (``w_gate_up[n + j]``, one contiguous row per neuron) only of
the neurons some token keeps — masked row loads, so a dropped row costs no memory traffic —
and writes ``h = act(gate) * (up . x)``, zero where dropped. For an fc1 MLP (ReLU/GELU, no
up rows) it only applies the activation and the threshold. Launch shape fixed by the shapes,
no host sync, no atomics: capturable in a CUDA graph, the same bits on every call. Batch 1
uses FMAs (or, with ``dot``, tensor cores on the token padded to 16); union batches
(2-32 tokens) ``tl.dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from .._common import (
    as_batch,
    batch_block,
    check_device,
    check_float,
    check_out,
    check_shape,
    check_thr,
    check_vector,
    check_weight,
    next_pow2,
    upcast_dot,
    use_triton,
)
from .._neurons import FUSED_ACTIVATIONS, act, act_ref, rows_dot
from .._reduce import take_zero
from ..pdl import await_inputs, pdl_args

__all__ = ["cats_up", "cats_up_kernel", "cats_up_ref", "default_config"]


@triton.jit
def cats_up_kernel(
    x_ptr,  # [B, D] tokens' inputs
    w_ptr,  # [2n, D] gate rows then up rows (only the up rows are read), or fc1 (none read)
    g_ptr,  # [B, n] the dense gate (bias included), fp32 or the input dtype
    thr_ptr,  # [n] fp32 thresholds on |act(gate)|
    b_ptr,  # [2n] bias of w_gate_up (the up half is added here; optional)
    h_ptr,  # [B, n] out: act(gate) * up where kept, else 0
    B,
    N,  # neurons
    D,
    stride_xb,
    stride_w,
    stride_gb,
    stride_hb,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_N: tl.constexpr,  # neurons per program
    BLOCK_K: tl.constexpr,  # input features per step
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    GATE_SUMS: tl.constexpr = False,  # g is a workspace of fp32 sums: add the gate bias, zero it
    PDL: tl.constexpr = False,  # launched with launch_pdl (pdl.pdl_args)
):
    if PDL:
        await_inputs(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    m2 = mask_n[:, None] & mask_b[None, :]
    g_ptrs = g_ptr + offs_b[None, :] * stride_gb + offs_n[:, None]
    if GATE_SUMS:  # read, and leave zeros for the next launch (rows_sums)
        g = take_zero(g_ptrs, m2)
        if HAS_BIAS:
            g += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    else:
        g = tl.load(g_ptrs, mask=m2, other=0.0)
    a = act(g.to(tl.float32), ACT)  # [BLOCK_N, BLOCK_B]
    t = tl.load(thr_ptr + offs_n, mask=mask_n, other=float("inf"))
    keep = (tl.abs(a) > t[:, None]) & m2
    h = a
    if GATED:
        keep_n = tl.max(keep.to(tl.int32), axis=1) > 0  # a row is read if any token keeps it
        neu = offs_n.to(tl.int64) + N
        u = rows_dot(w_ptr + neu[:, None] * stride_w, x_ptr, offs_b, mask_b, keep_n, D,
                      stride_xb, BLOCK_B, BLOCK_K, UPCAST)  # fmt: skip
        if HAS_BIAS:
            u += tl.load(b_ptr + neu, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        h = a * u
    h = tl.where(keep, h, 0.0)
    h_ptrs = h_ptr + offs_b[None, :] * stride_hb + offs_n[:, None]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m2)


def cats_up_ref(x, w_gate_up, gate, thr, *, activation, b_in=None):
    """Plain-PyTorch reference (fp32 math): ``h = act(gate) * (up . x + b)`` where
    ``|act(gate)| > thr``, else 0, rounded to the input dtype; ``act(gate)`` for an fc1 MLP.

    >>> x = torch.ones(1, 2, dtype=torch.float16)
    >>> w = torch.tensor([[9.0, 9.0], [9.0, 9.0], [1.0, 2.0], [3.0, 4.0]], dtype=torch.float16)
    >>> gate = torch.tensor([[0.5, 2.0]])  # neuron 0: relu 0.5 <= thr 1, dropped
    >>> cats_up_ref(x, w, gate, torch.ones(2), activation="relu")  # 2 * (3 + 4)
    tensor([[ 0., 14.]], dtype=torch.float16)
    """
    xb = x if x.dim() == 2 else x[None]
    n = thr.shape[0]
    a = act_ref(gate.float(), activation)
    h = a
    if w_gate_up.shape[0] == 2 * n:
        u = xb.float() @ w_gate_up[n:].float().T
        if b_in is not None:
            u = u + b_in[n:].float()
        h = a * u
    h = torch.where(a.abs() > thr.float(), h, 0.0).to(x.dtype)
    return h if x.dim() == 2 else h[0]


def default_config(batch: int, d: int, n: int | None = None, *,
                   device: torch.device | None = None) -> dict:  # fmt: skip
    """Launch configuration of :func:`cats_up`: tuned (:mod:`~dejavu_lab.kernels.tuning`, op ``"cats_up"``, written
    by ``kernels/bench_fused_mlp.py --tune``) when this GPU and shape were, else the H200
    sweep's choice at Llama shapes.

    Batch 1 runs the tensor-core path on the token padded to 16 (``dot``): its weight loads are
    pipelined through shared memory, more bytes in flight than the FMA path's registers hold
    (H200, Llama-2-13B, 50% kept: 21.4 µs, 3.3 TB/s on the kept up rows, against 23.7 µs for
    the best FMA tiling; the fused-gate kernel spent 85 µs on gate and up together). A tuned
    config may carry a ``"down"`` entry for :func:`~dejavu_lab.kernels.cats.mlp.cats_mlp`'s down GEMV.

    >>> default_config(1, 5120)
    {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 5, 'dot': True}
    """
    if n is not None and device is not None:
        tuned = tuning.lookup("cats_up", d, n, None, batch, device)
        if tuned is not None:
            return tuned
    block_k = min(128, max(16, next_pow2(d)))
    if batch == 1:
        return {"BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 5, "dot": True}
    return {"BLOCK_N": 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}


def cats_up(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate: torch.Tensor,
    thr: torch.Tensor,
    *,
    activation: str,
    b_in: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``h[b, j] = act(gate[b, j]) * (up_j . x_b)`` where ``|act(gate[b, j])| > thr[j]``, else 0.

    x: [d] or [B, d] (B <= 32); w_gate_up: [2n, d] (gate rows then up rows; only the up rows
    of the kept neurons are read) or [n, d] (fc1: ``h = act(gate)`` where kept); gate: [n] or
    [B, n], the dense gate with its bias (fp32 or x's dtype); thr: fp32 [n]; b_in: [2n] or
    [n] (its up half is added to up). Returns h [n] or [B, n] in x's dtype. An up row is read
    iff some token keeps its neuron. ``config`` overrides the tiles (:func:`default_config`;
    ``dot=True`` runs batch 1 on tensor cores).

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2, 16, dtype=torch.float16)  # a union batch of 2 tokens
    >>> w = torch.randn(64, 16, dtype=torch.float16) / 4  # gate + up of n = 32 neurons
    >>> gate = x.float() @ w[:32].float().T  # the dense gate (cuBLAS in the engine)
    >>> thr = torch.full((32,), 0.3)
    >>> h = cats_up(x, w, gate, thr, activation="silu")
    >>> torch.allclose(h, cats_up_ref(x, w, gate, thr, activation="silu"), atol=1e-3)
    True
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_device(device, w_gate_up=w_gate_up, gate=gate, thr=thr, b_in=b_in)
    check_weight("w_gate_up", w_gate_up, dtype)
    rows, d = w_gate_up.shape
    if not isinstance(thr, torch.Tensor):
        raise TypeError(f"thr must be a torch.Tensor, got {type(thr).__name__}.")
    n = thr.shape[0] if thr.dim() == 1 else -1
    if rows not in (n, 2 * n):
        raise ValueError(f"w_gate_up has {rows} rows; pass 2n = {2 * n} (gate then up) "
                         f"or n = {n} (fc1) rows for thr's {n} neurons.")  # fmt: skip
    check_thr(thr, n)
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {FUSED_ACTIVATIONS}.")
    check_vector("b_in", b_in, rows, dtype)
    xb, squeeze = as_batch("x", x, d)
    batch = xb.shape[0]
    if not isinstance(gate, torch.Tensor) or not gate.is_floating_point():
        raise TypeError(
            "gate must be a floating-point tensor; pass the dense gate in fp32 or x's dtype."
        )
    check_shape("gate", gate, (n,) if squeeze else (batch, n))
    shape = (n,) if squeeze else (batch, n)
    check_out(out, shape, dtype, device)
    res = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    h2, g2 = res.view(batch, n), gate.reshape(batch, n)
    if not use_triton(device):
        h2.copy_(cats_up_ref(xb, w_gate_up, g2, thr, activation=activation, b_in=b_in))
        return res
    cfg = {**default_config(batch, d, n, device=device), **(config or {})}
    launch(xb, w_gate_up, g2, thr, b_in, h2, activation=activation, cfg=cfg)
    return res


def launch(xb, w_gate_up, gate, thr, b_in, h, *, activation, cfg, gate_sums=False):
    """Launch the kernel on checked inputs (xb [B, d], gate and h [B, n] with unit column stride).
    ``gate_sums``: gate is fp32 sums in a workspace (:func:`~dejavu_lab.kernels.cats.sums.rows_sums`, no bias):
    the kernel adds the gate's bias (``b_in[:n]``) and leaves zeros there.

    >>> x, w = torch.ones(1, 8, dtype=torch.float16), torch.ones(4, 8, dtype=torch.float16)
    >>> h = torch.empty(1, 2, dtype=torch.float16)
    >>> launch(x, w, torch.tensor([[1.0, -9.0]]), torch.zeros(2), None, h, activation="relu",
    ...        cfg={"BLOCK_N": 2, "BLOCK_K": 8, "num_warps": 1})  # relu(1) * 8; relu(-9) = 0
    >>> h
    tensor([[8., 0.]], dtype=torch.float16)
    """
    batch, d = xb.shape
    n = thr.shape[0]
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    block_b = 16 if batch == 1 and cfg.get("dot") else batch_block(batch)
    if block_b > 1 and cfg["BLOCK_N"] < 16:
        raise ValueError("config BLOCK_N must be >= 16 for batches above 1 (tensor-core path).")
    cats_up_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        xb, w_gate_up, gate, thr, b_in if b_in is not None else w_gate_up, h, batch, n, d,
        xb.stride(0), w_gate_up.stride(0), gate.stride(0), h.stride(0),
        GATED=w_gate_up.shape[0] == 2 * n, ACT=activation, HAS_BIAS=b_in is not None,
        BLOCK_B=block_b, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=min(cfg["BLOCK_K"], max(16, next_pow2(d))),
        UPCAST=upcast_dot(xb.dtype), GATE_SUMS=gate_sums, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2), **pdl_args(xb.device),
    )  # fmt: skip
