"""The decoder's inputs (:mod:`dejavu_lab.engine`): its sizes and its prompts.

Seen before these checks: a prompt batch ``[2, S]`` given to the batch-1 ``prefill`` was
flattened silently into one prompt of ``2 S`` tokens; ``max_seq_len=16.5`` failed inside
``torch.zeros``; a float prompt failed inside the embedding. Each is one ``EngineError`` here.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..errors import EngineError
from .scalars import integer

__all__ = ["max_seq_len", "prompt", "size", "threshold"]


def _engine_error():
    return EngineError


def size(value, name: str, *, minimum: int = 0, maximum: int | None = None, hint: str = "") -> int:
    """A whole-number size of the engine (tokens, steps, a window), as ``int``.

    >>> size(4, "max_new_tokens", minimum=1)
    4
    >>> size(2.5, "kv_window", maximum=32)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: kv_window must be a whole number in [0, 32], got 2.5; pass e.g. ...
    """
    return integer(value, name, minimum=minimum, maximum=maximum, error=_engine_error(), hint=hint)


def max_seq_len(value, max_positions: int) -> int:
    """The cache length: a whole number of tokens in [2, the model's positions].

    >>> max_seq_len(4096, 2048)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: max_seq_len must be a whole number in [2, 2048], ...
    """
    return size(
        value,
        "max_seq_len",
        minimum=2,
        maximum=max_positions,
        hint=f"the model has {max_positions} positions (prompt + new tokens must fit)",
    )


def prompt(ids, *, batch: int = 1, vocab: int | None = None) -> torch.Tensor:
    """Prompt ids ``[batch, S]`` (or ``[S]`` when ``batch`` is 1) as int64 ``[batch, S]``.

    >>> prompt(torch.tensor([5, 6, 7])).shape
    torch.Size([1, 3])
    >>> prompt(torch.tensor([[5, 6, 7], [1, 2, 3]]))  # was flattened into 6 tokens
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: the decoder runs a batch of 1 but the prompt has ...
    """
    error = _engine_error()
    if not isinstance(ids, torch.Tensor):
        raise error(
            f"the prompt must be a tensor of token ids [1, S], got a {type(ids).__name__}; "
            "wrap it: torch.tensor([ids])."
        )
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise error(
            f"the prompt must hold integer token ids, got dtype {ids.dtype}; pass the "
            "tokenizer's input_ids."
        )
    if ids.dim() == 1 and batch == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != batch:
        raise error(
            f"the decoder runs a batch of {batch} but the prompt has shape {tuple(ids.shape)}; "
            f"pass [{batch}, S] (one row per sequence; rows are never joined into one prompt)."
        )
    if ids.numel() and ids.device.type != "meta":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab is not None and hi >= vocab):
            raise error(
                f"the prompt holds ids in [{lo}, {hi}] but the vocabulary is 0..{vocab - 1 if vocab else '?'}; "
                "tokenize with this model's own tokenizer."
            )
    return ids.long()


def threshold(key, thr) -> None:
    """One entry of ``SparseConfig.thresholds``: a finite number (one threshold for the site), or
    a 1-D float tensor (one per input column) without NaN or -inf; +inf marks a column never
    read (WINA's ``t / ||W[:, i]||`` of a zero column).

    A NaN compared with ``|x| > thr`` is False: the site was silently never read.

    >>> threshold((0, "mlp_in"), torch.tensor([0.1, float("inf")]))  # fine
    >>> threshold((0, "mlp_in"), torch.tensor([0.1, float("nan")]))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: thresholds[(0, 'mlp_in')] holds 1 NaN or -inf ...
    """
    if isinstance(thr, numbers.Real) and not isinstance(thr, bool):
        if not math.isfinite(thr):
            raise EngineError(
                f"thresholds[{key!r}] is {thr}, which no |x| passes the way a threshold should "
                "(NaN: never read; inf: the whole site dropped); pass a finite number, e.g. "
                "calibrated.site_thresholds(model)[key]."
            )
        return
    if not isinstance(thr, torch.Tensor) or thr.dim() != 1 or not thr.is_floating_point():
        raise EngineError(
            f"thresholds[{key!r}] must be a number (one threshold for the site) or a 1-D tensor "
            "of floats (one threshold per input column); pass e.g. 0.1."
        )
    bad = int((torch.isnan(thr) | (thr == float("-inf"))).sum()) if thr.device.type != "meta" else 0
    if bad:
        raise EngineError(
            f"thresholds[{key!r}] holds {bad} NaN or -inf of {thr.numel()} (a NaN column is never "
            "read, -inf keeps it always); pass finite thresholds (+inf marks a column never read)."
        )
