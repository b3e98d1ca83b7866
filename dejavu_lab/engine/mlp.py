"""The MLP block of one layer in a decode step: dense, DejaVu's kept neurons, TEAL/WINA, CATS.

Each decoder layer gets one of these at construction (the method decides, once) holding its
layer's weights and thresholds; calling it on x [B, d] gives the block's output [B, d]:

- :class:`DenseMLP` — cuBLAS (with the fused bias + ReLU epilogue where it applies), or our
  gather kernel over every neuron (``dense_ops`` ``mlp=triton`` on the ``"rows"`` layout);
- :class:`KeptMLP` — DejaVu (§4.3): the kept neurons' rows of ``W_in`` and ``W2^T`` only
  (:func:`~dejavu_lab.kernels.sparse_mlp_up` + :func:`~dejavu_lab.kernels.sparse_mlp_down`, or
  :func:`~dejavu_lab.kernels.fused_sparse_mlp`), the kept set read from the decoder's sets;
- :class:`ThresholdMLP` — TEAL / WINA: the columns of ``W_in^T`` and ``W2^T`` whose input entry
  passes its threshold (:func:`~dejavu_lab.kernels.threshold_gemv`);
- :class:`CatsMLP` — CATS: a dense gate, then the up and down rows of the neurons with
  ``|act(gate)| > thr`` (:func:`~dejavu_lab.kernels.cats_mlp`).

``src(x, fuse_hidden)`` is the block as the fused one-token step takes it
(:func:`~dejavu_lab.engine.fused_step.fused_layers`): ``(output, bias still to add, whether it is
fp32 sums, the gate/up sums the epilogue must zero or None)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import (
    cats_hidden,
    cats_mlp,
    cats_sums,
    fused_sparse_mlp,
    sparse_mlp_down,
    sparse_mlp_up,
    threshold_gemv,
    threshold_gemv_act,
    threshold_sums,
)
from .weights import linear_t

__all__ = ["CatsMLP", "DenseMLP", "KeptMLP", "ThresholdMLP", "act", "gate_act", "mlp_block"]

_ACT = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}


def gate_act(a: torch.Tensor, activation: str, gated: bool, n: int) -> torch.Tensor:
    """act(gate) of ``a = [gate | up]`` (gated, n neurons), or act(a) (fc1): what CATS thresholds.

    >>> gate_act(torch.tensor([[-1.0, 2.0, 3.0, 4.0]]), "relu", gated=True, n=2)
    tensor([[0., 2.]])
    """
    f = _ACT[activation]
    return f(a[..., :n]) if gated else f(a)


def act(a: torch.Tensor, activation: str, gated: bool, n: int) -> torch.Tensor:
    """act(a) (ReLU/GELU) or act(gate) * up (gated, ``a = [gate | up]``).

    >>> a = torch.tensor([[-1.0, 2.0, 3.0, 4.0]])
    >>> act(a, "relu", gated=True, n=2), act(a, "relu", gated=False, n=4)
    (tensor([[0., 8.]]), tensor([[0., 2., 3., 4.]]))
    """
    g = gate_act(a, activation, gated, n)
    return g * a[..., n:] if gated else g


class DenseMLP:
    """Every neuron: cuBLAS, or (``triton=True``, rows layout) our gather kernel over all of
    them (``every``: the int32 indices 0..n-1, shared by the layers).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model
    >>> w = decoder_weights(m)
    >>> mlp, x = DenseMLP(w.layers[0], w), torch.randn(1, 64)
    >>> hf = m.model.decoder.layers[0]
    >>> torch.allclose(mlp(x), hf.fc2(torch.relu(hf.fc1(x))), atol=1e-5)
    True
    """

    def __init__(self, lw, w, *, triton: bool = False, every: torch.Tensor | None = None):
        self.lw, self.activation = lw, w.activation
        self.gated, self.n = w.arch.gated, w.arch.d_mlp
        self.triton, self.every = triton, every

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.triton:
            return self.torch(x)
        lw = self.lw
        return fused_sparse_mlp(x, lw.w_in, lw.w_down_t, self.every, activation=self.activation,
                                gated=self.gated, b_in=lw.b_in, b_down=lw.b_down,
                                validate=False)  # fmt: skip

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP through cuBLAS (fused bias + ReLU epilogue where it applies)."""
        lw = self.lw
        if (self.activation == "relu" and not self.gated and lw.b_in is not None
                and lw.w_in is not None and x.is_cuda):  # fmt: skip
            h = torch._addmm_activation(lw.b_in, x, lw.w_in.t())  # cuBLASLt bias+ReLU epilogue
            return linear_t(h, lw.w_down_t, lw.b_down)
        return linear_t(self.hidden(x), lw.w_down_t, lw.b_down)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activations of x, dense: act(fc1 x) or act(gate x) * up x."""
        return act(self.lw.mlp_in(x), self.activation, self.gated, self.n)

    def src(self, x: torch.Tensor, fuse_hidden: bool) -> tuple:
        return self(x), None, False, None

    def lists_for(self) -> tuple | None:
        """As :meth:`~dejavu_lab.engine.attention.DenseAttention.lists_for`: None here."""
        return None


class KeptMLP(DenseMLP):
    """DejaVu's MLP over layer ``i``'s kept neurons ``sets.mlp_idx[i]`` (read at each call:
    a batched decoder points it at its batch size's union); ``fused``: one kernel for up and
    down. ``dense_when_full`` (batches): a union holding every neuron runs cuBLAS.

    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-opt", dtype=torch.float16).model, max_seq_len=8,
    ...               sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> mlp, x = dec.mlp[0], torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> idx = mlp.sets.mlp_idx[0]  # 64 of 256 neurons: the dense MLP over those rows only
    >>> dense = mlp.hidden(x)[:, idx] @ mlp.lw.w_down_t[idx] + mlp.lw.b_down
    >>> torch.allclose(mlp(x), dense, atol=1e-2)
    True
    """

    def __init__(self, lw, w, i: int, sets, *, fused: bool, dense_when_full: bool = False):
        super().__init__(lw, w)
        self.i, self.sets, self.fused, self.dense_when_full = i, sets, fused, dense_when_full

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lw, n, idx = self.lw, self.n, self.sets.mlp_idx[self.i]
        if self.dense_when_full and idx.shape[0] == n:
            return self.torch(x)
        if not self.fused:  # two gather-GEMVs (faster on the H200: SparseConfig.fused)
            b = lw.b_in
            h = sparse_mlp_up(
                x, lw.w_in[:n], idx, bias=None if b is None else b[:n],
                activation=self.activation, up_weight=lw.w_in[n:] if self.gated else None,
                up_bias=None if (b is None or not self.gated) else b[n:], validate=False,
            )  # fmt: skip
            return sparse_mlp_down(h, lw.w_down_t, idx, bias=lw.b_down, validate=False,
                                   config=self.sets.down_config)  # fmt: skip
        return fused_sparse_mlp(x, lw.w_in, lw.w_down_t, idx, activation=self.activation,
                                gated=self.gated, b_in=lw.b_in, b_down=lw.b_down,
                                validate=False)  # fmt: skip


class ThresholdMLP(DenseMLP):
    """TEAL / WINA: ``t_in`` on the MLP's input (mlp_in), ``t_down`` on the hidden activations
    (down_in), each a :class:`~dejavu_lab.engine.site_thresholds.Threshold` or None (dense).
    ``sums=False`` (a CATS layer without a gate threshold) gives the fused step a finished output.

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> dec = Decoder(m, max_seq_len=8, sparse=SparseConfig(method="teal", thresholds=keep_all(m)))
    >>> mlp, x = dec.mlp[0], torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> type(mlp).__name__, torch.allclose(mlp(x), DenseMLP(mlp.lw, dec.w)(x), atol=1e-2)
    ('ThresholdMLP', True)
    """

    def __init__(self, lw, w, t_in, t_down, *, sums: bool = True):
        super().__init__(lw, w)
        self.t_in, self.t_down, self.sums = t_in, t_down, sums

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        h = self.hidden(x)
        if self.t_down is None:
            return linear_t(h, lw.w_down_t, lw.b_down)
        return threshold_gemv(h, lw.w_down_t, self.t_down.at(x), bias=lw.b_down)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activations of x (mlp_in thresholded, or dense)."""
        if self.t_in is None:
            return super().hidden(x)
        # one token: the activation runs in the GEMV's finalize launch
        return threshold_gemv_act(x, self.lw.w_in_t, self.t_in.at(x), activation=self.activation,
                                  gated=self.gated, bias=self.lw.b_in)  # fmt: skip

    def src(self, x: torch.Tensor, fuse_hidden: bool) -> tuple:
        """A thresholded down GEMV leaves its sums; with ``fuse_hidden`` it also finishes the
        gate/up sums in its loads, act(gate) * up, so the hidden activations cost no launch."""
        if not self.sums or self.t_down is None:
            return self(x), None, False, None
        lw, t_down = self.lw, self.t_down.at(x)
        t_in = None if self.t_in is None else self.t_in.at(x)
        gu = None
        if fuse_hidden and t_in is not None:
            gu = threshold_sums(x, lw.w_in_t, t_in, kind="hidden")
        if gu is not None:
            ws = threshold_sums(
                gu, lw.w_down_t, t_down, x_act=self.activation, x_gated=self.gated, x_bias=lw.b_in
            )
            if ws is not None:
                return ws, lw.b_down, True, gu
            gu.zero_()  # not reached at today's shapes: both GEMVs take the tile kernel
        h = self.hidden(x)
        ws = threshold_sums(h, lw.w_down_t, t_down)
        if ws is not None:
            return ws, lw.b_down, True, None
        return threshold_gemv(h, lw.w_down_t, t_down, bias=lw.b_down), None, False, None


class CatsMLP(DenseMLP):
    """CATS: dense gate, up/down rows of the neurons with ``|act(gate)| > gate`` (a
    :class:`~dejavu_lab.engine.site_thresholds.Threshold`; its kernels read the vector).

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> cats = SparseConfig(method="cats", thresholds=keep_all(m, "cats"))
    >>> dec = Decoder(m, max_seq_len=8, sparse=cats)
    >>> mlp, x = dec.mlp[0], torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> type(mlp).__name__, torch.allclose(mlp(x), DenseMLP(mlp.lw, dec.w)(x), atol=1e-2)
    ('CatsMLP', True)
    """

    def __init__(self, lw, w, gate):
        super().__init__(lw, w)
        self.gate = gate.vector

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        return cats_mlp(x, lw.w_in, lw.w_down_t, self.gate, activation=self.activation,
                        b_in=lw.b_in, b_down=lw.b_down)  # fmt: skip

    def src(self, x: torch.Tensor, fuse_hidden: bool) -> tuple:
        """The down GEMV finishes the gate and kept up rows' sums (``fuse_hidden``), or reads
        the kept neurons' activations h (threshold 0)."""
        lw, gate, a, n = self.lw, self.gate, self.activation, self.n
        gu = None
        if fuse_hidden:  # gate and kept up rows as sums, finished by the down GEMV
            gu = cats_sums(x, lw.w_in, gate, activation=a, n=n, b_in=lw.b_in)
        if gu is not None:
            ws = threshold_sums(
                gu, lw.w_down_t, gate, x_act=a, x_gated=self.gated, x_bias=lw.b_in, keep_gate=True
            )
            if ws is not None:
                return ws, lw.b_down, True, gu
            gu.zero_()  # not reached at today's shapes: the down GEMV takes the tile kernel
        h = cats_hidden(x, lw.w_in, gate, activation=a, n=n, b_in=lw.b_in)
        ws = threshold_sums(h, lw.w_down_t, 0.0)
        if ws is not None:
            return ws, lw.b_down, True, None
        return threshold_gemv(h, lw.w_down_t, 0.0, bias=lw.b_down), None, False, None


def mlp_block(lw, w, thresholds: dict, *, cats: bool, triton: bool, every: torch.Tensor):
    """The MLP block of layer ``lw`` for a dense, TEAL, WINA or CATS decoder (``thresholds``:
    the layer's ``{site: Threshold or None}``; ``triton``: the dense MLP through our kernel).

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> cats = SparseConfig(method="cats", thresholds=keep_all(m, "cats"))
    >>> dec = Decoder(m, max_seq_len=8, sparse=cats)
    >>> t = dec.site_thresholds[0]  # a gate threshold only
    >>> [type(mlp_block(dec.w.layers[0], dec.w, t, cats=c, triton=False, every=None)).__name__
    ...  for c in (True, False)]
    ['CatsMLP', 'DenseMLP']
    """
    t = thresholds
    if cats and t["gate"] is not None:
        return CatsMLP(lw, w, t["gate"])
    if t["mlp_in"] is None and t["down_in"] is None:
        return DenseMLP(lw, w, triton=triton, every=every)
    # a CATS layer without a gate threshold finishes its own output
    return ThresholdMLP(lw, w, t["mlp_in"], t["down_in"], sums=not cats)
