"""The paper's observations (Deja Vu §3, Appendix C.1) as functions returning tidy tables.

One module per observation; each measurement streams activations through hook callbacks that
reduce them on the spot, so a long text never holds every layer at once.

- :mod:`.sparsity`   — §3.1: per-token MLP-neuron and head sparsity per layer.
- :mod:`.quality`    — §3.1, Fig. 3: perplexity under oracle contextual vs static sparsity.
- :mod:`.embeddings` — §3.3, Fig. 5: cross-layer cosine, residual vs sub-block norms.
- :mod:`.heads`      — §3.2: head entropy / norm / kind, the mean-shift view.
- :mod:`.union`      — Appendix C.1: union sparsity across batch sizes.
- :mod:`.quant_quality` — perplexity on 4-bit weights, dense and under sparsity, beside fp
  (imported on its own: ``dejavu_lab.measure.quant_quality``).
- :mod:`.observations` — the numbers above, for any model, recorded with provenance
  (imported on its own: ``dejavu_lab.measure.observations``).
"""

from .embeddings import layer_cosine, residual_norms
from .heads import (
    classify_heads,
    head_stats,
    mean_shift_step,
    random_head_perplexity,
    token_trajectories,
)
from .quality import SWEEP_MODES, perplexity_sweep, sparsity_at_rise
from .sparsity import (
    activation_sparsity,
    active_mask,
    contextual_sparsity,
    criterion_label,
    default_criterion,
    needed_count,
)
from .union import (
    ActiveSets,
    TokenScores,
    activation_frequency,
    active_sets,
    fit_union_growth,
    token_scores,
    union_of,
    union_sparsity,
)

__all__ = [
    "SWEEP_MODES",
    "perplexity_sweep",
    "sparsity_at_rise",
    "ActiveSets",
    "TokenScores",
    "activation_frequency",
    "activation_sparsity",
    "active_mask",
    "active_sets",
    "classify_heads",
    "contextual_sparsity",
    "criterion_label",
    "default_criterion",
    "fit_union_growth",
    "head_stats",
    "layer_cosine",
    "mean_shift_step",
    "needed_count",
    "random_head_perplexity",
    "residual_norms",
    "token_scores",
    "token_trajectories",
    "union_of",
    "union_sparsity",
]
