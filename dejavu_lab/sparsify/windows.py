"""The study's text: calibration windows and held-out windows, cut as chapter 40 cuts a corpus.

The corpus's first ``train_tokens`` (8192) tokens are training text — calibration reads its
first ``calibration_tokens``, DejaVu's predictors train on all of it — and perplexity is
measured on the ``eval_windows`` windows right after it. Calibration may read another text
instead; its windows that share a run of :data:`SHINGLE` tokens with the evaluated ones are
left out (:func:`overlapping`). The frontier (:mod:`~dejavu_lab.sparsify.frontier`), its
command and the chapters cut their text here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..corpus import CorpusError, load_text, token_windows
from ..vocab import CORPORA

__all__ = ["CALIBRATION_TOKENS", "SHINGLE", "TRAIN_TOKENS", "overlapping", "study_windows"]

TRAIN_TOKENS = 8192  # chapter 40's training text: the corpus's first tokens
# the thresholds calibrate on all of it (the CLI's default too). On the demo model, TEAL
# (greedy) at 50% (0.49 of the bytes) calibrated on the first 2048 tokens gave +36% perplexity
# on the 1024 held-out tokens, on all 8192 +31%, on 24k (beyond the held-out text too) +37%:
# the spread of the thresholds' estimate, not a trend
CALIBRATION_TOKENS = TRAIN_TOKENS
SHINGLE = 16  # tokens in a row two texts must share to count as overlapping (study_windows)


def _text(source: str) -> str:
    """A corpus by name (:func:`~dejavu_lab.corpus.load_text`) or a UTF-8 text file."""
    if source in CORPORA:
        return load_text(source)
    try:
        return Path(source).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{source} is not UTF-8 text; pass a UTF-8 text file.") from None


def overlapping(windows: torch.Tensor, other: torch.Tensor, k: int = SHINGLE) -> torch.Tensor:
    """Which of ``windows`` [n, w] share a run of ``k`` tokens with any window of ``other``:
    bool [n]. Two tokenisations of the same passage agree away from its ends, so a shared
    ``k``-token run finds a copied passage wherever it starts.

    >>> a = torch.arange(40).view(4, 10)
    >>> overlapping(a, torch.arange(13, 30).view(1, 17), k=4).tolist()
    [False, True, True, False]
    """
    k = max(1, min(k, windows.shape[1], other.shape[1]))
    seen = {tuple(r[i : i + k]) for r in other.tolist() for i in range(len(r) - k + 1)}
    return torch.tensor(
        [any(tuple(r[i : i + k]) in seen for i in range(len(r) - k + 1)) for r in windows.tolist()],
        dtype=torch.bool,
    )


def study_windows(
    tokenizer,
    corpus: str = "demo",
    window: int = 512,
    eval_windows: int = 2,
    train_tokens: int = TRAIN_TOKENS,
    calibration_tokens: int = CALIBRATION_TOKENS,
    calibration: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration windows, held-out windows) of the study, as chapter 40 cuts the corpus.

    ``corpus`` and ``calibration``: corpus names or text files. Without ``calibration`` (or
    with the corpus itself) calibration reads the first ``calibration_tokens`` of the corpus's
    ``train_tokens`` training tokens; with another text, its first windows that share no
    :data:`SHINGLE`-token run with the held-out windows (:func:`overlapping`).

    >>> from dejavu_lab.models import load_model
    >>> calib, held_out = study_windows(load_model("demo").tokenizer)
    >>> tuple(calib.shape), tuple(held_out.shape)  # windows 0-15 and 16-17 of 512 tokens
    ((16, 512), (2, 512))
    """
    skip = math.ceil(train_tokens / window)
    n_calib = max(1, math.ceil(calibration_tokens / window))
    same = calibration is None or calibration == corpus
    if same and n_calib > skip:
        raise ValueError(
            f"calibration_tokens ({calibration_tokens}) must not exceed train_tokens "
            f"({train_tokens}): the evaluated text starts after them; calibrate on fewer tokens "
            "or on another text."
        )
    w = token_windows(tokenizer, _text(corpus), window, skip + eval_windows)
    if w.shape[0] <= skip:
        raise CorpusError(
            f"{corpus} has no {window}-token window after its first {train_tokens} tokens "
            "(the training text); pass a longer text, fewer training tokens or a smaller window."
        )
    held_out = w[skip:]
    if same:
        return w[:n_calib], held_out
    c = token_windows(tokenizer, _text(calibration), window)
    keep = c[~overlapping(c, held_out)]
    if keep.shape[0] < n_calib:
        raise CorpusError(
            f"{calibration} has {keep.shape[0]} {window}-token windows outside the evaluated "
            f"text ({c.shape[0] - keep.shape[0]} overlap it), fewer than the {n_calib} "
            "calibration needs; calibrate on fewer tokens or on a longer text."
        )
    return keep[:n_calib], held_out
