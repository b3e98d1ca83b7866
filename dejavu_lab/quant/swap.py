"""A model run on its 4-bit weights: every decoder-layer linear swapped for its dequantised int4.

Quality on 4-bit weights is measured on CPU through the ordinary forward (and the sparsity hooks
of :func:`dejavu_lab.sparsify.sparsified`), so what is measured is the *format* — the values an
int4 kernel multiplies by — not a kernel. :func:`dequantized` puts ``Int4Weight.dequantize()``
into each named ``nn.Linear`` and gives the original tensors back on exit, bit for bit (the
module keeps the very tensor it had). :func:`rtn_weights` builds the weights by round-to-nearest;
:func:`dejavu_lab.quant.gguf_model.import_gguf` reads them from a GGUF file.

The decoder layers' seven (Llama-family) or four-plus (OPT) projections are swapped; the
embedding and the unembedding keep their loaded values (a decode step reads the unembedding in
full whatever the activations do; see :mod:`dejavu_lab.step_bytes`).

>>> from dejavu_lab.models import random_model
>>> model, _, arch = random_model("tiny-llama")
>>> w = model.model.layers[0].mlp.down_proj.weight
>>> before = w.detach().clone()
>>> with dequantized(model, rtn_weights(model, group=64)):
...     changed = not torch.equal(model.model.layers[0].mlp.down_proj.weight, before)
>>> changed, torch.equal(model.model.layers[0].mlp.down_proj.weight, before)
(True, True)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..errors import QuantError
from .int4 import Int4Weight, quantize

__all__ = ["decoder_linears", "dequantized", "rtn_weights"]


def decoder_linears(model: nn.Module, arch: Arch | None = None) -> dict[str, tuple[int, str]]:
    """Module name -> (layer, part) of every decoder-layer linear; parts q, k, v, o, then the
    MLP's inputs (gate, up; or fc1) and its output (down; or fc2), as the arch table names them.

    >>> from dejavu_lab.models import random_model
    >>> list(decoder_linears(random_model("tiny-llama").model))[4:7]
    ['model.layers.0.mlp.gate_proj', 'model.layers.0.mlp.up_proj', 'model.layers.0.mlp.down_proj']
    """
    arch = arch or get_arch(model)
    t = arch.table
    out = {}
    for i in range(arch.n_layers):
        prefix = f"{t.layers}.{i}."
        for part in ("q", "k", "v", "o"):
            out[prefix + getattr(t, part)] = (i, part)
        names = ("gate", "up") if arch.gated else ("fc1",)
        for part, path in zip(names, t.mlp_in, strict=True):
            out[prefix + path] = (i, part)
        out[prefix + t.mlp_out] = (i, "down" if arch.gated else "fc2")
    return out


def rtn_weights(
    model: nn.Module,
    group: int = 128,
    dtype: torch.dtype = torch.float16,
    *,
    arch: Arch | None = None,
) -> dict[str, Int4Weight]:
    """Round-to-nearest int4 (:func:`~dejavu_lab.quant.int4.quantize`) of every decoder linear.

    ``dtype``: of the scales and mins (the kernels read them in the activations' dtype).

    >>> from dejavu_lab.models import random_model
    >>> w = rtn_weights(random_model("tiny-llama").model, group=32)
    >>> q = w["model.layers.1.mlp.down_proj"]
    >>> q.shape, q.group, q.dtype  # w_t: [in (the 192 neurons), out]
    ((192, 64), 32, torch.float16)
    """
    mods = dict(model.named_modules())
    out = {}
    for name in decoder_linears(model, arch):
        w = mods[name].weight.detach()
        out[name] = quantize(w.T, group=group, dtype=dtype)
    return out


@contextmanager
def dequantized(model: nn.Module, weights: Mapping[str, Int4Weight]) -> Iterator[nn.Module]:
    """Run ``model`` with each named linear's weight replaced by ``weights[name].dequantize()``.

    The values are computed in fp32 and cast to the module's weight dtype; on exit (error
    included) every module gets back the tensor it had before.

    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> ids = torch.arange(8)[None]
    >>> with torch.no_grad(), dequantized(model, rtn_weights(model, group=64, dtype=torch.float32)):
    ...     err = (model(ids).logits - random_model("tiny-llama").model(ids).logits).abs().max()
    >>> 0 < float(err) < 0.1  # 4-bit weights, a little off the fp32 ones
    True
    """
    mods = dict(model.named_modules())
    new = {}
    for name, q in weights.items():
        m = mods.get(name)
        if not isinstance(m, nn.Linear):
            raise QuantError(
                f"{name!r} is not a linear layer of this model; pass decoder_linears' names."
            )
        if q.shape != (m.in_features, m.out_features):
            raise QuantError(
                f"{name!r} is [{m.out_features}, {m.in_features}] but its int4 weight stands for "
                f"w_t of {q.shape}; pass weights quantised from this model's linears."
            )
        w = m.weight
        new[name] = q.dequantize(torch.float32).T.to(w.dtype).to(w.device).contiguous()
    saved = {}
    try:  # a new Parameter, not new .data: a tied lm_head must not change the input embeddings
        for name, w in new.items():
            saved[name] = mods[name].weight
            mods[name].weight = nn.Parameter(w, requires_grad=False)
        yield model
    finally:
        for name, p in saved.items():
            mods[name].weight = p
