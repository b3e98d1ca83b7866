"""The inputs of a batched decoder: prompts of different lengths, as HF gives them or as a list.

Seen in other engines: a left-padded batch whose padding tokens were attended, or a batch of one
flattened into one long prompt. Here each row becomes its own 1-D prompt (padding dropped by
``attention_mask``), and a batch that cannot run is one ``EngineError`` sentence.
"""

from __future__ import annotations

import torch

from ..checks import engine as check_engine
from .config import EngineError

__all__ = ["batch_prompts"]


def batch_prompts(
    prompts, attention_mask=None, *, vocab: int, max_batch: int, max_seq_len: int, device=None
) -> list[torch.Tensor]:
    """The prompts of a batch as a list of 1-D int64 id tensors on ``device``, checked.

    ``prompts``: a list of 1-D id tensors, or [B, S] ids with an optional HF-style
    ``attention_mask`` (1 = a token, 0 = padding: left or right padding both work, each row's
    tokens are taken in order).

    >>> ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    >>> mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    >>> [r.tolist() for r in batch_prompts(ids, mask, vocab=16, max_batch=4, max_seq_len=8)]
    [[5, 6], [7, 8, 9, 10]]
    >>> batch_prompts([torch.tensor([1]), torch.tensor([], dtype=torch.long)], vocab=16,
    ...               max_batch=4, max_seq_len=8)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: sequence 1's prompt is empty; give each at least one token.
    """
    if isinstance(prompts, torch.Tensor):
        ids = check_engine.prompt(
            prompts, batch=prompts.shape[0] if prompts.dim() == 2 else 1, vocab=vocab
        )
        if attention_mask is None:
            rows = list(ids)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != ids.shape:
                raise EngineError(
                    f"attention_mask must be a tensor of the ids' shape {tuple(ids.shape)} "
                    "(1 = a token, 0 = padding)."
                )
            rows = [r[m.to(r.device).bool()] for r, m in zip(ids, attention_mask, strict=True)]
    elif isinstance(prompts, (list, tuple)):
        if attention_mask is not None:
            raise EngineError("attention_mask goes with [B, S] ids; a list needs none.")
        rows = [check_engine.prompt(p, vocab=vocab)[0] for p in prompts]
    else:
        raise EngineError(
            f"prompts must be a list of 1-D id tensors or [B, S] ids, got {type(prompts).__name__}."
        )
    if not 1 <= len(rows) <= max_batch:
        raise EngineError(
            f"the batch has {len(rows)} sequences but this BatchDecoder decodes 1 to "
            f"{max_batch} (max_batch); split the batch or build a larger one (<= 32)."
        )
    for b, r in enumerate(rows):
        if r.numel() == 0:
            raise EngineError(f"sequence {b}'s prompt is empty; give each at least one token.")
        if r.numel() >= max_seq_len:
            raise EngineError(
                f"sequence {b}'s prompt has {r.numel()} tokens but the cache holds "
                f"{max_seq_len}; build the BatchDecoder with a larger max_seq_len."
            )
    return [r.to(device) for r in rows]
