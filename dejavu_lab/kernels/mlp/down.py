"""Sparse MLP down-projection over W2 stored transposed: ``y = h @ W2T[idx] + b``.

Deja Vu §4.4 and Appendix E (memory coalescing): nn.Linear keeps ``fc2.weight`` as
[d, 4d], so the weights of one neuron form a *column* — a strided gather of 2-byte elements.
Stored transposed once at load time (``W2T = fc2.weight.T.contiguous()``, [4d, d]), each
selected neuron's output weights become one contiguous row and every warp issues full 128-byte
loads. The kernel reduces over the selected rows.

Batch 1 runs :mod:`.down_tile` by default: one tile of kept rows by output columns per
program, summed with fp32 atomics (the order of the sums varies from run to run). The split
kernel here (``config={"mode": "split"}``) is deterministic.

Work split: programs tile the output columns (``BLOCK_D``) and, when that gives too few programs
to fill the GPU, also split the selected rows (``split``): each split writes an fp32 partial
and a small second kernel sums the partials, adds the bias and casts. With one split the
first kernel writes the output directly (one launch).

Union batches (1-32 tokens sharing ``idx``, each with its own ``h``) use ``tl.dot`` with the
token tile padded to 16; batch 1 uses FMAs. fp32 accumulation throughout.
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
    check_vector,
    check_weight,
    dot_acc,
    next_pow2,
    output,
    sm_count,
    upcast_dot,
    use_triton,
)
from .._neurons import expand_rows
from .._reduce import finish
from .down_tile import TILE, kept_rows, launch_tile

__all__ = ["sparse_mlp_down", "sparse_mlp_down_kernel", "sparse_mlp_down_ref"]


@triton.jit
def sparse_mlp_down_kernel(
    h_ptr,  # [B, K] activations of the selected rows
    w_ptr,  # [n_rows, D] W2 transposed, row-major
    idx_ptr,  # [K // G] selected row blocks
    b_ptr,  # [D] bias (optional)
    out_ptr,  # [B, D] output
    part_ptr,  # [n_split, B, D] fp32 partial sums (several splits)
    count_ptr,  # [>= n_col] int32 arrival counters, zero between launches (FUSED)
    B,
    K,
    D,
    stride_hb,
    stride_w,
    stride_ob,
    rows_per_split,
    n_split,
    G: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # several splits: write fp32 partials
    FUSED: tl.constexpr,  # ... and the last split to arrive sums them (else a second kernel)
    BLOCK_B: tl.constexpr,  # 1 (FMA path) or >= 16 (tl.dot path)
    BLOCK_R: tl.constexpr,  # selected rows per step
    BLOCK_D: tl.constexpr,  # output columns per program
    UPCAST: tl.constexpr,  # fp32 tl.dot (CPU interpreter, bf16)
    PREFETCH: tl.constexpr,  # FMA path: 1 the next step's indices one step early; 2 its weights too
    CHUNK: tl.constexpr,  # partial sums read per step by the fused reduction
):
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_b = tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    offs_k = tl.arange(0, BLOCK_R)
    r_lo = pid_s * rows_per_split
    r_hi = tl.minimum(K, r_lo + rows_per_split)
    if BLOCK_B == 1 and PREFETCH == 2:
        # software pipeline: the next step's weight tile loads while this step's FMAs run
        # (two tiles in flight per program; the row numbers one step further ahead)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        m_c = (r_lo + offs_k) < r_hi
        rows_c = kept_rows(idx_ptr, r_lo + offs_k, m_c, G)
        w_c = tl.load(w_ptr + rows_c[:, None] * stride_w + offs_d[None, :],
                      mask=m_c[:, None] & mask_d[None, :], other=0.0,
                      eviction_policy="evict_first")  # fmt: skip
        h_c = tl.load(h_ptr + r_lo + offs_k, mask=m_c, other=0.0)
        rows_n = kept_rows(idx_ptr, r_lo + BLOCK_R + offs_k, (r_lo + BLOCK_R + offs_k) < r_hi, G)
        for r0 in range(r_lo, r_hi, BLOCK_R):
            nxt = r0 + BLOCK_R + offs_k
            m_n = nxt < r_hi
            w_n = tl.load(w_ptr + rows_n[:, None] * stride_w + offs_d[None, :],
                          mask=m_n[:, None] & mask_d[None, :], other=0.0,
                          eviction_policy="evict_first")  # fmt: skip
            h_n = tl.load(h_ptr + nxt, mask=m_n, other=0.0)
            rows_nn = kept_rows(idx_ptr, nxt + BLOCK_R, (nxt + BLOCK_R) < r_hi, G)
            acc += h_c.to(tl.float32)[:, None] * w_c.to(tl.float32)
            w_c = w_n
            h_c = h_n
            rows_n = rows_nn
        y = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_D]
    elif BLOCK_B == 1:
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        if PREFETCH:
            rows_nxt = kept_rows(idx_ptr, r_lo + offs_k, (r_lo + offs_k) < r_hi, G)
        for r0 in range(r_lo, r_hi, BLOCK_R):
            offs_r = r0 + offs_k
            mask_r = offs_r < r_hi
            if PREFETCH:  # this step's rows were loaded last step: one latency per step
                rows = rows_nxt
                rows_nxt = kept_rows(idx_ptr, offs_r + BLOCK_R, (offs_r + BLOCK_R) < r_hi, G)
            else:
                rows = kept_rows(idx_ptr, offs_r, mask_r, G)
            w = tl.load(w_ptr + rows[:, None] * stride_w + offs_d[None, :],
                        mask=mask_r[:, None] & mask_d[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            hv = tl.load(h_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            acc += hv[:, None] * w.to(tl.float32)
        y = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_D]
    else:
        # tensor-core path (tokens padded to BLOCK_B >= 16); Triton pipelines these loads
        acc = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
        for r0 in range(r_lo, r_hi, BLOCK_R):
            offs_r = r0 + offs_k
            mask_r = offs_r < r_hi
            rows = kept_rows(idx_ptr, offs_r, mask_r, G)
            w = tl.load(w_ptr + rows[:, None] * stride_w + offs_d[None, :],
                        mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
            h_ptrs = h_ptr + offs_b[:, None] * stride_hb + offs_r[None, :]
            hv = tl.load(h_ptrs, mask=mask_b[:, None] & mask_r[None, :], other=0.0)
            acc = dot_acc(hv, w, acc, UPCAST)
        y = acc  # [BLOCK_B, BLOCK_D]
    mask = mask_b[:, None] & mask_d[None, :]
    if PARTIAL:
        p_ptrs = part_ptr + (pid_s * B + offs_b[:, None]).to(tl.int64) * D + offs_d[None, :]
        tl.store(p_ptrs, y, mask=mask)
        if FUSED:
            # Split-K "serial reduction" (as CUTLASS's semaphore): the CTA's partial stores
            # precede the barrier, the barrier precedes one gpu-scope acq_rel atomic; the
            # last of the n_split programs of this column tile sums every partial.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_d, 1, sem="acq_rel", scope="gpu")
            if arrived == n_split - 1:
                # CHUNK splits per load, so the sum waits on n_split / CHUNK latencies
                offs_c = tl.arange(0, CHUNK)
                tot = tl.zeros((BLOCK_B, BLOCK_D), tl.float32)
                for s0 in range(0, n_split, CHUNK):
                    sp = s0 + offs_c
                    q_ptrs = (part_ptr + (sp[:, None, None] * B + offs_b[None, :, None]).to(tl.int64) * D
                              + offs_d[None, None, :])  # fmt: skip
                    q_mask = (sp < n_split)[:, None, None] & mask[None, :, :]
                    tot += tl.sum(
                        tl.load(q_ptrs, mask=q_mask, other=0.0, cache_modifier=".cg"), axis=0
                    )
                tl.atomic_xchg(count_ptr + pid_d, 0)  # ready for the next launch
                finish(tot, b_ptr, out_ptr, offs_b, offs_d, mask, mask_d, stride_ob, HAS_BIAS)
    else:
        finish(y, b_ptr, out_ptr, offs_b, offs_d, mask, mask_d, stride_ob, HAS_BIAS)


@triton.jit
def sparse_mlp_down_reduce_kernel(
    part_ptr,  # [n_split, N] fp32
    b_ptr,  # [D]
    out_ptr,  # [N] = [B, D] contiguous
    n_split,
    N,
    D,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,  # splits read per step
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s0 in range(0, n_split, CHUNK):
        sp = s0 + offs_c
        ptrs = part_ptr + sp[:, None].to(tl.int64) * N + offs[None, :]
        acc += tl.sum(
            tl.load(ptrs, mask=(sp < n_split)[:, None] & mask[None, :], other=0.0), axis=0
        )
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % D, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sparse_mlp_down_ref(h, weight_t, idx, *, bias=None, rows_per_index=1):
    """Plain-PyTorch reference (fp32 math): ``h @ weight_t[idx] + bias``.

    >>> w2t = torch.eye(4, dtype=torch.float16)  # 4 neurons, d = 4
    >>> sparse_mlp_down_ref(torch.tensor([2.0, 3.0], dtype=torch.float16), w2t, torch.tensor([1, 3]))
    tensor([0., 2., 0., 3.], dtype=torch.float16)
    """
    rows = expand_rows(idx, rows_per_index)
    y = h.float() @ weight_t[rows].float()
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-device int32 arrival counters for the fused split reduction (left at zero by each
    launch). One set per device: launches on concurrent streams of one device must use
    ``config={"fused": False}``."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(4096, n), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def default_config(batch: int, k: int, d: int, device: torch.device,
                   n_rows: int | None = None, *, mode: str | None = None) -> dict:  # fmt: skip
    """Launch config: tuned for this GPU and shape in kernels/tuned/tuning_*.json
    (:mod:`~dejavu_lab.kernels.tuning`, when ``n_rows`` is given; the fastest of ``mode``), else
    at batch 1 one tile per program (:mod:`.down_tile`; ``mode="split"``: the deterministic
    split kernel), and for union batches the split kernel's tensor-core tiles from the H200
    sweeps in results/sparse_mlp_tuning*.json (d = 12288).

    >>> default_config(1, 4096, 12288, torch.device("cpu"))["mode"]
    'tile'
    >>> cfg = default_config(1, 4096, 12288, torch.device("cpu"), mode="split")
    >>> cfg["BLOCK_R"], cfg["BLOCK_D"], cfg["fused"]
    (32, 256, True)
    """
    if n_rows:
        tuned = tuning.lookup("sparse_mlp_down", n_rows, d, k / n_rows, batch, device, mode)
        if tuned is not None:
            return tuned
    if batch == 1 and mode != "split":
        return dict(TILE)
    sms = sm_count(device)
    if batch == 1:  # FMA path, 4 programs per SM; index prefetch measured no faster
        cfg = {"BLOCK_R": 32, "BLOCK_D": 256, "num_warps": 4, "fused": True, "programs": 4 * sms}
    else:  # tensor-core path, Triton-pipelined loads, 8 programs per SM
        cfg = {"BLOCK_R": 64, "BLOCK_D": 64, "num_warps": 4, "num_stages": 4, "fused": False,
               "programs": 8 * sms}  # fmt: skip
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], max(16, next_pow2(d)))
    return cfg


def _chunk(n_split: int, cap: int) -> int:
    """Power of two <= cap covering at most n_split (fewer compiled variants than n_split)."""
    return max(1, min(next_pow2(n_split), 1 << max(0, int(cap).bit_length() - 1)))


def _split(k: int, d: int, cfg: dict) -> tuple[int, int]:
    """(n_split, rows_per_split): enough programs to fill the GPU, whole BLOCK_R steps each."""
    n_col = triton.cdiv(d, cfg["BLOCK_D"])
    steps = triton.cdiv(k, cfg["BLOCK_R"])
    want = cfg.get("split") or max(1, min(steps, triton.cdiv(cfg["programs"], n_col)))
    rows = triton.cdiv(steps, want) * cfg["BLOCK_R"]
    return triton.cdiv(k, rows), rows


def sparse_mlp_down(
    h: torch.Tensor,
    weight_t: torch.Tensor,
    idx: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    rows_per_index: int = 1,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``h @ weight_t[idx] + bias``: the MLP output from the selected neurons only.

    h: [k * rows_per_index] or [B, k * rows_per_index] activations of the selected neurons in
    ``idx`` order (what :func:`sparse_mlp_up` returns); weight_t: [n_rows, d] = ``fc2.weight.T``
    made contiguous once at load time; idx: [k] distinct int32/int64 indices; bias: [d].
    Returns [d] or [B, d]. ``validate`` as in :func:`sparse_mlp_up`. When the selected rows
    are split across programs, the last program of each column tile sums the fp32 partials
    (arrival counters kept per device): launches on concurrent streams of one device should
    pass ``config={"fused": False}``, which reduces in a second kernel instead.

    >>> _ = torch.manual_seed(0)
    >>> h = torch.randn(3, dtype=torch.float16)  # activations of the 3 kept neurons
    >>> w2t = torch.randn(64, 16, dtype=torch.float16)  # fc2.weight.T: 64 neurons, d = 16
    >>> idx = torch.tensor([3, 10, 42])
    >>> y = sparse_mlp_down(h, w2t, idx)  # the Triton kernel on CPU under TRITON_INTERPRET=1
    >>> y.shape, torch.allclose(y, sparse_mlp_down_ref(h, w2t, idx), atol=1e-2)
    (torch.Size([16]), True)
    """
    check_float("h", h)
    dtype, device = h.dtype, h.device
    check_device(device, weight_t=weight_t, idx=idx, bias=bias)
    check_weight("weight_t", weight_t, dtype)
    n_rows, d = weight_t.shape
    g = int(rows_per_index)
    if g < 1 or n_rows % g:
        raise ValueError(f"rows_per_index={rows_per_index} must divide weight_t's {n_rows} rows.")
    check_vector("bias", bias, d, dtype)
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1:
        raise ValueError("idx must be a 1-D tensor of row indices.")
    k = idx.numel() * g
    hb, squeeze = as_batch("h", h, k)
    check_index("idx", idx, n_rows // g, device, validate)
    batch = hb.shape[0]
    res, res2 = output(out, batch, d, squeeze, dtype, device)
    if k == 0:
        res2.copy_(bias.expand(batch, d) if bias is not None else torch.zeros_like(res2))
        return res
    if not use_triton(device):
        res2.copy_(sparse_mlp_down_ref(hb, weight_t, idx, bias=bias, rows_per_index=g))
        return res
    mode = (config or {}).get("mode")
    cfg = {**default_config(batch, k, d, device, n_rows, mode=mode), **(config or {})}
    if cfg.get("mode") == "tile" and batch == 1:
        launch_tile(hb, weight_t, idx, bias, res2, g, cfg)
        return res
    if "programs_per_sm" in cfg:  # tuned tables record programs per multiprocessor
        cfg["programs"] = max(1, round(cfg["programs_per_sm"] * sm_count(device)))
    block_b = max(16, batch_block(batch)) if cfg.get("dot") else batch_block(batch)
    if block_b > 1 and cfg["BLOCK_R"] < 16:
        raise ValueError("config BLOCK_R must be >= 16 for batches above 1 (tensor-core path).")
    n_split, rows_per_split = _split(k, d, cfg)
    fused = n_split > 1 and cfg.get("fused", True)
    part = (
        torch.empty((n_split, batch, d), dtype=torch.float32, device=device)
        if n_split > 1
        else res2
    )
    n_col = triton.cdiv(d, cfg["BLOCK_D"])
    counts = _counters(device, n_col) if fused else part
    sparse_mlp_down_kernel[(n_col, n_split)](
        hb, weight_t, idx, bias if bias is not None else weight_t, res2, part, counts,
        batch, k, d, hb.stride(0), weight_t.stride(0), res2.stride(0), rows_per_split, n_split,
        G=g, HAS_BIAS=bias is not None, PARTIAL=n_split > 1, FUSED=fused, BLOCK_B=block_b,
        BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"], UPCAST=upcast_dot(dtype),
        PREFETCH=int(cfg.get("prefetch", 0)) if block_b == 1 else 0,
        CHUNK=_chunk(n_split, 32 * 32 * cfg["num_warps"] // (block_b * cfg["BLOCK_D"])),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    if n_split > 1 and not fused:
        n = batch * d
        block = 256
        sparse_mlp_down_reduce_kernel[(triton.cdiv(n, block),)](
            part, bias if bias is not None else part, res2, n_split, n, d,
            HAS_BIAS=bias is not None, BLOCK=block, CHUNK=_chunk(n_split, 16), num_warps=4,
        )  # fmt: skip
    return res
