"""Input checks and dispatch shared by the sparse kernels (one clear sentence per error)."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - the CUDA torch wheels bring Triton
    raise ImportError(
        "dejavu_lab.kernels needs Triton; install it with `pip install -e '.[kernels]'`."
    ) from exc

FLOAT_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpret() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Run the Triton kernel (CUDA, or CPU under the interpreter) rather than the reference."""
    return device.type == "cuda" or (device.type == "cpu" and interpret())


def check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; pass float16 or bfloat16 (use .half()).")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the input is {dtype}; cast it to match.")


def check_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"tensors are on {device}; these kernels run on CUDA (or CPU).")
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but the input is on {device}; move it with .to({str(device)!r})."
            )


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}.")


def check_rowmajor(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D row-major tensor; pass {name}.contiguous().")


def check_weight(name: str, w: torch.Tensor, dtype: torch.dtype) -> None:
    """A weight matrix: the input's float dtype, 2-D, row-major."""
    check_float(name, w, dtype)
    check_rowmajor(name, w)


def check_vector(name: str, t: torch.Tensor | None, n: int, dtype: torch.dtype) -> None:
    """An optional bias-like vector: ``None``, or the input's float dtype with shape [n]."""
    if t is not None:
        check_float(name, t, dtype)
        check_shape(name, t, (n,))


def check_thr(thr: torch.Tensor, n: int, name: str = "thr") -> None:
    """``thr`` must be a float32 vector of length ``n`` (one threshold per input column)."""
    if not isinstance(thr, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(thr).__name__}.")
    if thr.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {thr.dtype}; pass float32 thresholds (.float()).")
    check_shape(name, thr, (n,))
    if thr.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous().")


def check_index(
    name: str, idx: torch.Tensor, n: int, device: torch.device, validate: bool | None
) -> None:
    """Index tensor: 1-D int32/int64 on ``device``; range and uniqueness when ``validate``.

    ``validate=None`` checks values except while a CUDA graph is being captured (the check
    must read the values back to the host); pass ``validate=False`` in timed loops.
    """
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of row indices.")
    if idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {idx.dtype}; pass int32 or int64 indices.")
    if idx.device != device:
        raise ValueError(f"{name} is on {idx.device} but the input is on {device}; move it.")
    if validate is None:
        validate = not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if not validate or idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        raise ValueError(f"{name} holds values in [{lo}, {hi}] but must lie in [0, {n - 1}].")
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} holds duplicate indices; pass each selected row once.")


def as_batch(name: str, x: torch.Tensor, width: int) -> tuple[torch.Tensor, bool]:
    """[width] or [B, width] -> ([B, width] contiguous, was_1d); B limited to 1..32."""
    if x.dim() == 1:
        x, squeeze = x.unsqueeze(0), True
    else:
        squeeze = False
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [{width}] or [B, {width}].")
    if not 1 <= x.shape[0] <= 32:
        raise ValueError(
            f"{name} has batch {x.shape[0]}; these decoding kernels take 1 to 32 tokens (use a dense matmul above)."
        )
    return x.contiguous(), squeeze


def check_out(out: torch.Tensor | None, shape, dtype, device) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out has shape {tuple(out.shape)}, {out.dtype} on {out.device}; "
            f"expected {tuple(shape)}, {dtype} on {device}."
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous; allocate it with torch.empty.")


def output(out: torch.Tensor | None, batch: int, n: int, squeeze: bool, dtype, device):
    """(result, its [batch, n] view): ``out`` checked, or a new tensor; [n] when ``squeeze``."""
    shape = (n,) if squeeze else (batch, n)
    check_out(out, shape, dtype, device)
    res = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    return res, res.view(batch, n)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (2 on the CPU: small grids for the interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 2


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def batch_block(b: int) -> int:
    """Rows of the token tile: 1 for batch 1 (FMA path), else >= 16 (tensor-core tl.dot path)."""
    return 1 if b == 1 else max(16, next_pow2(b))


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` multiplies in fp32, which the CPU interpreter needs for bf16
    (Triton 3.9's interpreter returns garbage for a bf16 ``tl.dot``; fp16 and GPUs are fine)."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


def upcast_dot(dtype: torch.dtype) -> bool:
    return interpret() and dtype == torch.bfloat16
