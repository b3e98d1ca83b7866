"""The one-token decode step with each block's output finished inside the residual add and
the next norm — for every path of a pre-LN model (dense, TEAL, WINA, CATS, DejaVu).

The plain step (:meth:`dejavu_lab.engine.Decoder._layers`) runs, per block, the block's last
GEMV (with a finalize launch where it is a threshold GEMV), a residual add in PyTorch and the
next norm: three launches over one row, two for cuBLAS's dense output. Here
:func:`~dejavu_lab.kernels.residual_norm` does all of it in one, taking a threshold GEMV's
fp32 sums straight from the workspace (:func:`~dejavu_lab.kernels.threshold_sums`): each
block gives its output as ``src`` (:meth:`~dejavu_lab.engine.attention.DenseAttention.o_src`,
:meth:`~dejavu_lab.engine.mlp.DenseMLP.src`). So each layer carries both the residual stream
and its norm to the next: ``(x, norm(x))``. Where the next block is an int4 TEAL product, the
norm also lists the product's kept rows (its ``lists_for``, :mod:`~dejavu_lab.kernels.int4.lists`). With ``fuse_hidden = True`` a thresholded MLP's
hidden activations get no launch either: the down GEMV reads the gate/up GEMV's sums and
applies ``act(gate) * up`` as it loads them, and the residual epilogue after it zeroes them.
CATS's gate and kept up rows are summed that way too (:func:`~dejavu_lab.kernels.cats_sums`),
and its down GEMV keeps the neurons whose ``|act(gate)|`` passes the threshold. It is on by
default: on an H200 it takes TEAL 50% from 4.196 to 4.124 ms per token at Llama-2-13B's shape
and from 2.772 to 2.721 at Llama-3-8B's (``results/fused_hidden.json``;
``kernels/bench_engine.py --no-fuse-hidden`` turns it off).

Where it applies: one token, a pre-LN model, a GPU (or the CPU under ``TRITON_INTERPRET=1``),
every method. DejaVu's blocks finish their own outputs (its gather-GEMVs reduce their splits
themselves), so there the fused step saves the residual add's launch and runs its lookahead
predictors beside each layer as the plain step does. Decoders
that change the blocks (batched, tensor-parallel) turn it off; ``fuse_epilogues = False`` on a
decoder runs the plain step, for timing the difference (``kernels/bench_engine.py --plain``);
set it before :meth:`~dejavu_lab.engine.decode_loop.DecodeLoop.capture` (a captured graph keeps the step it
recorded).

>>> import torch
>>> from dejavu_lab.engine import Decoder
>>> from dejavu_lab.models import random_model
>>> m = random_model("tiny-llama", dtype=torch.float16).model
>>> dec, ids = Decoder(m, max_seq_len=16), torch.tensor([[1, 2, 3]])
>>> fused = dec.generate(ids, 4)  # on CPU: fused under TRITON_INTERPRET=1 only
>>> dec.fuse_epilogues = False
>>> dec.generate(ids, 4).tolist() == fused.tolist()
True
"""

from __future__ import annotations

import torch

from ..kernels import residual_norm, row_norm

__all__ = ["fused_layers"]


def _norm_of(p: tuple, kind: str) -> tuple:
    w, b, eps = p
    return (w, b if kind == "layer" else None, eps)


def fused_layers(x: torch.Tensor, w, attn: list, mlp: list, *, fuse_hidden: bool,
                 lookahead=None) -> torch.Tensor:  # fmt: skip
    """Every block of a one-token step on x [1, d] (weights ``w``, each layer's attention and
    MLP blocks): attention and MLP with their outputs added to the residual stream and normed
    for the next block in one launch each. ``lookahead``: DejaVu's predictors
    (:class:`~dejavu_lab.engine.lookahead.Lookahead`, layer 0's sets already predicted), run
    beside each layer.

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama", dtype=torch.float16).model, max_seq_len=8)
    >>> _ = dec.prefill(torch.tensor([[1, 2, 3]]))
    >>> dec._per_step(); x = dec._embed(dec.tok_t, dec.pos_t)  # the next token, [1, d]
    >>> plain = dec._block(1, dec._block(0, x, dec.attn[0], dec.mlp[0]), dec.attn[1], dec.mlp[1])
    >>> fused = fused_layers(x, dec.w, dec.attn, dec.mlp, fuse_hidden=True)
    >>> torch.allclose(fused, plain, atol=1e-2)
    True
    """
    layers, kind, n = w.layers, w.norm, len(w.layers)
    nw, nb, eps = _norm_of(layers[0].ln_attn, kind)
    xn = row_norm(x, nw, nb, eps=eps, kind=kind)
    for i in range(n):
        if lookahead is not None:
            lookahead.before(i, x)
        src, bias, sums = attn[i].src(xn)
        lists = mlp[i].lists_for() if fuse_hidden else None
        h, hn = residual_norm(
            src, bias, x, _norm_of(layers[i].ln_mlp, kind), kind=kind, from_sums=sums, lists=lists
        )
        src, bias, sums, gu = mlp[i].src(hn, fuse_hidden)
        nxt = _norm_of(layers[i + 1].ln_attn, kind) if i + 1 < n else None
        lists = attn[i + 1].lists_for() if i + 1 < n else None
        x, xn = residual_norm(src, bias, h, nxt, kind=kind, from_sums=sums, zero=gu, lists=lists)
        if lookahead is not None:
            lookahead.after()
    return x
