"""The one-token decode step with each block's output finished inside the residual add and
the next norm — for the dense, TEAL, WINA and CATS paths of a pre-LN model.

The plain step (:meth:`dejavu_lab.engine.Decoder._layers`) runs, per block, the block's last
GEMV (with a finalize launch where it is a threshold GEMV), a residual add in PyTorch and the
next norm: three launches over one row, two for cuBLAS's dense output. Here
:func:`~dejavu_lab.kernels.epilogue.residual_norm` does all of it in one, taking a threshold
GEMV's fp32 sums straight from the workspace (:func:`~dejavu_lab.kernels.threshold_tile.threshold_sums`).
So each layer carries both the residual stream and its norm to the next: ``(x, norm(x))``.
With ``fuse_hidden = True`` a thresholded MLP's hidden activations get no launch either: the
down GEMV reads the gate/up GEMV's sums and applies ``act(gate) * up`` as it loads them, and
the residual epilogue after it zeroes them. CATS's gate and kept up rows are summed that way
too (:func:`~dejavu_lab.kernels.cats_mlp.cats_sums`), and its down GEMV keeps the neurons
whose ``|act(gate)|`` passes the threshold. It is on by default: on an H200 it takes TEAL 50%
from 4.196 to 4.124 ms per token at Llama-2-13B's shape and from 2.772 to 2.721 at
Llama-3-8B's (``results/fused_hidden.json``; ``kernels/bench_engine.py --no-fuse-hidden``
turns it off).

Where it applies: one token, a pre-LN model, a GPU (or the CPU under ``TRITON_INTERPRET=1``),
any method but DejaVu (whose blocks run their own kernels and lookahead predictors). Decoders
that change the blocks (batched, tensor-parallel) turn it off; ``fuse_epilogues = False`` on a
decoder runs the plain step, for timing the difference (``kernels/bench_engine.py --plain``);
set it before :meth:`~dejavu_lab.engine.Decoder.capture` (a captured graph keeps the step it
recorded).
"""

from __future__ import annotations

import torch

from ..kernels import (
    cats_hidden,
    cats_sums,
    residual_norm,
    row_norm,
    threshold_gemv,
    threshold_sums,
    use_triton,
)

__all__ = ["FusedStep"]


class FusedStep:
    """A mixin of :class:`dejavu_lab.engine.Decoder` (expects its weights, blocks and
    ``method``): :meth:`_layers_fused` runs every block of a one-token step.

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

    fuse_epilogues = True  # the fused step where it applies (False: the plain step)
    fuse_hidden = True  # the down GEMV finishes the gate/up sums (False: their own launch)

    def _fusable(self, x: torch.Tensor) -> bool:
        return (self.fuse_epilogues and self.method != "dejavu" and self.arch.pre_ln
                and x.shape[0] == 1 and use_triton(x.device)
                and self.w.dtype in (torch.float16, torch.bfloat16))  # fmt: skip

    def _norm_of(self, p: tuple) -> tuple:
        w, b, eps = p
        return (w, b if self.w.norm == "layer" else None, eps)

    def _layers_fused(self, x: torch.Tensor) -> torch.Tensor:
        """Every block of a one-token step on x [1, d]: attention and MLP with their outputs
        added to the residual stream and normed for the next block in one launch each."""
        layers, kind, n = self.w.layers, self.w.norm, self.arch.n_layers
        w, b, eps = self._norm_of(layers[0].ln_attn)
        xn = row_norm(x, w, b, eps=eps, kind=kind)
        for i in range(n):
            o = self._attn_core(i, self._qkv_rot(i, xn))
            src, bias, sums = self._o_src(i, o)
            h, hn = residual_norm(src, bias, x, self._norm_of(layers[i].ln_mlp), kind=kind,
                                  from_sums=sums)  # fmt: skip
            src, bias, sums, hidden = self._mlp_src(i, hn)
            nxt = self._norm_of(layers[i + 1].ln_attn) if i + 1 < n else None
            x, xn = residual_norm(src, bias, h, nxt, kind=kind, from_sums=sums, zero=hidden)
        return x

    def _o_src(self, i: int, o: torch.Tensor) -> tuple:
        """o [1, H dh] times W_O^T as (output, bias still to add, whether it is fp32 sums)."""
        lw, thr = self.w.layers[i], self._thr(i, "o_in", o)
        ws = threshold_sums(o, lw.w_o_t, thr) if thr is not None else None
        if ws is not None:
            return ws, lw.b_o, True
        return self._out(i, o), None, False

    def _mlp_src(self, i: int, x: torch.Tensor) -> tuple:
        """The MLP of x as (output, bias still to add, whether it is fp32 sums, the gate/up
        sums the epilogue must zero or None). A thresholded down GEMV leaves its sums (TEAL,
        WINA; with ``fuse_hidden`` it also finishes the gate/up sums in its loads, act(gate) *
        up, so the hidden activations cost no launch), and so does CATS's (over its kept
        neurons' activations, threshold 0); a dense MLP gives a tensor."""
        lw, t_down = self.w.layers[i], self._thr(i, "down_in", x)
        gate = self.site_thresholds[i].get("gate") if self.method == "cats" else None
        if gate is not None:  # CATS: the down GEMV finishes gate/up sums, or reads h (thr 0)
            act, n = self.w.activation, self.arch.d_mlp
            gu = None
            if self.fuse_hidden:  # gate and kept up rows as sums, finished by the down GEMV
                gu = cats_sums(x, lw.w_in, gate, activation=act, n=n, b_in=lw.b_in)
            if gu is not None:
                ws = threshold_sums(gu, lw.w_down_t, gate, x_act=act, x_gated=self.arch.gated,
                                    x_bias=lw.b_in, keep_gate=True)  # fmt: skip
                if ws is not None:
                    return ws, lw.b_down, True, gu
                gu.zero_()  # not reached at today's shapes: the down GEMV takes the tile kernel
            h = cats_hidden(x, lw.w_in, gate, activation=act, n=n, b_in=lw.b_in)
            ws = threshold_sums(h, lw.w_down_t, 0.0)
            if ws is not None:
                return ws, lw.b_down, True, None
            return threshold_gemv(h, lw.w_down_t, 0.0, bias=lw.b_down), None, False, None
        if self.method == "cats" or t_down is None:
            return self._mlp(i, x), None, False, None
        t_in = self._thr(i, "mlp_in", x)
        gu = None
        if self.fuse_hidden and t_in is not None:
            gu = threshold_sums(x, lw.w_in_t, t_in, kind="hidden")
        if gu is not None:
            ws = threshold_sums(gu, lw.w_down_t, t_down, x_act=self.w.activation,
                                x_gated=self.arch.gated, x_bias=lw.b_in)  # fmt: skip
            if ws is not None:
                return ws, lw.b_down, True, gu
            gu.zero_()  # not reached at today's shapes: both GEMVs take the tile kernel
        h = self._hidden(i, x, t_in)
        ws = threshold_sums(h, lw.w_down_t, t_down)
        if ws is not None:
            return ws, lw.b_down, True, None
        return threshold_gemv(h, lw.w_down_t, t_down, bias=lw.b_down), None, False, None
