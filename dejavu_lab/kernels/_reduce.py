"""Split-K epilogue shared by the threshold GEMV, the fused MLP and the down-projection kernels.

A program holds an fp32 tile ``y`` [BLOCK_B, BLOCK_D] that is one split's share of the output.
``split_reduce`` writes it out (one split), or stores it as an fp32 partial for the last program
of the column tile to arrive to sum in split order (``REDUCE=1``: CUTLASS's serial split-K,
deterministic), or adds it into a zeroed fp32 buffer with atomics (``REDUCE=2``). An arrival
counter per column tile (zero between launches, reset by the last arrival) decides who sums.

Ordering: every thread's partial stores precede a CTA barrier, which precedes one gpu-scope
acq_rel atomic on the counter; the last arrival's loads follow its acquire. ``FENCE`` also
makes every thread execute ``fence.acq_rel.gpu`` before the barrier, so its own atomics are
performed at gpu scope before the counter moves. (Measured on an H200 with Triton 3.6: without
it, relaxed fp32 atomics from many programs into one buffer could still be in flight when the
last arrival read the sums; see ``tests/kernels/test_threshold.py``.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def take_zero(ptrs, mask):
    """The fp32 values at ``ptrs`` (masked: 0), leaving zeros there, by one int32 atomic
    exchange per element. A load followed by a store of zeros races: the compiler may give
    the two different thread layouts, so one thread can zero an element before another has
    read it (seen on an H200 with Triton 3.6 as 10-50% wrong sums). The exchange is on the
    int32 bits because the interpreter has no fp32 exchange."""
    bits = tl.atomic_xchg(ptrs.to(tl.pointer_type(tl.int32)), tl.full(ptrs.shape, 0, tl.int32),
                          mask=mask, sem="relaxed")  # fmt: skip
    return tl.where(mask, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def finish(y, b_ptr, out_ptr, offs_b, offs_d, mask, mask_d, stride_ob, HAS_BIAS: tl.constexpr):
    """out[offs_b, offs_d] = y (+ bias), cast to the output dtype."""
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_b[:, None] * stride_ob + offs_d[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gpu_fence(t, FENCE: tl.constexpr):
    """Every thread holding an element of ``t`` executes ``fence.acq_rel.gpu`` (GPU only)."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [t],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def split_reduce(y, ws_ptr, count_ptr, b_ptr, out_ptr, offs_b, offs_d, mask_b, mask_d, B, D,
                 stride_ob, pid_d, pid_s, n_split, REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 CHUNK: tl.constexpr, FENCE: tl.constexpr):  # fmt: skip
    """Sum the [BLOCK_B, BLOCK_D] fp32 tile ``y`` of split ``pid_s`` over the ``n_split`` splits
    of column tile ``pid_d`` and write the output. ws: fp32 partials [n_split, B, D] (serial)
    or sums [B, D] (atomic, zero between launches); count: int32 counters [>= n_col]."""
    mask = mask_b[:, None] & mask_d[None, :]
    if REDUCE == 0:
        finish(y, b_ptr, out_ptr, offs_b, offs_d, mask, mask_d, stride_ob, HAS_BIAS)
    else:
        if REDUCE == 1:  # fp32 partial per split, summed in split order by the last arrival
            p_ptrs = ws_ptr + (pid_s * B + offs_b[:, None]).to(tl.int64) * D + offs_d[None, :]
            tl.store(p_ptrs, y, mask=mask)
        else:  # fp32 atomics into a buffer that every launch leaves at zero
            tl.atomic_add(
                ws_ptr + offs_b[:, None] * D + offs_d[None, :], y, mask=mask, sem="relaxed"
            )
        gpu_fence(offs_d, FENCE)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_d, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            if REDUCE == 1:
                offs_c = tl.arange(0, CHUNK)  # CHUNK partials per load
                tot = tl.zeros(y.shape, tl.float32)
                for s0 in range(0, n_split, CHUNK):
                    sp = s0 + offs_c
                    q_ptrs = (ws_ptr + (sp[:, None, None] * B + offs_b[None, :, None]).to(tl.int64) * D
                              + offs_d[None, None, :])  # fmt: skip
                    q_mask = (sp < n_split)[:, None, None] & mask[None, :, :]
                    tot += tl.sum(
                        tl.load(q_ptrs, mask=q_mask, other=0.0, cache_modifier=".cg"), axis=0
                    )
            else:
                s_ptrs = ws_ptr + offs_b[:, None] * D + offs_d[None, :]
                tot = take_zero(s_ptrs, mask)  # read, and leave zeros for the next launch
            tl.atomic_xchg(count_ptr + pid_d, 0)  # ready for the next launch
            finish(tot, b_ptr, out_ptr, offs_b, offs_d, mask, mask_d, stride_ob, HAS_BIAS)


def chunk(n_split: int, cap: int) -> int:
    """Partials read per step by the serial sum: a power of two <= ``cap``, <= n_split's.

    >>> chunk(17, 32), chunk(3, 32), chunk(100, 8)
    (32, 4, 8)
    """
    return max(
        1, min(1 << max(0, int(n_split) - 1).bit_length(), 1 << max(0, int(cap).bit_length() - 1))
    )
