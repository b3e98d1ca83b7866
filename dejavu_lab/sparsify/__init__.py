"""Run a Hugging Face model with contextual sparsity applied (Deja Vu §2.3, §4, §5.2).

One context manager, :func:`sparsified`, applies any registered method; each method is one
module that registers a builder of hook callbacks (:func:`~dejavu_lab.sparsify.core.register`),
so adding a method is adding one file and its row in :data:`dejavu_lab.vocab.METHODS`:

- :mod:`~dejavu_lab.sparsify.oracle` — the ideal per-token sets (§3.1's upper bound);
- :mod:`~dejavu_lab.sparsify.static` — one set per layer for every token (the paper's baseline);
- :mod:`~dejavu_lab.sparsify.dejavu` — the sets DejaVu's predictors choose (§4.1–4.3);
- :mod:`~dejavu_lab.sparsify.teal` — TEAL's magnitude thresholds on every linear input;
- :mod:`~dejavu_lab.sparsify.wina` — WINA's weight-informed scores with TEAL's rule;
- :mod:`~dejavu_lab.sparsify.cats` — CATS's threshold on the gate activation;
- :mod:`~dejavu_lab.sparsify.larosa` — LaRoSA's fixed top-k in a rotated (PCA) basis;
- :mod:`~dejavu_lab.sparsify.rsparse` — R-Sparse's large entries plus a low-rank term.

The threshold methods take their thresholds from a calibration
(:mod:`~dejavu_lab.sparsify.calibration`, the :class:`Calibration` itself in
:mod:`~dejavu_lab.sparsify.calibration_data`; TEAL's greedy allocation:
:mod:`~dejavu_lab.sparsify.greedy`).

Sparsity is always the fraction REMOVED (the paper's "85% MLP sparsity" keeps 15% of neurons),
a float or a per-layer list in [0, 1) (:mod:`dejavu_lab.budgets`). Masks are applied through
the writable hook points of :mod:`dejavu_lab.hooks`, so the model's own forward runs unchanged.
This measures *quality*: the dense work still happens on CPU; what a sparse step would read is
counted by :mod:`dejavu_lab.step_bytes` (perplexity and bytes together:
:mod:`~dejavu_lab.sparsify.evaluate`) (:mod:`~dejavu_lab.sparsify.frontier` puts
every method on that axis), the speed side lives in
:mod:`dejavu_lab.bytes_model`, the kernels and the engine; :mod:`~dejavu_lab.sparsify.kept`
collects the kept fractions.

Deferred KV (§4.2) for token-by-token generation is in :mod:`dejavu_lab.deferred_kv`.
"""

from ..budgets import budgets, head_gram, head_output_norms, n_keep, topk_mask
from ..step_bytes import bytes_per_token_fraction
from . import (  # noqa: F401  (each registers its method)
    cats,
    dejavu,
    larosa,
    oracle,
    rsparse,
    static,
    teal,
    wina,
)
from .calibration import (
    Calibration,
    CalibrationConfig,
    CalibrationError,
    Thresholds,
    calibrate,
    load_calibration,
    load_thresholds,
)
from .core import METHODS, MODES, SITES, register, sparsified
from .evaluate import SparseResult, sparse_eval, sparse_perplexity
from .kept import Kept
from .moments import Moments, calibrate_moments, load_moments
from .paper import PAPER_ABLATION, PAPER_TASKS
from .static import StaticSets, static_sets
from .topk import TopkPlan

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "Thresholds",
    "calibrate",
    "load_calibration",
    "load_thresholds",
    "METHODS",
    "MODES",
    "PAPER_ABLATION",
    "PAPER_TASKS",
    "SITES",
    "Kept",
    "Moments",
    "TopkPlan",
    "calibrate_moments",
    "load_moments",
    "SparseResult",
    "StaticSets",
    "budgets",
    "bytes_per_token_fraction",
    "head_gram",
    "head_output_norms",
    "n_keep",
    "register",
    "sparse_eval",
    "sparse_perplexity",
    "sparsified",
    "static_sets",
    "topk_mask",
]
