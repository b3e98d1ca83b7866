"""The sparse MLP over the kept neurons: gate/up (or fc1) rows and activation in one launch,
the down rows in a second.

Deja Vu §4.4 runs a sparse MLP as two gathers (up, then down). Here one program takes
``BLOCK_N`` kept neurons, reads their gate and up rows in the same pass over x (or the fc1
row), forms ``h = act(gate . x) * (up . x)`` (or ``act(fc1 . x + b)``) in fp32 and stores it
rounded to the input dtype, as the model stores the activation; :func:`~.sparse_mlp_down` then
reads the same neurons' down rows (``W_down.T``, one contiguous row per neuron) and reduces
them in a fixed order. Each byte of the kept weights is read once. Batch 1 uses FMAs; union
batches (2-32 tokens, one kept set) ``tl.dot``. CATS runs through the same kernel
(:mod:`~dejavu_lab.kernels.cats.mlp`).

There is no one-launch variant that accumulates the down rows with fp32 atomics (the last
program to arrive converting the sums): measured on an H200 (Triton 3.6) it is slower than
the two launches at every point checked (29.7 against 18.0 µs at Llama-2-7B, 10% kept,
batch 1) and wrong with the tensor-core tiles (relative errors 0.2-0.4, see
:mod:`~dejavu_lab.kernels.threshold.gemv` for the same defect in its atomic mode).
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
    check_index,
    check_shape,
    check_vector,
    check_weight,
    dot_acc,
    next_pow2,
    output,
    upcast_dot,
    use_triton,
)
from .._neurons import FUSED_ACTIVATIONS, act, act_ref, rows_dot
from .down import sparse_mlp_down

__all__ = [
    "FUSED_ACTIVATIONS",
    "check_mlp",
    "default_config",
    "fused_mlp_kernel",
    "fused_sparse_mlp",
    "fused_sparse_mlp_ref",
    "hidden_ref",
    "launch",
]


@triton.jit
def _gated_dot(g_rows, u_rows, x_ptr, offs_b, mask_b, rmask, D, stride_xb,
               BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """(gate, up) [BLOCK_N, BLOCK_B] fp32 in one pass over x (both rows per step)."""
    offs_k = tl.arange(0, BLOCK_K)
    if BLOCK_B == 1:
        acc_g = tl.zeros((g_rows.shape[0], BLOCK_K), tl.float32)
        acc_u = tl.zeros((g_rows.shape[0], BLOCK_K), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + offs_k
            mk = cols < D
            m2 = rmask[:, None] & mk[None, :]
            xk = tl.load(x_ptr + cols, mask=mk, other=0.0).to(tl.float32)[None, :]
            g = tl.load(g_rows + cols[None, :], mask=m2, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_rows + cols[None, :], mask=m2, other=0.0, eviction_policy="evict_first")
            acc_g += g.to(tl.float32) * xk
            acc_u += u.to(tl.float32) * xk
        gate = tl.sum(acc_g, axis=1)[:, None]
        up = tl.sum(acc_u, axis=1)[:, None]
    else:
        gate = tl.zeros((g_rows.shape[0], BLOCK_B), tl.float32)
        up = tl.zeros((g_rows.shape[0], BLOCK_B), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + offs_k
            mk = cols < D
            m2 = rmask[:, None] & mk[None, :]
            xt = tl.trans(tl.load(x_ptr + offs_b[:, None] * stride_xb + cols[None, :],
                                  mask=mask_b[:, None] & mk[None, :], other=0.0))  # fmt: skip
            gate = dot_acc(tl.load(g_rows + cols[None, :], mask=m2, other=0.0), xt, gate, UPCAST)
            up = dot_acc(tl.load(u_rows + cols[None, :], mask=m2, other=0.0), xt, up, UPCAST)
    return gate, up


@triton.jit
def fused_mlp_kernel(
    x_ptr,  # [B, D] tokens' inputs
    w_ptr,  # [n or 2n, D] fc1, or gate rows 0..n-1 then up rows n..2n-1
    idx_ptr,  # [K] kept neurons (not CATS)
    thr_ptr,  # [n] fp32 CATS thresholds on |act(gate)|
    b_ptr,  # [n or 2n] bias of w (optional)
    h_ptr,  # [B, K] activations of the kept neurons (CATS: of all n, zero where dropped)
    B,
    K,  # kept neurons (CATS: all n)
    D,
    N_UP,  # row offset of the up rows (n)
    stride_xb,
    stride_w,
    stride_hb,
    CATS: tl.constexpr,  # neurons are this program's block of all n, kept by threshold
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_N: tl.constexpr,  # neurons per program
    BLOCK_K: tl.constexpr,  # input features per step
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    if CATS:
        neu = offs_n.to(tl.int64)
    else:
        neu = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    g_rows = w_ptr + neu[:, None] * stride_w  # [BLOCK_N, 1]
    u_rows = w_ptr + (neu + N_UP)[:, None] * stride_w
    if GATED and not CATS:
        g, u = _gated_dot(
            g_rows, u_rows, x_ptr, offs_b, mask_b, mask_n, D, stride_xb, BLOCK_B, BLOCK_K, UPCAST
        )
    else:
        g = rows_dot(g_rows, x_ptr, offs_b, mask_b, mask_n, D, stride_xb, BLOCK_B, BLOCK_K, UPCAST)
    if HAS_BIAS:
        g += tl.load(b_ptr + neu, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    a = act(g, ACT)  # [BLOCK_N, BLOCK_B]
    if CATS:
        t = tl.load(thr_ptr + neu, mask=mask_n, other=float("inf"))
        keep = (tl.abs(a) > t[:, None]) & mask_b[None, :] & mask_n[:, None]
        keep_n = tl.max(keep.to(tl.int32), axis=1) > 0  # a row is read if any token keeps it
        if GATED:
            u = rows_dot(
                u_rows, x_ptr, offs_b, mask_b, keep_n, D, stride_xb, BLOCK_B, BLOCK_K, UPCAST
            )
    if GATED:
        if HAS_BIAS:
            u += tl.load(b_ptr + neu + N_UP, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        h = a * u
    else:
        h = a
    if CATS:
        h = tl.where(keep, h, 0.0)
    h_ptrs = h_ptr + offs_b[None, :] * stride_hb + offs_n[:, None]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_b[None, :])


# ----------------------------------------------------------------------------- references
def hidden_ref(x, w_in, n, *, activation, gated, b_in=None):
    """(act(gate) [B, n], up [B, n] or None) in fp32 for every neuron.

    >>> a, u = hidden_ref(torch.ones(1, 2), torch.ones(4, 2), 2, activation="relu", gated=True)
    >>> a.tolist(), u.tolist()
    ([[2.0, 2.0]], [[2.0, 2.0]])
    """
    z = x.float() @ w_in.float().T
    if b_in is not None:
        z = z + b_in.float()
    if gated:
        return act_ref(z[:, :n], activation), z[:, n:]
    return act_ref(z, activation), None


def fused_sparse_mlp_ref(x, w_in, w_down_t, idx, *, activation, gated, b_in=None, b_down=None):
    """Plain-PyTorch reference (fp32 math, ``h`` rounded to the input dtype as a model stores it).

    >>> x = torch.ones(1, 2, dtype=torch.float16)
    >>> w_in = torch.tensor([[1.0, 1.0], [-1.0, 0.0], [3.0, 0.0]], dtype=torch.float16)  # fc1: 3 neurons
    >>> w_down_t = torch.eye(3, 2, dtype=torch.float16)  # neuron j writes output j (if j < 2)
    >>> fused_sparse_mlp_ref(x, w_in, w_down_t, torch.tensor([0, 1]), activation="relu", gated=False)
    tensor([[2., 0.]], dtype=torch.float16)
    """
    xb = x if x.dim() == 2 else x[None]
    n = w_down_t.shape[0]
    a, u = hidden_ref(xb, w_in, n, activation=activation, gated=gated, b_in=b_in)
    h = a if u is None else a * u
    rows = idx.long()
    y = h[:, rows].to(x.dtype).float() @ w_down_t[rows].float()
    if b_down is not None:
        y = y + b_down.float()
    y = y.to(x.dtype)
    return y if x.dim() == 2 else y[0]


# ------------------------------------------------------------------------------- wrappers
def default_config(op: str, batch: int, d: int, k: int, n: int, *,
                   device: torch.device | None = None) -> dict:  # fmt: skip
    """Launch configuration of ``op`` ("fused" or "cats"): tuned (:mod:`~dejavu_lab.kernels.tuning`) or heuristic.

    >>> cfg = default_config("fused", 1, 4096, 1101, 11008, device=torch.device("cpu"))
    >>> cfg["mode"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ('two', 8, 1024)
    """
    device = device or torch.device("cpu")
    name = "fused_mlp" if op == "fused" else "cats_mlp"
    tuned = tuning.lookup(name, d, n, k / max(n, 1), batch, device)
    if tuned is not None:
        return tuned
    block_k = min(1024 if op == "fused" else 512, max(16, next_pow2(d)))
    if batch == 1:  # the H200 sweep's choice over every tuned kept fraction
        cfg = {"BLOCK_N": 8 if op == "fused" else 32, "BLOCK_K": block_k, "BLOCK_C": block_k,
               "num_warps": 8 if block_k >= 512 else 4}  # fmt: skip
    else:
        cfg = {"BLOCK_N": 16 if op == "fused" else 32, "BLOCK_K": min(128, block_k),
               "BLOCK_C": min(128, block_k), "num_warps": 4, "num_stages": 3}  # fmt: skip
    cfg["mode"] = "two"
    return cfg


def check_mlp(x, w_in, w_down_t, activation, b_in, b_down):
    """Shared checks of the MLP kernels; returns (xb [B, d], squeeze, n, d).

    >>> x, w = torch.zeros(2, 8, dtype=torch.float16), torch.zeros(6, 8, dtype=torch.float16)
    >>> check_mlp(x, w, w[:3], "silu", None, None)[1:]  # gate+up of 3 neurons, d = 8
    (False, 3, 8)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_device(device, w_in=w_in, w_down_t=w_down_t, b_in=b_in, b_down=b_down)
    check_weight("w_in", w_in, dtype)
    check_weight("w_down_t", w_down_t, dtype)
    n, d = w_down_t.shape
    if w_in.shape[1] != d:
        raise ValueError(f"w_in has shape {tuple(w_in.shape)} but w_down_t is [{n}, {d}]; "
                         f"both hold rows of length d = {d}.")  # fmt: skip
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {FUSED_ACTIVATIONS}.")
    check_vector("b_in", b_in, w_in.shape[0], dtype)
    check_vector("b_down", b_down, d, dtype)
    xb, squeeze = as_batch("x", x, d)
    return xb, squeeze, n, d


def launch(xb, w_in, idx, thr, b_in, h, *, cats, gated, activation, k, n, cfg):
    """Launch the kernel on checked inputs: h [B, k] (CATS: [B, n]) of the kept neurons.

    >>> x, w = torch.ones(1, 8, dtype=torch.float16), torch.ones(4, 8, dtype=torch.float16)
    >>> h = torch.empty(1, 2, dtype=torch.float16)  # gate rows 0-1, up rows 2-3 of 2 neurons
    >>> launch(x, w, torch.tensor([0, 1], dtype=torch.int32), None, None, h, cats=False,
    ...        gated=True, activation="relu", k=2, n=2,
    ...        cfg={"BLOCK_N": 2, "BLOCK_K": 8, "num_warps": 1})  # relu(8) * 8
    >>> h
    tensor([[64., 64.]], dtype=torch.float16)
    """
    batch, d = xb.shape
    # batch 1 with "dot": the tensor-core path, token padded to 16 (pipelined weight loads)
    block_b = 16 if batch == 1 and cfg.get("dot") else batch_block(batch)
    if block_b > 1 and cfg["BLOCK_N"] < 16:
        raise ValueError("config BLOCK_N must be >= 16 for batches above 1 (tensor-core path).")
    fused_mlp_kernel[(triton.cdiv(k, cfg["BLOCK_N"]),)](
        xb, w_in, idx if idx is not None else w_in, thr if thr is not None else w_in,
        b_in if b_in is not None else w_in, h, batch, k, d, n, xb.stride(0), w_in.stride(0),
        h.stride(0), CATS=cats, GATED=gated, ACT=activation, HAS_BIAS=b_in is not None,
        BLOCK_B=block_b, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=min(cfg["BLOCK_K"], max(16, next_pow2(d))),
        UPCAST=upcast_dot(xb.dtype), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def check_mode(cfg: dict) -> None:
    """The one-launch atomic mode was removed; ``mode`` may only be "two".

    >>> check_mode({"mode": "atomic"})
    Traceback (most recent call last):
    ...
    ValueError: config mode='atomic' was removed (it was slower than two launches and wrong at some shapes on an H200); use mode='two' or leave mode out.
    """
    if cfg.get("mode", "two") != "two":
        raise ValueError(f"config mode={cfg['mode']!r} was removed (it was slower than two launches "
                         "and wrong at some shapes on an H200); use mode='two' or leave mode out.")  # fmt: skip


def fused_sparse_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_down_t: torch.Tensor,
    idx: torch.Tensor,
    *,
    activation: str,
    gated: bool,
    b_in: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    deterministic: bool = False,
    validate: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """The MLP over the kept neurons ``idx`` only: ``sum_j h[b, j] w_down_t[j]``.

    x: [d] or [B, d] (B <= 32, one union kept set); w_in: [n, d] (fc1) or, ``gated``, [2n, d]
    (gate rows 0..n-1, up rows n..2n-1: ``torch.cat([gate_proj.weight, up_proj.weight])``);
    w_down_t: [n, d] = ``down_proj.weight.T`` contiguous; idx: [k] distinct int32/int64 kept
    neurons; b_in: [w_in rows], b_down: [d]. ``h = act(gate . x) * (up . x)`` (gated) or
    ``act(fc1 . x + b)``, activation one of :data:`FUSED_ACTIVATIONS`. Returns [d] or [B, d].
    Two launches: the up kernel, then :func:`~.sparse_mlp_down`, whose batch-1 tiles add fp32
    sums with atomics in no fixed order; ``deterministic=True`` runs its split kernel instead,
    the same bits on every call. ``validate`` as in :func:`~.sparse_mlp_up` (pass ``False`` in
    timed loops and graphs).

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(16, dtype=torch.float16)
    >>> w_in = torch.randn(128, 16, dtype=torch.float16) / 4  # gate + up of n = 64 neurons
    >>> w_down_t = torch.randn(64, 16, dtype=torch.float16) / 8
    >>> idx = torch.tensor([3, 10, 42, 7])
    >>> y = fused_sparse_mlp(x, w_in, w_down_t, idx, activation="silu", gated=True)
    >>> ref = fused_sparse_mlp_ref(x, w_in, w_down_t, idx, activation="silu", gated=True)
    >>> y.shape, torch.allclose(y, ref, atol=1e-2)
    (torch.Size([16]), True)
    """
    xb, squeeze, n, d = check_mlp(x, w_in, w_down_t, activation, b_in, b_down)
    dtype, device = x.dtype, x.device
    check_shape("w_in", w_in, ((2 * n) if gated else n, d))
    check_index("idx", idx, n, device, validate)
    batch, k = xb.shape[0], idx.numel()
    res, res2 = output(out, batch, d, squeeze, dtype, device)
    if k == 0:
        res2.copy_(b_down.expand(batch, d) if b_down is not None else torch.zeros_like(res2))
        return res
    if not use_triton(device):
        res2.copy_(fused_sparse_mlp_ref(xb, w_in, w_down_t, idx, activation=activation,
                                        gated=gated, b_in=b_in, b_down=b_down))  # fmt: skip
        return res
    cfg = {**default_config("fused", batch, d, k, n, device=device), **(config or {})}
    check_mode(cfg)
    h = torch.empty((batch, k), dtype=dtype, device=device)
    launch(xb, w_in, idx, None, b_in, h, cats=False, gated=gated, activation=activation, k=k, n=n,
           cfg=cfg)  # fmt: skip
    down = {"mode": "split", **(cfg.get("down") or {})} if deterministic else cfg.get("down")
    sparse_mlp_down(h, w_down_t, idx, bias=b_down, out=res2, validate=False, config=down)
    return res
