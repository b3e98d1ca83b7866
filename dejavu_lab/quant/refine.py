"""Int4 with less weight error than round-to-nearest: each group's range searched and refitted.

Round-to-nearest (:func:`~dejavu_lab.quant.int4.quantize`) maps a group's whole range onto
0..15, so one outlier stretches the step for every other weight of the group. Here each group
of each output tries ranges shrunk about their centre (``SHRINK``), and for each one refits the
scale and min to the codes it gave by least squares (the straight line through ``(q, w)``:
llama.cpp's k-quants refine their blocks the same way), then re-chooses the codes for the
refitted pair, rounded to the scales' dtype first, as the kernels read them. The pair with the
smallest squared error over the group wins; round-to-nearest is the first candidate, so the
error never grows. The result is an ordinary :class:`~dejavu_lab.quant.Int4Weight`: the kernels,
the engine and the byte counts are unchanged.

The plain squared error treats every input channel alike, but a layer's output error is
``sum_i x_i dw_io``: an error on a channel whose activations are large costs more. With
``importance`` (each input channel's mean ``x_i^2`` over calibration text, the diagonal of the
inputs' second moment, as GPTQ's Hessian and AWQ's scales use it) the search and the refits
minimise ``sum_i E[x_i^2] dw_io^2`` instead: that is the output's error when the channels are
uncorrelated.
"""

from __future__ import annotations

import torch

from .int4 import Int4Weight, QuantError, pack, quantize

__all__ = ["SHRINK", "quantize_mse"]

#: the range of each group scaled about its centre by these factors (1.0: round-to-nearest's)
SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
REFITS = 2  # least-squares refits of (scale, min) per candidate range


def _codes(w, scales, mins):
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round((w - mins[:, None]) / safe[:, None]).clamp_(0, 15)


def _err(w, h, scales, mins):
    """The codes for (scales, mins) and their squared error per group and output, each row
    weighted by ``h``."""
    q = _codes(w, scales, mins)
    return q, (h * (q * scales[:, None] + mins[:, None] - w).pow(2)).sum(1)


def _refit(w, q, scales, mins, h):
    """Weighted least-squares (scale, min) of ``w ≈ q s + m`` per group and output (row
    weights ``h`` [groups, group, 1]); where the codes of a group are all equal the line is
    undefined and the given pair stays."""
    n = h.sum(1)
    sq, sw = (h * q).sum(1), (h * w).sum(1)
    sqq, sqw = (h * q * q).sum(1), (h * q * w).sum(1)
    det = n * sqq - sq * sq
    ok = det > 0
    safe = torch.where(ok, det, torch.ones_like(det))
    s = (n * sqw - sq * sw) / safe
    m = (sqq * sw - sq * sqw) / safe
    good = ok & (s > 0) & (det > 1e-9 * n * sqq)
    return torch.where(good, s, scales), torch.where(good, m, mins)


def quantize_mse(
    w_t: torch.Tensor,
    group: int = 128,
    dtype: torch.dtype | None = None,
    *,
    importance: torch.Tensor | None = None,
) -> Int4Weight:
    """Int4 of ``w_t`` (``[in, out]``) with each group's (scale, min) chosen for the smallest
    squared error, each input row's weighted by ``importance`` [in] when given (module
    docstring); the checks and layout of :func:`~dejavu_lab.quant.int4.quantize`.

    >>> torch.manual_seed(0) is not None
    True
    >>> w = torch.randn(256, 64)  # a Gaussian's tails stretch round-to-nearest's ranges
    >>> rtn, mse = quantize(w, group=128), quantize_mse(w, group=128)
    >>> err = lambda q: float((q.dequantize() - w).pow(2).sum() / w.pow(2).sum())
    >>> round(err(rtn), 4), round(err(mse), 4)
    (0.0101, 0.0087)
    """
    base = quantize(w_t, group=group, dtype=dtype)  # the checks, the dtype, the RTN candidate
    dtype = base.dtype
    n_in, n_out = w_t.shape
    w = w_t.float().contiguous().reshape(n_in // group, group, n_out)
    if importance is None:
        h = torch.ones(n_in // group, group, 1)
    else:
        h = importance.detach().float().cpu().reshape(-1)
        if h.numel() != n_in or not torch.isfinite(h).all() or (h < 0).any():
            raise QuantError(f"importance must be {n_in} finite, non-negative numbers (one per "
                             "input channel: its mean squared activation).")  # fmt: skip
        h = (h / h.mean().clamp_min(1e-30)).clamp_min(1e-6).reshape(n_in // group, group, 1)
    h = h.to(w.device)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best_s, best_m = base.scales.float(), base.mins.float()
    best_err = _err(w, h, best_s, best_m)[1]
    for f in SHRINK:
        mins = (mid - f * half).to(dtype).float()
        scales = ((2 * f * half) / 15).to(dtype).float()
        for _ in range(REFITS + 1):
            q, err = _err(w, h, scales, mins)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, scales, best_s)
            best_m = torch.where(better, mins, best_m)
            scales, mins = _refit(w, q, scales, mins, h)
            scales, mins = scales.to(dtype).float(), mins.to(dtype).float()
    q = _codes(w, best_s, best_m).reshape(n_in, n_out).to(torch.uint8)
    return Int4Weight(pack(q), best_s.to(dtype), best_m.to(dtype), group)
