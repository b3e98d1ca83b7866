"""Per-device scratch buffers of the split-reduction kernels (threshold GEMV, fused MLP).

The kernels keep three kinds of device memory between launches, none of which the caller sees:
int32 arrival counters and fp32 sums that each launch leaves at zero, and int32 row lists that
each launch overwrites. A buffer only ever grows, and every buffer ever handed out stays
referenced here, so a CUDA graph that captured an older (smaller) buffer keeps valid memory.
Allocate outside graph capture (the first eager call of a shape does it). Launches on
concurrent streams of one device would share these buffers: keep them on one stream.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_KEEP: list[torch.Tensor] = []  # every buffer handed out, so captured graphs stay valid


def buffer(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-initialised buffer of at least ``numel`` elements for ``(device, kind)``."""
    key = (torch.device(device), kind)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        size = max(4096, 1 << max(0, int(numel) - 1).bit_length())
        buf = torch.zeros(size, dtype=dtype, device=device)
        _BUFFERS[key] = buf
        _KEEP.append(buf)
    return buf


def counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 arrival counters, zero between launches (the last arriving program resets them)."""
    return buffer(device, "counters", n, torch.int32)


def sums(device: torch.device, n: int) -> torch.Tensor:
    """fp32 atomic-accumulation buffer, zero between launches (the last program re-zeroes it)."""
    return buffer(device, "sums", n, torch.float32)


def partials(device: torch.device, n: int) -> torch.Tensor:
    """fp32 per-split partial sums (fully overwritten by each launch)."""
    return buffer(device, "partials", n, torch.float32)


def rows(device: torch.device, n: int) -> torch.Tensor:
    """int32 compacted row lists, one slice per program (overwritten by each launch)."""
    return buffer(device, "rows", n, torch.int32)
