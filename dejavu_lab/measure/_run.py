"""Shared plumbing for the measurements: forward token windows in batches with streaming hooks.

Every measurement attaches callbacks that reduce activations on the spot (a few numbers per
token), so a long text never holds every layer's activations at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..hooks import hooks

__all__ = ["Cursor", "check_fraction", "stream", "token_frame"]


class Cursor:
    """Which windows the current forward pass holds, for callbacks that label their rows."""

    def __init__(self) -> None:
        self.start = 0  # index of the first window of the current batch
        self.batch = 0  # windows in the current batch

    def window_ids(self, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(window, pos) labels of a [batch, pos] block flattened row-major."""
        w = np.repeat(np.arange(self.start, self.start + self.batch), n_pos)
        p = np.tile(np.arange(n_pos), self.batch)
        return w, p


@torch.no_grad()
def stream(
    model,
    windows: torch.Tensor,
    make_hooks: Callable[[Cursor], dict],
    *,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
    desc: str = "measure",
) -> Arch:
    """Run ``windows`` [n, window] through ``model`` with the hooks ``make_hooks(cursor)``."""
    if windows.dim() != 2 or windows.shape[0] == 0:
        raise ValueError(
            f"windows must be a non-empty [n, window] LongTensor (see corpus.token_windows), "
            f"got shape {tuple(windows.shape)}."
        )
    arch = arch or get_arch(model)
    device = next(model.parameters()).device
    cursor = Cursor()
    starts = range(0, windows.shape[0], batch_size)
    with hooks(model, make_hooks(cursor), arch):
        for s in tqdm(starts, desc=desc, disable=not progress, leave=False):
            ids = windows[s : s + batch_size].to(device)
            cursor.start, cursor.batch = s, ids.shape[0]
            model(input_ids=ids)
    return arch


def token_frame(chunks: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    """Concatenate per-hook column chunks (equal-length arrays) into one tidy frame."""
    if not chunks:
        return pd.DataFrame()
    cols = chunks[0].keys()
    return pd.DataFrame({c: np.concatenate([np.asarray(ch[c]) for ch in chunks]) for c in cols})


def check_fraction(name: str, value: float, *, closed: bool = False) -> float:
    """``value`` in (0, 1] (``closed``) or [0, 1); one clear sentence otherwise."""
    ok = 0 < value <= 1 if closed else 0 <= value < 1
    if not ok:
        interval = "(0, 1]" if closed else "[0, 1)"
        raise ValueError(f"{name} must be in {interval}, got {value!r}.")
    return float(value)
