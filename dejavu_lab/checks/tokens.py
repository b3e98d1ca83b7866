"""Token ids and windows: an integer tensor of the right shape, inside the vocabulary and the
model's positions.

Refused with one sentence (``CorpusError``) instead of an ``IndexError`` deep inside
``nn.Embedding`` (a device-side assert on a GPU), a silently wrong answer or a NaN:

- a list, a numpy array or a string instead of a tensor (the message says ``torch.tensor(ids)``);
- float or bool dtypes (int8 … int64 are fine and come back as int64);
- a 1-D tensor where ``[batch, pos]`` is expected, an empty batch, a 3-D tensor;
- ids below 0 or at or above the vocabulary size;
- windows longer than the model's positions (OPT crashes, RoPE models extrapolate silently);
- one-token windows for perplexity (nothing to predict: the mean NLL is NaN).
"""

from __future__ import annotations

import torch

from ..errors import CorpusError

__all__ = ["model_limits", "text", "token_ids", "windows"]


def _error(msg: str):
    return CorpusError(msg)


def model_limits(model) -> tuple[int | None, int | None]:
    """``(vocabulary size, longest sequence)`` of a Hugging Face model (None where unknown).

    >>> from dejavu_lab.models import random_model
    >>> model_limits(random_model("tiny-opt").model)
    (128, 2048)
    """
    if model is None:
        return None, None
    try:
        vocab = int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        vocab = None
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg  # multimodal wrappers keep it one level down
    positions = getattr(cfg, "max_position_embeddings", None)
    return vocab, int(positions) if isinstance(positions, int) else None


def token_ids(
    ids,
    model=None,
    *,
    vocab: int | None = None,
    max_positions: int | None = None,
    what: str = "input_ids",
    min_len: int = 1,
    hint_1d: str = "",
) -> torch.Tensor:
    """Check ids [batch, pos] against ``model`` (or ``vocab``/``max_positions``); int64 ids back.

    >>> token_ids(torch.tensor([[1, 2, 3]], dtype=torch.int32), vocab=128).dtype
    torch.int64
    >>> token_ids(torch.tensor([[1, 2, 300]]), vocab=128)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: input_ids hold ids up to 300 but the vocabulary has 128 ...
    """
    if not isinstance(ids, torch.Tensor):
        kind = type(ids).__name__
        raise _error(
            f"{what} must be a torch tensor of token ids [batch, pos], got a {kind}; "
            f"wrap it: torch.tensor({what})."
        )
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise _error(
            f"{what} must hold integer token ids, got dtype {ids.dtype}; pass the tokenizer's "
            "input_ids (embeddings go through inputs_embeds, not here)."
        )
    if ids.dim() != 2:
        fix = hint_1d or (f"pass {what}[None] for one sequence" if ids.dim() == 1 else "")
        raise _error(
            f"{what} must be 2-D [batch, pos], got shape {tuple(ids.shape)}"
            + (f"; {fix}." if fix else "; reshape it to [batch, pos].")
        )
    if ids.shape[0] == 0:
        raise _error(
            f"{what} must be a non-empty [n, window] tensor, got shape {tuple(ids.shape)}; pass at "
            "least one sequence (is the text shorter than one window?)."
        )
    if ids.shape[1] < min_len:
        raise _error(
            f"{what} are {ids.shape[1]} token(s) long, got shape {tuple(ids.shape)}; a one-token "
            "window predicts nothing (its perplexity is NaN): cut windows of 2 or more tokens "
            "with token_windows(tokenizer, text, window)."
        )
    m_vocab, m_pos = model_limits(model)
    vocab, max_positions = vocab or m_vocab, max_positions or m_pos
    if ids.device.type != "meta":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0:
            raise _error(
                f"{what} hold a negative id ({lo}) but token ids start at 0; tokenize with the "
                "model's own tokenizer."
            )
        if vocab is not None and hi >= vocab:
            raise _error(
                f"{what} hold ids up to {hi} but the vocabulary has {vocab} tokens (ids "
                f"0..{vocab - 1}); tokenize with this model's own tokenizer."
            )
    if max_positions is not None and ids.shape[1] > max_positions:
        raise _error(
            f"{what} are {ids.shape[1]} tokens long but the model has {max_positions} positions; "
            f"use windows of at most {max_positions} tokens."
        )
    return ids if ids.dtype == torch.int64 else ids.long()


def windows(windows, model=None, *, min_len: int = 2, what: str = "windows") -> torch.Tensor:
    """Check token windows [n, window] (from :func:`dejavu_lab.corpus.token_windows`).

    >>> windows(torch.tensor([[5], [6]]))  # one token per window: perplexity would be NaN
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: windows are 1 token(s) long, got shape (2, 1); a one-token window ...
    """
    return token_ids(
        windows,
        model,
        what=what,
        min_len=min_len,
        hint_1d=f"pass {what}[None] for one window, or token_windows(...) for a text",
    )


def text(value, tokenizer) -> str:
    """The ``text`` and ``tokenizer`` given to :func:`dejavu_lab.corpus.token_windows`.

    >>> tokenizer = lambda text, **kw: None  # any callable tokenizer
    >>> text(["two", "documents"], tokenizer)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: text must be one string, got a list; join the documents ...
    >>> text(" " * 4000, tokenizer)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: the text is only whitespace (4000 characters); pass real text ...
    """
    if tokenizer is None or not callable(tokenizer):
        raise _error(
            "token_windows needs the model's tokenizer (random-init models have none: build "
            "their windows with torch.randint instead)."
        )
    if not isinstance(value, str):
        raise _error(
            f"text must be one string, got a {type(value).__name__}; join the documents first, "
            "e.g. '\\n\\n'.join(docs)."
        )
    if not value.strip():  # whitespace tokenizes to windows of spaces: a measurement of nothing
        raise _error(
            f"the text is {'empty' if not value else 'only whitespace'} ({len(value)} "
            "characters); pass real text (a corpus name, or a file of prose)."
        )
    return value
