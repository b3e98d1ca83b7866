"""Every error type of dejavu_lab, in one module that imports nothing of ours.

Each error is raised by one part of the package and is importable from that part too
(``from dejavu_lab.corpus import CorpusError`` still works): this module is where they live, so
that the checks in :mod:`dejavu_lab.checks` can raise them without importing what they check.
Every one is a ``ValueError`` (bad input), an ``OSError`` (files, disks, model paths) or a
``RuntimeError`` (a missing asset or result); the CLI prints any of them as one
``dejavu-lab: error: ...`` line with exit status 2.
"""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = [
    "ArchMismatchError",
    "AssetError",
    "BusyError",
    "CalibrationError",
    "CollectionError",
    "CorpusError",
    "EngineError",
    "HookError",
    "InputError",
    "LmEvalError",
    "ModelNotFoundError",
    "PredictorError",
    "QuantError",
    "ResultsError",
    "UnsupportedArchitectureError",
    "WriteError",
]

_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
DEFAULT_HINT = "write somewhere else (set DEJAVU_LAB_CACHE, or pass another output path)"


class InputError(ValueError):
    """A bad input that belongs to no module with its own error type (a device, a hook).

    >>> from dejavu_lab.checks.models import device
    >>> device("gpu")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: device 'gpu' is not a torch device; use 'cpu', 'cuda', ...
    """


class HookError(InputError):
    """A hook callback is not callable, or returned something the model cannot use.

    >>> import torch
    >>> from dejavu_lab.checks.hooks import returned
    >>> returned([1, 2], torch.zeros(2), "blocks.0.mlp.hook_post", True)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.HookError: A hook at blocks.0.mlp.hook_post returned a list; return ...
    """


class UnsupportedArchitectureError(ValueError):
    """The model's ``config.model_type`` has no adapter.

    >>> from transformers import GPT2Config
    >>> from dejavu_lab.arch import get_arch
    >>> get_arch(GPT2Config())
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.UnsupportedArchitectureError: Architecture 'gpt2' is not supported; ...
    """


class ArchMismatchError(UnsupportedArchitectureError):
    """An adapter table does not describe the layers it was put on.

    >>> from dataclasses import replace
    >>> from dejavu_lab.arch import ARCH_TABLES
    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-gemma3")
    >>> replace(arch, table=ARCH_TABLES["llama"]).check(model)  # Llama's table on Gemma-3
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.ArchMismatchError: The 'llama' adapter table does not fit layer 0 ...
    """


class AssetError(RuntimeError):
    """A pinned asset could not be fetched, verified or cached.

    >>> from dejavu_lab.assets import fetch
    >>> fetch("wikitext.txt")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.AssetError: Unknown asset 'wikitext.txt'; known assets are: ...
    """


class WriteError(OSError):
    """A file could not be written: the folder, the reason and what to do, in one sentence.

    >>> import errno
    >>> print(WriteError.explain(OSError(errno.ENOSPC, "No space left"), Path("/data/col")))
    No space left on the device holding /data/col; free space there or write somewhere else ...
    """

    @staticmethod
    def explain(e: OSError, folder: Path, hint: str = DEFAULT_HINT, need: int = 0) -> str:
        if e.errno == errno.ENOSPC or e.errno == getattr(errno, "EDQUOT", -1):
            need_s = f" (about {need / 2**20:.0f} MB more are needed)" if need > 2**20 else ""
            return (
                f"No space left on the device holding {folder}{need_s}; free space there or {hint}."
            )
        if e.errno in _READ_ONLY:
            why = "read-only" if e.errno == errno.EROFS else "not writable by this user"
            return f"Cannot write into {folder}: it is {why}; make it writable or {hint}."
        return f"Could not write into {folder} ({e.strerror or e}); {hint}."


class BusyError(OSError):
    """Another process holds the lock and ``timeout`` ran out.

    >>> import tempfile
    >>> from dejavu_lab.atomic import locked
    >>> folder = tempfile.mkdtemp()
    >>> with locked(folder, what="collecting into it"):  # a second holder gives up at once
    ...     with locked(folder, what="collecting into it", timeout=0):
    ...         pass
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.BusyError: Another process is collecting into it (.../...); wait for ...
    """


class CollectionError(ValueError):
    """A collection directory is missing, incomplete or from another model/config.

    Also raised for a config that cannot be collected:

    >>> from dejavu_lab.collect import CollectConfig
    >>> CollectConfig(window=512, max_tokens=100)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CollectionError: max_tokens must be at least 512 (a whole number), got 100; pass e.g. max_tokens=512 ...
    """


class CorpusError(ValueError):
    """A corpus could not be loaded or is too short for what was asked.

    >>> from dejavu_lab.corpus import load_text
    >>> load_text("wiki")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: Unknown corpus 'wiki'; choose one of demo, wikitext-2, c4.
    """


class EngineError(ValueError):
    """The engine cannot run this model or this request; the message says what to do.

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> Decoder(random_model("tiny-opt").model, max_seq_len=4096)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: max_seq_len=4096 exceeds the model's 2048 positions.
    """


class LmEvalError(ValueError):
    """lm-eval is missing, a task is unknown, or a task's data cannot be fetched.

    >>> import pytest; _ = pytest.importorskip("lm_eval")  # pip install 'dejavu-lab[eval]'
    >>> from dejavu_lab.lm_eval_tasks import lm_eval_tasks
    >>> lm_eval_tasks(None, None, [])
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.LmEvalError: No task given; pass lm-eval task names, e.g. 'dejavu_demo_lambada'.
    """


class ModelNotFoundError(OSError):
    """The model spec names nothing we can load.

    >>> from dejavu_lab.models import load_model
    >>> load_model("")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.ModelNotFoundError: Model spec must be a non-empty string or path, got ''; ...
    """


class PredictorError(ValueError):
    """A predictor file is damaged, or belongs to another model; or a bad predictor config.

    >>> from dejavu_lab.predictors import PredictorConfig
    >>> PredictorConfig(mode="magic")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: mode must be 'same' or 'lookahead', got 'magic'; ...
    """


class ResultsError(RuntimeError):
    """A results file is missing, unreadable or lacks its provenance.

    >>> from dejavu_lab.results import load
    >>> load("no_such_benchmark")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.ResultsError: no results file at .../no_such_benchmark.json; run the ...
    """


class CalibrationError(ValueError):
    """A calibration or thresholds file is damaged, belongs to another model, or lacks a part.

    >>> from dejavu_lab.sparsify import load_thresholds
    >>> load_thresholds("no-such-file.safetensors")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CalibrationError: No thresholds file at no-such-file.safetensors.
    """


class QuantError(ValueError):
    """A weight cannot be stored in, or read from, the 4-bit format as asked.

    >>> import torch
    >>> from dejavu_lab.quant import quantize
    >>> quantize(torch.zeros(100, 8), group=32)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.QuantError: 100 input rows do not split into groups of 32; pick a group ...
    """
