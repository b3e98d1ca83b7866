"""Does decoding in a batch cost quality? Each sequence's perplexity in a batch vs alone.

At the same per-sequence budgets a sequence decoded in a batch keeps exactly its own heads (the
attention kernel reads each sequence's own), and a superset of its own MLP neurons (the batch's
union) — unless ``union_budget`` caps the union below what the batch asks for, when the
neurons with the most votes are kept and a sequence may lose some of its own. So uncapped, its
perplexity should equal its batch-1 perplexity or be better; capped, it can be worse.

:func:`quality_rows` measures that teacher-forced on held-out windows: each window's first
``prompt`` tokens are prefilled (dense, in both runs), then every following token is fed one
decode step at a time — each window alone (a :class:`~dejavu_lab.engine.BatchDecoder` of one
sequence: the batch-1 :class:`~dejavu_lab.engine.Decoder`'s sets, as ``tests/test_engine_batch.py``
checks) and all windows in one batch — and the negative log-likelihood of each next token is
summed per window. DejaVu's lookahead predictors choose each sequence's sets inside the step,
as in serving. Every run starts from one dense prefill (:meth:`BatchDecoder.copy_prefill`).

The measurements return plain rows (one dict each), so the engine needs no pandas; the chapter's
tables are :func:`dejavu_lab.report.batch.batch_quality` and
:func:`~dejavu_lab.report.batch.batch_unions`.
"""

from __future__ import annotations

import copy
import math

import torch

from .batch import BatchDecoder
from .config import EngineError, SparseConfig
from .weights import decoder_weights

