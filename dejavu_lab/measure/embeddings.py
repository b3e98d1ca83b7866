"""Slowly changing embeddings (Deja Vu §3.3, Fig. 5).

Two measurements of how little a block moves the residual stream:

- :func:`layer_cosine` — cosine similarity between a token's residual state at layer l and at
  layer l + n (paper: > 0.95 between consecutive layers for OPT-125m…175B, ~0.99 for OPT-175B
  beyond layer 2). States are X_l = ``blocks.{l}.hook_resid_pre`` for l < L and X_L = the last
  block's ``hook_resid_post``, so X_0 is the embedding.
- :func:`residual_norms` — ‖X‖ versus ‖F(X)‖ for each attention and MLP sub-block (paper:
  ‖X‖ ≈ 1000–2000 against ‖F(X)‖ ≈ 50–150 in OPT-175B after layer 1). For attention
  X = resid_pre, F(X) = attn_out; for the MLP X = resid_mid, F(X) = mlp_out.

Both stream: the cosine keeps only the last ``max(gaps)`` layers of one batch in memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..arch import Arch, get_arch
from ._run import stream, token_frame

__all__ = ["layer_cosine", "residual_norms"]


def layer_cosine(
    model,
    windows: torch.Tensor,
    gaps: tuple[int, ...] = (1, 2, 4, 8),
    *,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> pd.DataFrame:
    """cos(X_l, X_{l+n}) for every token, layer l and gap n in ``gaps`` (0 allowed: itself).

    ``windows``: LongTensor [n, window]. Returns one row per (layer, gap, window, pos) with
    columns ``layer`` (l, the earlier state), ``gap``, ``window``, ``pos``, ``cosine``; layers run
    0..L-n (X_L is the output of the last block).

    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    >>> med = layer_cosine(model, ids, gaps=(1,)).groupby("layer").cosine.median()
    >>> round(float(med[0]), 1), round(float(med[2:].median()), 2)  # embedding; then slow
    (0.0, 0.97)
    """
    arch = arch or get_arch(model)
    if not gaps or min(gaps) < 0:
        raise ValueError(f"gaps must be non-negative layer distances, got {gaps!r}.")
    keep = max(gaps)
    chunks: list[dict[str, np.ndarray]] = []

    def make_hooks(cursor):
        states: dict[int, torch.Tensor] = {}  # layer -> [b, p, d], the last `keep` layers

        def record(t: torch.Tensor, name: str) -> None:
            i = int(name.split(".")[1])
            j = i + 1 if name.endswith("hook_resid_post") else i  # index of this state X_j
            states[j] = t.detach().float()
            w, p = cursor.window_ids(t.shape[1])
            for n in gaps:
                if j - n in states:
                    cos = torch.nn.functional.cosine_similarity(states[j - n], states[j], dim=-1)
                    chunks.append(
                        {
                            "layer": np.full(w.size, j - n, dtype=np.int16),
                            "gap": np.full(w.size, n, dtype=np.int16),
                            "window": w,
                            "pos": p,
                            "cosine": cos.flatten().cpu().numpy().astype(np.float32),
                        }
                    )
            for old in [k for k in states if k < j - keep]:
                del states[old]

        last = f"blocks.{arch.n_layers - 1}.hook_resid_post"
        return {"blocks.*.hook_resid_pre": record, last: record}

    stream(model, windows, make_hooks, arch=arch, batch_size=batch_size, progress=progress)
    return token_frame(chunks).sort_values(["gap", "layer", "window", "pos"], ignore_index=True)


def residual_norms(
    model,
    windows: torch.Tensor,
    *,
    arch: Arch | None = None,
    batch_size: int = 1,
    progress: bool = False,
) -> pd.DataFrame:
    """‖X‖, ‖F(X)‖ and ‖X‖ / ‖F(X)‖ per token for each attention and MLP sub-block.

    Returns one row per (layer, block, window, pos) with columns ``layer``, ``block``
    (``"attn"`` or ``"mlp"``), ``window``, ``pos``, ``norm_x``, ``norm_fx``, ``ratio``.
    For post-LN models (OPT-350m) X of the MLP is the attention norm's output, as the MLP sees it.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> norms = residual_norms(model, torch.randint(0, 128, (2, 8)))
    >>> len(norms)  # 2 layers x 2 sub-blocks x 16 tokens
    64
    >>> norms.columns.tolist()
    ['layer', 'block', 'window', 'pos', 'norm_x', 'norm_fx', 'ratio']
    """
    arch = arch or get_arch(model)
    chunks: list[dict[str, np.ndarray]] = []
    x_name = {"hook_attn_out": "hook_resid_pre", "hook_mlp_out": "hook_resid_mid"}
    block_of = {"hook_attn_out": "attn", "hook_mlp_out": "mlp"}

    def make_hooks(cursor):
        norms: dict[str, torch.Tensor] = {}  # the input norm of the pending sub-block

        def keep_norm(t: torch.Tensor, name: str) -> None:
            norms[name] = t.float().norm(dim=-1)

        def record(t: torch.Tensor, name: str) -> None:
            i, point = name.split(".", 2)[1:]
            nx = norms.pop(f"blocks.{i}.{x_name[point]}")
            nf = t.float().norm(dim=-1)
            w, p = cursor.window_ids(t.shape[1])
            chunks.append(
                {
                    "layer": np.full(w.size, int(i), dtype=np.int16),
                    "block": np.full(w.size, block_of[point]),
                    "window": w,
                    "pos": p,
                    "norm_x": nx.flatten().cpu().numpy().astype(np.float32),
                    "norm_fx": nf.flatten().cpu().numpy().astype(np.float32),
                }
            )

        return {
            "blocks.*.hook_resid_pre": keep_norm,
            "blocks.*.hook_resid_mid": keep_norm,
            "blocks.*.hook_attn_out": record,
            "blocks.*.hook_mlp_out": record,
        }

    stream(model, windows, make_hooks, arch=arch, batch_size=batch_size, progress=progress)
    df = token_frame(chunks)
    df["ratio"] = df["norm_x"] / df["norm_fx"].clip(lower=np.finfo(np.float32).tiny)
    return df.sort_values(["block", "layer", "window", "pos"], ignore_index=True)
