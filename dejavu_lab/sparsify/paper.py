"""The paper's reported numbers: its ablation table and its zero-shot tasks (§5.1–5.2).

:data:`PAPER_ABLATION` is Deja Vu's ablation table for the chapters to print beside our numbers;
:data:`PAPER_TASKS` names its zero-shot tasks in lm-evaluation-harness, which
:func:`dejavu_lab.lm_eval_tasks.lm_eval_tasks` runs with any sparsity method applied.
"""

from __future__ import annotations

__all__ = ["PAPER_ABLATION", "PAPER_TASKS"]


# The paper's ablation (§5.2: OPT-175B, MLP and attention sparsified separately), for the
# chapters to print beside our numbers. Perplexity on WikiText and C4; accuracies zero-shot.
PAPER_ABLATION = [
    {
        "model": "OPT-175B dense",
        "mlp_sparsity": 0.0,
        "head_sparsity": 0.0,
        "wikitext_ppl": 10.8221,
        "c4_ppl": 7.7224,
        "lambada": 0.7584,
        "piqa": 0.8096,
    },
    {
        "model": "DejaVu MLP 85%",
        "mlp_sparsity": 0.85,
        "head_sparsity": 0.0,
        "wikitext_ppl": 10.7988,
        "c4_ppl": 7.7393,
        "lambada": 0.7619,
        "piqa": 0.8096,
    },
    {
        "model": "DejaVu attention 50%",
        "mlp_sparsity": 0.0,
        "head_sparsity": 0.5,
        "wikitext_ppl": 10.8696,
        "c4_ppl": 7.7393,
        "lambada": 0.7586,
        "piqa": 0.8063,
    },
]


# The paper's zero-shot tasks (§5.1–5.2) under their lm-evaluation-harness names.
PAPER_TASKS = ("cb", "copa", "lambada_openai", "openbookqa", "piqa", "rte", "winogrande")
