"""Validation at the boundary: every bad input is one sentence saying what is wrong and what to do.

Data enters the public API in a few kinds, and each kind is checked in one small module, once,
where it enters (the public function calls the check on its first lines):

- :mod:`~dejavu_lab.checks.scalars` — sizes, counts and fractions (a float window, a batch size
  of 0, ``val_fraction`` outside (0, 1));
- :mod:`~dejavu_lab.checks.configs` — the config dataclasses (``CollectConfig``,
  ``PredictorConfig``), checked in their ``__post_init__``;
- :mod:`~dejavu_lab.checks.tokens` — token ids and windows (dtype, shape, ids outside the
  vocabulary, windows longer than the model's positions, lists instead of tensors);
- :mod:`~dejavu_lab.checks.hooks` — what hook callbacks return, and hook names matching nothing;
- :mod:`~dejavu_lab.checks.models` — model specs, devices and model folders, before any weight
  loads;
- :mod:`~dejavu_lab.checks.files` — predictor files and collection manifests read from disk;
- :mod:`~dejavu_lab.checks.engine` — the decoder's sizes and prompts.

A check raises the error type of the module whose input it checks (``CorpusError`` for token
windows, ``PredictorError`` for predictor files and configs, ``EngineError`` for the engine, …),
so callers catch what they already caught; inputs with no such home raise :class:`InputError`.
Every one of them is a ``ValueError`` (or, for model specs and disks, an ``OSError``), which the
CLI prints as one ``dejavu-lab: error: …`` line with exit status 2.

>>> from dejavu_lab.checks import scalars
>>> scalars.integer(8.5, "window", minimum=2)
Traceback (most recent call last):
...
dejavu_lab.errors.InputError: window must be at least 2 (a whole number), got 8.5; pass e.g. window=8.
"""

from __future__ import annotations

from ..errors import InputError

__all__ = ["InputError"]
