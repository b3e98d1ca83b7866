"""The config dataclasses, checked field by field in their ``__post_init__``.

Unchecked, a ``PredictorConfig`` with rank 0 builds a predictor that "trains" (its output is its
bias) and an ``epochs=0`` run returns an untrained predictor; a ``CollectConfig`` with a window
of 8.5 fails deep inside ``torch.view``; a ``CalibrationConfig`` with NaN or 1e9 bins ran. Each field
is refused here instead, naming the field.
"""

from __future__ import annotations

import math
import numbers

from ..errors import CalibrationError, CollectionError, PredictorError
from ..vocab import CORPORA
from .scalars import fraction, integer, positive

__all__ = ["MAX_BINS", "calibration_config", "collect_config", "predictor_config"]

# histogram bins per (layer, site): 2**16 float64 counts over 9 sites and 30 layers are 141 MB;
# the default 4096 already resolve a quantile to 0.7% in value
MAX_BINS = 65536


def predictor_config(cfg) -> None:
    """Check a :class:`~dejavu_lab.predictors.model.PredictorConfig` (raises ``PredictorError``).

    >>> from dejavu_lab.predictors import PredictorConfig
    >>> PredictorConfig(mlp_rank=0)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: mlp_rank must be at least 1 (a whole number), got 0; ...
    """
    e = PredictorError
    rank = "the predictor's inner width r; DejaVu used 1000 at d = 12288"
    integer(cfg.mlp_rank, "mlp_rank", minimum=1, error=e, hint=rank)
    integer(cfg.head_rank, "head_rank", minimum=1, error=e, hint=rank)
    integer(cfg.epochs, "epochs", minimum=1, error=e, hint="train for at least one epoch")
    integer(cfg.patience, "patience", minimum=1, error=e, hint="epochs without progress")
    integer(cfg.batch_size, "batch_size", minimum=1, error=e, hint="tokens per step; 512 is usual")
    integer(cfg.seed, "seed", error=e)
    positive(cfg.lr, "lr", example=3e-3, error=e, hint="Adam's learning rate")
    positive(cfg.max_pos_weight, "max_pos_weight", example=50, error=e)
    fraction(cfg.val_fraction, "val_fraction", example=0.1, error=e, hint="the share held out")
    for what in ("mlp_sparsity", "head_sparsity"):
        _budget(cfg, what, e)


def _budget(cfg, what: str, error) -> None:
    """A sparsity (the fraction removed) in [0, 1), as ``budgets`` takes it, for one value."""
    fraction(getattr(cfg, what), what, closed="left", error=error, hint="the fraction removed")


def collect_config(cfg) -> None:
    """Check a :class:`dejavu_lab.collect.CollectConfig` (raises ``CollectionError``).

    >>> from dejavu_lab.collect import CollectConfig
    >>> CollectConfig(window=8.5)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CollectionError: window must be at least 2 (a whole number), got 8.5; ...
    """
    e = CollectionError
    if not isinstance(cfg.corpus, str) or cfg.corpus not in CORPORA:
        raise e(f"Unknown corpus {cfg.corpus!r}; choose one of {', '.join(CORPORA)}.")
    window = integer(cfg.window, "window", minimum=2, error=e, hint="tokens per window")
    integer(
        cfg.max_tokens,
        "max_tokens",
        minimum=window,
        error=e,
        hint="need max_tokens >= window: at least one whole window",
    )
    integer(cfg.chunk_windows, "chunk_windows", minimum=1, error=e, hint="windows per chunk file")
    integer(cfg.skip_windows, "skip_windows", minimum=0, error=e, hint="0 starts at the beginning")
    _budget(cfg, "mlp_label_sparsity", e)


def calibration_config(cfg) -> None:
    """Check a :class:`dejavu_lab.sparsify.calibration.CalibrationConfig` (raises
    ``CalibrationError``); whole floats become ``int`` (4096.0 is the same cache key as 4096).

    >>> from dejavu_lab.sparsify import CalibrationConfig
    >>> CalibrationConfig(bins=float("nan"))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: bins must be a whole number in [16, 65536], got nan; ...
    """
    e = CalibrationError
    hint = f"the default 4096 resolve a quantile to 0.7%; {MAX_BINS} take 141 MB at 30 layers"
    object.__setattr__(cfg, "bins", integer(cfg.bins, "bins", minimum=16, maximum=MAX_BINS,
                                            error=e, hint=hint))  # fmt: skip
    gt = integer(cfg.greedy_tokens, "greedy_tokens", minimum=2, error=e, hint="block tokens")
    object.__setattr__(cfg, "greedy_tokens", gt)
    for name in ("log10_min", "log10_max"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise e(f"{name} must be a finite number (a power of ten), got {v!r}; pass e.g. "
                    f"{name}={getattr(type(cfg), name)}.")  # fmt: skip
    if not cfg.log10_min < cfg.log10_max:
        raise e("log10_min must be below log10_max; pass e.g. log10_min=-8, log10_max=4.")
    fraction(cfg.greedy_step, "greedy_step", closed="right", example=0.04, error=e)
    if cfg.greedy_step > 0.5:
        raise e(f"greedy_step must be at most 0.5, got {cfg.greedy_step}; pass e.g. 0.04.")
    fraction(cfg.greedy_max_site_step, "greedy_max_site_step", closed="right", error=e)
    _budget(cfg, "greedy_max", e)
    fraction(cfg.greedy_last, "greedy_last", closed="right", example=0.5, error=e)
