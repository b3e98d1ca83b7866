"""The paper's reported numbers, and zero-shot accuracy through lm-evaluation-harness.

:data:`PAPER_KNOWL9` is Deja Vu's ablation table (Knowl 9) for the chapters to print beside our
numbers; :func:`lm_eval_tasks` runs the paper's zero-shot tasks (Knowl 8, 9) with any method of
:func:`~dejavu_lab.sparsify.core.sparsified` applied.
"""

from __future__ import annotations

import torch

from .core import sparsified

__all__ = ["PAPER_KNOWL9", "PAPER_TASKS", "lm_eval_tasks"]


# The paper's ablation (Knowl 9, Table: OPT-175B, separate MLP / attention sparsity), for the
# chapters to print beside our numbers. Perplexity on WikiText and C4; accuracies zero-shot.
PAPER_KNOWL9 = [
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


# The paper's zero-shot tasks (Knowl 8, 9) under their lm-evaluation-harness names.
PAPER_TASKS = ("cb", "copa", "lambada_openai", "openbookqa", "piqa", "rte", "winogrande")


def lm_eval_tasks(
    model, tokenizer, tasks=PAPER_TASKS, *, limit: int | None = None, **sparsified_kwargs
) -> dict:
    """Zero-shot accuracy through lm-evaluation-harness with :func:`sparsified` applied.

    Needs the ``lm-eval`` package and a network (the harness downloads each task's dataset);
    without either it raises :class:`RuntimeError` saying which. Returns lm-eval's
    ``results`` dict, task -> metrics.

    >>> import sys
    >>> from unittest import mock
    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-opt")
    >>> with mock.patch.dict(sys.modules, {"lm_eval": None}):  # as if lm-eval were not installed
    ...     lm_eval_tasks(model, None, ["piqa"], limit=10, mlp_sparsity=0.5)
    Traceback (most recent call last):
    ...
    RuntimeError: lm_eval_tasks needs lm-evaluation-harness: pip install lm-eval ...
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise RuntimeError(
            "lm_eval_tasks needs lm-evaluation-harness: pip install lm-eval (it then downloads "
            "the task datasets, so it also needs a network); use sparse_perplexity offline."
        ) from None
    import os

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise RuntimeError(
            "lm_eval_tasks needs a network to fetch the task datasets, but HF_HUB_OFFLINE or "
            "HF_DATASETS_OFFLINE is set; unset it or use sparse_perplexity."
        )
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    with torch.no_grad(), sparsified(model, **sparsified_kwargs):
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit)
        except (ConnectionError, OSError) as e:
            raise RuntimeError(
                f"lm-eval could not fetch its task data ({type(e).__name__}); it needs a "
                "network: run it online or use sparse_perplexity."
            ) from None
    return out["results"]
