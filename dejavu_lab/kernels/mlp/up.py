"""Sparse MLP up-projection: gather the selected rows of W1, multiply, add bias, activate.

Deja Vu §4.4 and Appendix E: batch-1 decoding is memory-bound, so a kernel that
reads only the selected rows of ``W1`` (``fc1.weight``, shape [4d, d], one row per neuron,
already contiguous in the nn.Linear layout) can approach ``kept fraction x dense time``. The
gather is fused into the multiply: each row is read once from HBM into registers, never
written back as a gathered copy (a gather-then-matmul moves those bytes three times).

One call serves a union batch (Appendix C.1): 1-32 tokens share one index set, each token brings
its own activations. Batch 1 uses plain FMAs over a [BLOCK_N, BLOCK_D] tile and reduces once at
the end; larger batches pad the token tile to 16 and use ``tl.dot`` (tensor cores), so the
arithmetic never becomes the bottleneck. fp32 accumulation throughout.

Gated MLPs (SwiGLU ``silu(gate)*up``, GeGLU) pass ``up_weight``: both rows are read in the same
pass. ``rows_per_index`` > 1 selects blocks of rows (attention heads: ``d_head`` rows per head).
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
from .._neurons import act, expand_rows

__all__ = ["ACTIVATIONS", "sparse_mlp_up", "sparse_mlp_up_kernel", "sparse_mlp_up_ref"]

ACTIVATIONS = ("relu", "gelu", "silu", "none")  # gelu is the exact (erf) form, as in HF "gelu"


@triton.jit
def sparse_mlp_up_kernel(
    x_ptr,  # [B, D] tokens' inputs
    w_ptr,  # [n_rows, D] W1 (or the gate weight), row-major
    wu_ptr,  # [n_rows, D] up weight (gated MLPs only)
    b_ptr,  # [n_rows] bias of w (optional)
    bu_ptr,  # [n_rows] bias of wu (optional)
    idx_ptr,  # [K // G] selected row blocks
    out_ptr,  # [B, K] activations of the selected rows
    B,
    K,
    D,
    stride_xb,
    stride_w,
    stride_wu,
    stride_ob,
    G: tl.constexpr,  # rows per index (1 for neurons, d_head for heads)
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_N: tl.constexpr,  # selected rows per program
    BLOCK_D: tl.constexpr,  # input features per step
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    PREFETCH: tl.constexpr,  # FMA path: load the next tile before using this one
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    if G == 1:
        rows = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    else:
        blk = tl.load(idx_ptr + offs_n // G, mask=mask_n, other=0).to(tl.int64)
        rows = blk * G + offs_n % G
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    w_rows = w_ptr + rows[:, None] * stride_w  # [BLOCK_N, 1]
    wu_rows = wu_ptr + rows[:, None] * stride_wu
    offs_k = tl.arange(0, BLOCK_D)
    if BLOCK_B == 1:
        # FMA path: accumulate the whole tile, reduce once at the end. PREFETCH issues the
        # next tile's loads before this tile's FMAs (two loads in flight per thread).
        acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        if PREFETCH:
            m0 = mask_n[:, None] & (offs_k < D)[None, :]
            w_nxt = tl.load(
                w_rows + offs_k[None, :], mask=m0, other=0.0, eviction_policy="evict_first"
            )
            if GATED:
                wu_nxt = tl.load(
                    wu_rows + offs_k[None, :], mask=m0, other=0.0, eviction_policy="evict_first"
                )
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + offs_k
            mask_d = offs_d < D
            if PREFETCH:
                w = w_nxt
                nd = offs_d + BLOCK_D
                m1 = mask_n[:, None] & (nd < D)[None, :]
                w_nxt = tl.load(
                    w_rows + nd[None, :], mask=m1, other=0.0, eviction_policy="evict_first"
                )
                if GATED:
                    wu = wu_nxt
                    wu_nxt = tl.load(
                        wu_rows + nd[None, :], mask=m1, other=0.0, eviction_policy="evict_first"
                    )
            else:
                m1 = mask_n[:, None] & mask_d[None, :]
                w = tl.load(
                    w_rows + offs_d[None, :], mask=m1, other=0.0, eviction_policy="evict_first"
                )
                if GATED:
                    wu = tl.load(
                        wu_rows + offs_d[None, :], mask=m1, other=0.0, eviction_policy="evict_first"
                    )
            x = tl.load(x_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                acc_u += wu.to(tl.float32) * x[None, :]
        h = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
        u = tl.sum(acc_u, axis=1)[:, None]
    else:
        # tensor-core path (tokens padded to BLOCK_B >= 16); Triton pipelines these loads
        acc = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_B), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + offs_k
            mask_d = offs_d < D
            w_mask = mask_n[:, None] & mask_d[None, :]
            w = tl.load(w_rows + offs_d[None, :], mask=w_mask, other=0.0)
            x_ptrs = x_ptr + offs_b[:, None] * stride_xb + offs_d[None, :]
            x = tl.load(x_ptrs, mask=mask_b[:, None] & mask_d[None, :], other=0.0)
            acc = dot_acc(w, tl.trans(x), acc, UPCAST)
            if GATED:
                wu = tl.load(wu_rows + offs_d[None, :], mask=w_mask, other=0.0)
                acc_u = dot_acc(wu, tl.trans(x), acc_u, UPCAST)
        h = acc  # [BLOCK_N, BLOCK_B]
        u = acc_u
    if HAS_BIAS:
        h += tl.load(b_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    h = act(h, ACT)
    if GATED:
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        h = h * u
    out_ptrs = out_ptr + offs_b[None, :] * stride_ob + offs_n[:, None]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_b[None, :])


def sparse_mlp_up_ref(
    x, weight, idx, *, bias=None, activation="relu", up_weight=None, up_bias=None, rows_per_index=1
):
    """Plain-PyTorch reference (fp32 math): act(x @ W[idx].T + b[idx]) [* (x @ Wu[idx].T + bu)].

    >>> w = torch.arange(12, dtype=torch.float16).view(4, 3) - 5  # 4 neurons, d = 3
    >>> sparse_mlp_up_ref(torch.ones(3, dtype=torch.float16), w, torch.tensor([0, 3]))
    tensor([ 0., 15.], dtype=torch.float16)
    """
    rows = expand_rows(idx, rows_per_index)
    xf = x.float()
    h = xf @ weight[rows].float().T
    if bias is not None:
        h = h + bias[rows].float()
    h = {
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "silu": torch.nn.functional.silu,
        "none": lambda t: t,
    }[activation](h)
    if up_weight is not None:
        u = xf @ up_weight[rows].float().T
        if up_bias is not None:
            u = u + up_bias[rows].float()
        h = h * u
    return h.to(x.dtype)


def default_config(batch: int, k: int, d: int, device: torch.device | None = None,
                   n_rows: int | None = None) -> dict:  # fmt: skip
    """Tile shapes: tuned for this GPU and shape in kernels/tuned/tuning_*.json (:mod:`~dejavu_lab.kernels.tuning`,
    when ``device`` and ``n_rows`` are given), else from the H200 sweeps in
    results/sparse_mlp_tuning.json (d = 12288); any valid choice computes the same thing,
    these only decide the speed. On the CPU (Triton's interpreter, where every program costs
    milliseconds of Python) one program takes up to 64 of the rows at batch 1: the same FMA
    path with a taller tile.

    >>> default_config(1, 4096, 12288)  # batch 1: one row per program, FMA path
    {'BLOCK_N': 1, 'BLOCK_D': 2048, 'num_warps': 8, 'prefetch': True}
    >>> default_config(1, 96, 64, torch.device("cpu"))["BLOCK_N"]  # the interpreter: 2 programs
    64
    >>> default_config(16, 4096, 12288)["BLOCK_N"]  # union batch: tensor-core tiles
    32
    """
    if device is not None and n_rows:
        tuned = tuning.lookup("sparse_mlp_up", d, n_rows, k / n_rows, batch, device)
        if tuned is not None:
            return tuned
    if batch == 1:  # one selected row per program, two tiles in flight per thread
        block_d = min(2048, max(16, next_pow2(d)))
        cpu = device is not None and device.type == "cpu"  # the interpreter: fewer programs
        return {"BLOCK_N": min(64, next_pow2(k)) if cpu else 1, "BLOCK_D": block_d,
                "num_warps": 8 if block_d >= 2048 else 4, "prefetch": True}  # fmt: skip
    if k >= 8192:  # tensor-core path: wider row tiles once there are rows enough
        return {"BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32, "BLOCK_D": min(256, max(16, next_pow2(d))), "num_warps": 4,
            "num_stages": 4}  # fmt: skip


def sparse_mlp_up(
    x: torch.Tensor,
    weight: torch.Tensor,
    idx: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "relu",
    up_weight: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    rows_per_index: int = 1,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Selected neurons' activations: ``act(x @ weight[idx].T + bias[idx])``, gated if ``up_weight``.

    x: [d] or [B, d] (B <= 32, one union index set); weight, up_weight: [n_rows, d] row-major
    (nn.Linear layout of fc1 / gate_proj / up_proj); idx: [k] distinct int32/int64 row indices
    (blocks of ``rows_per_index`` rows); returns [k * rows_per_index] or [B, k * rows_per_index]
    in ``idx`` order. ``validate`` (default: unless capturing a CUDA graph) checks index range and
    uniqueness, which reads them back to the host: pass ``validate=False`` in timed loops.
    ``validate=False`` trusts ``idx``: an index past the rows makes the kernel read memory beyond
    the weight and return whatever it holds (0.0, NaN or huge values, silently; on a GPU possibly
    an illegal-address fault that ends the CUDA context), and a repeated index computes its row
    twice. Only the plain-PyTorch path (CPU without ``TRITON_INTERPRET``) raises ``IndexError``.

    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2, 16, dtype=torch.float16)  # a union batch of 2 tokens, d = 16
    >>> w = torch.randn(64, 16, dtype=torch.float16)  # fc1: 64 neurons
    >>> idx = torch.tensor([3, 10, 42])
    >>> y = sparse_mlp_up(x, w, idx)  # the Triton kernel on CPU under TRITON_INTERPRET=1
    >>> y.shape, torch.allclose(y, sparse_mlp_up_ref(x, w, idx), atol=1e-2)
    (torch.Size([2, 3]), True)
    """
    check_float("x", x)
    dtype, device = x.dtype, x.device
    check_device(device, weight=weight, idx=idx, bias=bias, up_weight=up_weight, up_bias=up_bias)
    check_weight("weight", weight, dtype)
    n_rows, d = weight.shape
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}.")
    g = int(rows_per_index)
    if g < 1 or n_rows % g:
        raise ValueError(f"rows_per_index={rows_per_index} must divide weight's {n_rows} rows.")
    if up_weight is not None:
        check_weight("up_weight", up_weight, dtype)
        check_shape("up_weight", up_weight, (n_rows, d))
    check_vector("bias", bias, n_rows, dtype)
    check_vector("up_bias", up_bias, n_rows, dtype)
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias was given without up_weight; pass both or neither.")
    xb, squeeze = as_batch("x", x, d)
    check_index("idx", idx, n_rows // g, device, validate)
    batch, k = xb.shape[0], idx.numel() * g
    res, res2 = output(out, batch, k, squeeze, dtype, device)
    if k == 0:
        return res
    if not use_triton(device):
        ref = sparse_mlp_up_ref(
            xb, weight, idx, bias=bias, activation=activation, up_weight=up_weight,
            up_bias=up_bias, rows_per_index=g,
        )  # fmt: skip
        res2.copy_(ref)
        return res
    cfg = {**default_config(batch, k, d, device, n_rows), **(config or {})}
    block_b = batch_block(batch)
    if block_b > 1 and cfg["BLOCK_N"] < 16:
        raise ValueError("config BLOCK_N must be >= 16 for batches above 1 (tensor-core path).")
    grid = (triton.cdiv(k, cfg["BLOCK_N"]),)
    sparse_mlp_up_kernel[grid](
        xb, weight, up_weight if up_weight is not None else weight,
        bias if bias is not None else weight, up_bias if up_bias is not None else weight,
        idx, res2, batch, k, d, xb.stride(0), weight.stride(0),
        up_weight.stride(0) if up_weight is not None else 0, res2.stride(0),
        G=g, ACT=activation, GATED=up_weight is not None, HAS_BIAS=bias is not None,
        HAS_UP_BIAS=up_bias is not None, BLOCK_B=block_b, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=cfg["BLOCK_D"], UPCAST=upcast_dot(dtype), PREFETCH=bool(cfg.get("prefetch", False)), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    return res
