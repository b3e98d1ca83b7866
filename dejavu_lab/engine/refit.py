"""A refit folded into the engine's weights: the threshold step reads ``W R`` (TEAL, WINA).

:mod:`dejavu_lab.sparsify.refit` fits, per thresholded site, the matrix ``R`` that best recovers
a layer's input from its kept entries; the layer then reads ``W' = W R`` where it read ``W``.
``W'`` has ``W``'s shape and the step reads its kept columns as before, so the engine runs a
refit with no new kernel and no extra byte: :func:`fold_refit` returns weights with every
refitted site's matrices replaced — ``W_QKV`` for ``attn_in``, ``W_in`` (gate and up, or fc1)
for ``mlp_in``, ``W_O`` for ``o_in`` — in whichever layouts the weights hold, and the step
runs with the same thresholds the refit was fitted under. ``W R`` holds for thresholded inputs
only, so the folded weights carry those sites' thresholds and the prefill masks them too, as the
hooks that measure quality mask every token (``DecoderWeights.prefill_masks``); the batched and
tensor-parallel decoders refuse such weights.

>>> import torch
>>> from dejavu_lab.engine import decoder_weights
>>> from dejavu_lab.models import random_model
>>> from dejavu_lab.sparsify.refit import Refit
>>> w = decoder_weights(random_model("tiny-llama").model)
>>> r = Refit({}, "", "", 1.0, {(0, "mlp_in"): torch.eye(64)})  # the identity: nothing moves
>>> f = fold_refit(w, r, {(0, "mlp_in"): 0.1})
>>> torch.equal(f.layers[0].w_in, w.layers[0].w_in), f.prefill_masks
(True, {(0, 'mlp_in'): 0.1})
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .config import EngineError
from .weights import DecoderWeights

__all__ = ["fold_refit"]

# site -> (rows-layout name, columns-layout name) of the matrices that read it
_READERS = {"attn_in": ("w_qkv", "w_qkv_t"), "mlp_in": ("w_in", "w_in_t"), "o_in": (None, "w_o_t")}


@torch.no_grad()
def fold_refit(w: DecoderWeights, refit, thresholds: dict) -> DecoderWeights:
    """Weights with each refitted site's readers turned to ``W R``: a new
    :class:`~dejavu_lab.engine.weights.DecoderWeights` sharing every other tensor with ``w``
    (``w`` is left as it was). ``refit``: a :class:`~dejavu_lab.sparsify.refit.Refit` of the
    model ``w`` was built from (its maps' shapes are checked here); ``thresholds``: the
    ``{(layer, site): t}`` it was fitted under, which the step runs with
    (``SparseConfig(method, thresholds=...)``) and the prefill masks the refitted sites with.

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify.refit import Refit
    >>> w = decoder_weights(random_model("tiny-llama").model)
    >>> fold_refit(w, Refit({}, "", "", 1.0, {(0, "down_in"): torch.eye(256)}), {(0, "down_in"): 0})
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: refit has site 'down_in'; the engine folds a refit of attn_in, mlp_in and o_in.
    """
    maps = getattr(refit, "maps", None)
    if not isinstance(maps, dict):
        raise EngineError(
            "refit must be a Refit from dejavu_lab.sparsify.refit.fit_refit (or load_refit), got "
            f"{type(refit).__name__}."
        )
    missing = sorted(set(maps) - set(thresholds))
    if missing:
        raise EngineError(
            f"thresholds lack {missing[0]}, which the refit turns: pass the thresholds it was "
            "fitted under (those the step runs with)."
        )
    layers = list(w.layers)
    for (i, site), r in sorted(maps.items()):
        if site not in _READERS:
            raise EngineError(
                f"refit has site {site!r}; the engine folds a refit of attn_in, mlp_in and o_in."
            )
        if not (isinstance(i, int) and 0 <= i < len(layers)):
            raise EngineError(
                f"refit has layer {i!r} but the model has layers 0..{len(layers) - 1}."
            )
        rows, cols = _READERS[site]
        lw, new = layers[i], {}
        for name, t in ((rows, False), (cols, True)):
            m = getattr(lw, name) if name else None
            if m is None:
                continue
            d = m.shape[0] if t else m.shape[1]
            if tuple(r.shape) != (d, d):
                raise EngineError(
                    f"refit[({i}, {site!r})] is {tuple(r.shape)}, but that site's input has {d} "
                    "entries: the refit was fitted for another model."
                )
            rf = r.to(m.device, torch.float32)
            # rows [out, d]: W R; columns [d, out] = Wᵀ: (W R)ᵀ = Rᵀ Wᵀ
            new[name] = ((rf.T @ m.float()) if t else (m.float() @ rf)).to(m.dtype).contiguous()
        layers[i] = replace(lw, **new)
    masks = {k: thresholds[k] for k in sorted(maps)}
    return replace(w, layers=layers, prefill_masks={**w.prefill_masks, **masks})
