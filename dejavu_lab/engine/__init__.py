"""A static-KV-cache decoder built from Hugging Face weights, dense or contextually sparse (§5.1).

One module per idea; the imports run one way (``config -> weights -> site_thresholds, sets,
attention, kept_heads, mlp, plans, refit, lowrank, fused_step, decode_loop -> decoder -> thresholds``;
``sets -> batch_sets``, ``attention -> batch_blocks``, ``decoder -> batch``; ``weights ->
tp_weights``, ``decoder, tp_weights -> tp``). The bytes a step reads come from
:mod:`dejavu_lab.step_bytes`; its tables and figures live in :mod:`dejavu_lab.report` (the
engine imports no pandas or plotly, so it runs on a bare GPU image):

- :mod:`~dejavu_lab.engine.config`  — :class:`SparseConfig` (what a step keeps), :func:`dense_ops`
  and :class:`EngineError`;
- :mod:`~dejavu_lab.engine.weights` — :func:`decoder_weights`: the weights laid out once for the
  kernels (fused QKV, ``W_O`` and ``W2`` transposed);
- :mod:`~dejavu_lab.engine.site_thresholds` — each layer's TEAL/WINA/CATS thresholds as the
  kernels take them (a float stays a float);
- :mod:`~dejavu_lab.engine.attention`, :mod:`~dejavu_lab.engine.kept_heads`,
  :mod:`~dejavu_lab.engine.mlp` — one layer's blocks, chosen once per decoder: every head
  (dense or thresholded), DejaVu's kept heads with deferred KV; the dense, kept-neuron,
  thresholded and CATS MLPs;
- :mod:`~dejavu_lab.engine.plans`, :mod:`~dejavu_lab.engine.lowrank` — LaRoSA's and
  R-Sparse's plans as the step runs them: LaRoSA's rotation folded into W_V and W_O, R-Sparse's
  low-rank term beside TEAL's thresholded product; :mod:`~dejavu_lab.engine.refit` — a TEAL/WINA
  refit's ``W R`` folded into the weights;
- :mod:`~dejavu_lab.engine.sets`    — :class:`KeptSets`: the kept neurons/heads per layer, set by
  hand or by DejaVu's lookahead predictors inside the step;
- :mod:`~dejavu_lab.engine.fused_step` — the one-token step with each block finished in its
  residual add + norm;
- :mod:`~dejavu_lab.engine.decoder` — :class:`Decoder`: the cache, prefill, the decode step,
  CUDA graphs, generate (the calls a caller drives: :mod:`~dejavu_lab.engine.decode_loop`);
- :mod:`~dejavu_lab.engine.batch`   — :class:`BatchDecoder`: 1-32 sequences in lockstep, each with
  its own cache slot and heads, the MLP's union of their sets (:mod:`~dejavu_lab.engine.
  batch_sets`, :mod:`~dejavu_lab.engine.batch_blocks`);
- :mod:`~dejavu_lab.engine.thresholds` — :func:`calibrate_thresholds` for a target sparsity from
  a dense prefill (speed benchmarks on random weights);
- :func:`step_bytes` (:mod:`dejavu_lab.step_bytes`): the bytes a step reads (its floor);
- :mod:`~dejavu_lab.engine.tp_weights` — :func:`shard_weights`, :func:`random_shard`: one
  tensor-parallel rank's share of the weights (Megatron layout);
- :mod:`~dejavu_lab.engine.tp` — :class:`TPDecoder`: the decoder on one rank of
  ``torch.distributed`` (``torchrun``), its block outputs all-reduced.

>>> import torch
>>> from dejavu_lab.engine import METHODS, Decoder
>>> from dejavu_lab.models import random_model
>>> dec = Decoder(random_model("tiny-llama").model, max_seq_len=16)  # dense; sparse=SparseConfig
>>> dec.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape
torch.Size([1, 7])
>>> METHODS  # what SparseConfig(method=...) runs
('dense', 'dejavu', 'teal', 'wina', 'cats', 'larosa', 'rsparse')
"""

from __future__ import annotations

from ..step_bytes import predictor_bytes, step_bytes
from .batch import MAX_BATCH, BatchDecoder
from .config import DENSE_ENGINES, DENSE_OPS, METHODS, SITES, EngineError, SparseConfig, dense_ops
from .decoder import Decoder
from .plans import (
    factor_bytes,
    fold_residual,
    fold_rotations,
    plan_parts,
    random_factors,
    random_rotations,
)
from .refit import fold_refit
from .sets import KeptSets
from .thresholds import calibrate_thresholds, column_norms, keep_all
from .tp import NVLS_OFF, TPDecoder, init_tp, split_indices
from .tp_weights import ShardedWeights, TPShard, random_shard, shard_weights, tp_shard
from .weights import DecoderWeights, LayerWeights, decoder_weights

__all__ = [
    "DENSE_ENGINES",
    "DENSE_OPS",
    "MAX_BATCH",
    "METHODS",
    "BatchDecoder",
    "SITES",
    "Decoder",
    "DecoderWeights",
    "EngineError",
    "KeptSets",
    "LayerWeights",
    "SparseConfig",
    "calibrate_thresholds",
    "column_norms",
    "decoder_weights",
    "dense_ops",
    "factor_bytes",
    "fold_refit",
    "fold_residual",
    "fold_rotations",
    "keep_all",
    "plan_parts",
    "random_factors",
    "random_rotations",
    "predictor_bytes",
    "step_bytes",
    "NVLS_OFF",
    "ShardedWeights",
    "TPDecoder",
    "TPShard",
    "init_tp",
    "random_shard",
    "shard_weights",
    "split_indices",
    "tp_shard",
]
