"""Predictors cached end to end: :func:`get_or_train` loads them, or collects (resumably) and
trains them once.

The cache file (:func:`default_path`, under :func:`dejavu_lab.assets.cache_dir`) is named by
the model fingerprint and the keys of both configs; one process trains, another one asking for
the same waits for its file.
"""

from __future__ import annotations

import time
from pathlib import Path

from .. import atomic
from ..arch import Arch, get_arch
from ..collect import fingerprint, fingerprint_id, note_stale
from .model import PredictorConfig, Predictors, load_predictors
from .train import train_predictors

__all__ = ["default_path", "get_or_train"]


def default_path(fp: dict, collect_config, config: PredictorConfig) -> Path:
    """The cache file :func:`get_or_train` uses for these configs (nothing is created).

    ``collect_config`` is the :class:`~dejavu_lab.collect.CollectConfig` collected with, or the
    :class:`~dejavu_lab.collect.Collection` itself: the name holds its key, so predictors
    trained on one collection are never found under another's name.

    >>> from dejavu_lab.collect import CollectConfig, fingerprint
    >>> from dejavu_lab.models import random_model
    >>> fp = fingerprint(random_model("tiny-llama").model)
    >>> default_path(fp, CollectConfig(), PredictorConfig(mode="same")).name
    'llama-L2-d64-...-same.safetensors'
    """
    from ..assets import cache_dir

    name = f"{fingerprint_id(fp)}-{collect_config.key()}-{config.key()}-{config.mode}.safetensors"
    return cache_dir() / "predictors" / name


def get_or_train(
    model,
    tokenizer,
    config: PredictorConfig = PredictorConfig(),
    collect_config=None,
    *,
    arch: Arch | None = None,
    progress: bool = True,
) -> Predictors:
    """Cached predictors for ``model``: load them, or collect (resumably) and train them once.

    The cache key is the model fingerprint plus both configs, under
    :func:`dejavu_lab.assets.cache_dir`; ``info["seconds"]`` on the result says what this
    call spent (0 when it loaded).

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from dejavu_lab.collect import CollectConfig
    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> cfgs = PredictorConfig(epochs=1, mlp_rank=8), CollectConfig(window=8, max_tokens=8)
    >>> with mock.patch.dict(os.environ, DEJAVU_LAB_CACHE=tempfile.mkdtemp()):  # not ~/.cache
    ...     runs = [get_or_train(model, tok, *cfgs, progress=False) for _ in range(2)]
    >>> [p.info["trained_now"] for p in runs]  # trained once, then loaded
    [True, False]
    """
    from ..collect import CollectConfig

    collect_config = collect_config or CollectConfig()
    arch = arch or get_arch(model)
    fp = fingerprint(model, arch)
    path = default_path(fp, collect_config, config)
    t0 = time.perf_counter()
    if (pred := _cached(path, collect_config, model, arch)) is not None:
        return pred
    note_stale(path, fp, "predictors")
    lock = path.with_name(f".{path.name}.lock")
    with atomic.locked(lock, what="training these predictors", hint=_HINT):
        if (pred := _cached(path, collect_config, model, arch)) is not None:
            return pred  # another process trained them while we waited
        return _collect_and_train(
            model, tokenizer, config, collect_config, arch, path, t0, progress
        )


_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space"


def _cached(path: Path, collect_config, model, arch) -> Predictors | None:
    """The cache entry at ``path`` if it holds predictors trained on ``collect_config``."""
    if not path.exists():
        return None
    pred = load_predictors(path, model, arch)
    if pred.collection.get("key") != collect_config.key():
        return None  # written under a wrong key (older versions): train again and replace it
    pred.info = {"path": str(path), "trained_now": False, "collect_s": 0.0, "train_s": 0.0}
    return pred


def _collect_and_train(model, tokenizer, config, collect_config, arch, path, t0, progress):
    from ..collect import collect

    col = collect(model, tokenizer, collect_config, arch=arch, progress=progress)
    t1 = time.perf_counter()
    pred = train_predictors(col, config, progress=progress)
    t2 = time.perf_counter()
    pred.save(path)
    pred.info = {
        "path": str(path),
        "trained_now": True,
        "collect_s": round(t1 - t0, 1),
        "train_s": round(t2 - t1, 1),
    }
    return pred