__all__ = ["quality_rows", "union_means", "union_rows"]


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row negative log-likelihood (fp32) of targets [B] under logits [B, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(1, targets[:, None].to(logp.device))[:, 0]


def _mean(values) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


def union_means(rows: list[dict]) -> dict[str, float]:
    """Mean realised union and fraction read per block over layers and steps, from
    :meth:`BatchDecoder.union_sizes`'s rows: ``mlp_union``, ``mlp_read``, ``heads_union``,
    ``heads_read`` (fractions of the layer's neurons or heads).

    >>> rows = [{"block": "mlp", "union": 96, "read": 128, "total": 256},
    ...         {"block": "mlp", "union": 64, "read": 128, "total": 256},
    ...         {"block": "heads", "union": 3, "read": 4, "total": 4}]
    >>> union_means(rows)
    {'mlp_union': 0.3125, 'mlp_read': 0.5, 'heads_union': 0.75, 'heads_read': 1.0}
    """
    out = {}
    for block in ("mlp", "heads"):
        mine = [r for r in rows if r["block"] == block]
        out[f"{block}_union"] = _mean(r["union"] / r["total"] for r in mine)
        out[f"{block}_read"] = _mean(r["read"] / r["total"] for r in mine)
    return out


def quality_rows(
    model,
    predictors,
    windows: torch.Tensor,
    *,
    prompt: int | None = None,
    mlp_sparsity: float = 0.5,
    head_sparsity: float = 0.3,
    union_budgets=(None,),
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Teacher-forced perplexity of each window decoded alone and in one batch of all windows.

    ``model``: a Hugging Face model (copied to ``dtype``: the sparse kernels take fp16/bf16; the
    shared prefill and the ``"dense"`` run use the model's own dtype);
    ``predictors``: lookahead :class:`~dejavu_lab.predictors.model.Predictors` of that model;
    ``windows``: [B, W] held-out token ids, B <= 32 (one sequence each); ``prompt``: tokens
    prefilled (default W // 2); ``union_budgets``: one batched run per budget (None: the whole
    union; a fraction of the MLP: the cap). One row (dict) per (window, run): ``run`` ("dense",
    "batch 1", "batch B" or "batch B, union <= x%"), ``tokens`` scored, ``nll``,
    ``perplexity``, and for batched runs the mean realised union (``mlp_union``,
    ``heads_union``) and the MLP fraction read (``mlp_read``), over layers and steps.

    >>> import os
    >>> from unittest import mock
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> lm = random_model("tiny-llama", seed=0)
    >>> pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    >>> windows = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    >>> with mock.patch.dict(os.environ, TRITON_INTERPRET="0"):  # the kernels' references
    ...     rows = quality_rows(lm.model, pred, windows, union_budgets=(None, 0.5))
    >>> sorted({r["run"] for r in rows})
    ['batch 1', 'batch 3', 'batch 3, union <= 50%', 'dense']
    >>> [r["tokens"] for r in rows if r["run"] == "batch 1"]  # 3 windows x 5 decode steps each
    [5, 5, 5]
    """
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise EngineError("windows must be a [B, W] tensor of token ids (one window per row).")
    B, W = windows.shape
    prompt = W // 2 if prompt is None else int(prompt)
    if not 1 <= prompt <= W - 2:
        raise EngineError(f"prompt={prompt} must leave at least 2 of the window's {W} tokens.")
    w = decoder_weights(copy.deepcopy(model).to(dtype))  # the caller's model stays as it is
    w_ref = decoder_weights(model)  # its own dtype (fp32): the prefill and the dense reference
    windows = windows.to(w.device)
    sp = SparseConfig(mlp_sparsity, head_sparsity)
    fed, targets = windows[:, prompt : W - 1], windows[:, prompt + 1 :]  # [B, n] each
    n = fed.shape[1]
    rows = []

    def record(run, nll, batch=B, **extra):
        for b in range(B):
            s = float(nll[b])
            rows.append({"window": b, "run": run, "batch": batch, "tokens": n, "nll": s,
                         "perplexity": math.exp(s / n), **extra})  # fmt: skip

    dense = BatchDecoder(w_ref, max_seq_len=W, max_batch=B)
    dense.prefill(list(windows[:, :prompt]))  # the one prefill every run starts from

    def decode(dec, slots):
        dec.copy_prefill(dense, slots)
        nll = torch.zeros(len(slots))
        for t in range(n):
            nll += _nll(dec.step(fed[slots, t]), targets[slots, t]).cpu()
        return nll

    record("dense", decode(BatchDecoder(w_ref, max_seq_len=W, max_batch=B), list(range(B))))
    one = BatchDecoder(w, max_seq_len=W, max_batch=1, sparse=sp, predictors=predictors)
    record("batch 1", torch.cat([decode(one, [b]) for b in range(B)]), batch=1)
    for budget in union_budgets:
        dec = BatchDecoder(
            w, max_seq_len=W, max_batch=B, sparse=sp, union_budget=budget, predictors=predictors
        )
        nll = decode(dec, list(range(B)))
        run = f"batch {B}" if budget is None else f"batch {B}, union <= {budget:.0%}"
        means = union_means(dec.union_sizes())
        means.pop("heads_read")  # the quality table reports the MLP's read fraction only
        record(run, nll, union_budget=budget, **means)
    return rows


def union_rows(
    model,
    predictors,
    windows: torch.Tensor,
    batch_sizes=(1, 2, 4, 8),
    *,
    prompt: int | None = None,
    steps: int = 8,
    mlp_sparsity: float = 0.5,
    head_sparsity: float = 0.3,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """The union the engine realises with DejaVu's predictors, per batch size: the first B
    windows decoded together (teacher-forced, ``steps`` steps from one prefill), no cap.

    One row (dict) per (batch_size, block, layer), blocks and layers in sorted order: ``union``
    (mean fraction of the layer's neurons or heads the live sequences asked for) — the measured
    counterpart of :func:`dejavu_lab.measure.union_sparsity`'s prediction from oracle sets.

    >>> import os
    >>> from unittest import mock
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> lm = random_model("tiny-llama", seed=0)
    >>> pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    >>> windows = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(0))
    >>> with mock.patch.dict(os.environ, TRITON_INTERPRET="0"):  # the kernels' references
    ...     u = union_rows(lm.model, pred, windows, (1, 4), steps=2)
    >>> [round(r["union"], 2) for r in u if r["batch_size"] == 1]  # heads: 3 of 4; MLP: a half
    [0.75, 0.75, 0.5, 0.5]
    """
    B = max(batch_sizes)
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[0] < B:
        raise EngineError(f"windows must be a [n, W] tensor of token ids with n >= {B}.")
    W = windows.shape[1]
    prompt = W // 2 if prompt is None else int(prompt)
    steps = min(int(steps), W - prompt - 1)
    if prompt < 1 or steps < 1:
        raise EngineError(f"prompt={prompt} must leave decode steps in the window of {W}.")
    w = decoder_weights(copy.deepcopy(model).to(dtype))
    windows = windows[:B].to(w.device)
    first = BatchDecoder(decoder_weights(model), max_seq_len=W, max_batch=B)
    first.prefill(list(windows[:, :prompt]))
    dec = BatchDecoder(w, max_seq_len=W, max_batch=B, predictors=predictors,
                       sparse=SparseConfig(mlp_sparsity, head_sparsity))  # fmt: skip
    out = []
    for b in batch_sizes:
        dec.copy_prefill(first, list(range(b)))
        for t in range(steps):
            dec.step(windows[:b, prompt + t])
        per: dict[tuple[str, int], list[float]] = {}
        for r in dec.union_sizes():
            per.setdefault((r["block"], r["layer"]), []).append(r["union"] / r["total"])
        out += [{"batch_size": b, "block": block, "layer": layer, "union": _mean(v)}
                for (block, layer), v in sorted(per.items())]  # fmt: skip
    return out
