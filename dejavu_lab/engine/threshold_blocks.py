"""The decode step's blocks for TEAL, WINA and CATS — and for the dense path, their all-dense case.

TEAL (Liu et al. 2024) and WINA (2025) sparsify the *input* of every linear layer: column i of
a weight is read for a token only where ``|x_i| > thr_i``, at four sites per layer — ``attn_in``
(the shared input of q/k/v), ``o_in`` (the input of ``o_proj``), ``mlp_in`` (the shared input of
gate/up or ``fc1``) and ``down_in`` (the input of ``down_proj``/``fc2``); WINA's thresholds are
TEAL's rule with the score ``|x_i| * ||W[:, i]||``, i.e. ``t / ||W[:, i]||`` per column, so the
engine runs both through one path: :func:`~dejavu_lab.kernels.threshold_gemv` over the weights
stored transposed (``w_qkv_t``, ``W_O^T``, ``w_in_t``, ``W2^T``), the mask computed in the kernel
from x (no index list, no host synchronisation, fixed launch shape: captured in the CUDA graph),
attention over every head. CATS (Lee et al. 2024) computes the gate densely and reads the up and
down rows of the neurons with ``|act(gate)| > thr`` only (:func:`~dejavu_lab.kernels.cats_mlp`).

A layer or site without a threshold runs dense, and the dense path is this path with no
threshold anywhere. Each dense op runs either through torch (cuBLAS GEMVs, PyTorch attention) or
through our kernels at 100% kept (``dense_ops``), whichever measures faster at the shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import (
    cats_mlp,
    fused_sparse_mlp,
    query_slots,
    rope_,
    rope_sums,
    sparse_attention_core,
    sparse_mlp_up,
    threshold_gemv,
    threshold_gemv_act,
    threshold_sums,
)
from .config import EngineError

__all__ = ["DENSE_OPS", "ThresholdBlocks", "default_ops", "dense_ops"]

# the decode step's dense ops; each runs through "torch" (cuBLAS, PyTorch) or "triton" (ours)
DENSE_OPS = ("qkv", "attn", "o", "mlp")
_ACT = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}


def dense_ops(spec: str | dict | None) -> dict[str, str]:
    """Resolve a dense-op choice: ``"torch"``, ``"triton"``, ``"qkv=triton,mlp=triton"`` or a
    dict; ops not named run through torch.

    >>> dense_ops("triton")
    {'qkv': 'triton', 'attn': 'triton', 'o': 'triton', 'mlp': 'triton'}
    >>> dense_ops("mlp=triton")["mlp"], dense_ops({"o": "triton"})["qkv"]
    ('triton', 'torch')
    """
    if spec is None or spec in ("torch", "triton"):
        return dict.fromkeys(DENSE_OPS, spec or "torch")
    if isinstance(spec, str):
        try:
            spec = dict(item.split("=") for item in spec.split(",") if item)
        except ValueError:
            spec = {"?": spec}
    out = dict.fromkeys(DENSE_OPS, "torch")
    for op, impl in dict(spec).items():
        if op not in DENSE_OPS or impl not in ("torch", "triton"):
            raise EngineError(
                f"dense_ops {op}={impl!r} is not a choice; name ops among {', '.join(DENSE_OPS)} "
                "with 'torch' or 'triton' (e.g. 'qkv=triton,mlp=triton')."
            )
        out[op] = impl
    return out


def default_ops(w) -> str:
    """The dense ops a decoder over weights ``w`` runs by default: the attention core through
    our kernel on a GPU with fp16/bf16 weights (one launch that appends K/V and attends, faster
    than PyTorch's masked attention over the static cache), every op through torch elsewhere.

    >>> from types import SimpleNamespace
    >>> default_ops(SimpleNamespace(device=torch.device("cpu"), dtype=torch.float16))
    'torch'
    """
    gpu = w.device.type == "cuda" and w.dtype in (torch.float16, torch.bfloat16)
    return "attn=triton" if gpu else "torch"


def _constant(t: torch.Tensor | None) -> float | None:
    """The one value of a threshold vector whose entries are all equal, else None.

    >>> _constant(torch.full((3,), 0.5)), _constant(torch.tensor([0.5, 1.0])), _constant(None)
    (0.5, None, None)
    """
    if t is None or t.numel() == 0 or not bool((t == t[0]).all()):
        return None
    return float(t[0])


def _mm(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w_t if b is None else torch.addmm(b, x, w_t)


class ThresholdBlocks:
    """Attention over every head and the MLP, each site thresholded or dense; a mixin of
    :class:`dejavu_lab.engine.Decoder` (expects its ``w``, ``arch``, ``H``, ``Hkv``, ``dh``,
    ``kv``, ``method`` and ``ops`` attributes).

    >>> import torch
    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model  # d = 64, 192 neurons
    >>> keep_all = {(0, "mlp_in"): -torch.ones(64), (1, "down_in"): -torch.ones(192)}
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(method="teal", thresholds=keep_all))
    >>> [sorted(s for s, t in sites.items() if t is not None) for sites in dec.site_thresholds]
    [['mlp_in'], ['down_in']]
    >>> dense = Decoder(m, max_seq_len=16)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> dec.generate(ids, 4).tolist() == dense.generate(ids, 4).tolist()  # everything passes
    True
    """

    def _init_thresholds(self) -> None:
        """Per layer, each site's fp32 threshold vector on the device (None: the site is dense);
        the dense ops chosen "triton" on the columns layout read every column (threshold -1)."""
        a, dev, sp = self.arch, self.w.device, self.sparse
        given = (sp.thresholds or {}) if sp is not None else {}
        width = {"attn_in": a.d_model, "o_in": self.H * self.dh, "mlp_in": a.d_model,
                 "down_in": a.d_mlp, "gate": a.d_mlp}  # fmt: skip
        what = {"attn_in": "d_model", "o_in": "n_heads x d_head", "mlp_in": "d_model",
                "down_in": "d_mlp", "gate": "d_mlp (one per neuron)"}  # fmt: skip
        for (layer, site), thr in given.items():
            if not 0 <= layer < a.n_layers:
                raise EngineError(
                    f"thresholds has layer {layer} but the model has layers 0..{a.n_layers - 1}."
                )
            if thr.numel() != width[site]:
                raise EngineError(
                    f"thresholds[({layer}, {site!r})] has {thr.numel()} entries but site {site} "
                    f"of this model takes {width[site]} ({what[site]})."
                )
        self.site_thresholds = [
            {s: (None if (i, s) not in given else
                 given[(i, s)].detach().to(dev, torch.float32).contiguous()) for s in width}
            for i in range(a.n_layers)
        ]  # fmt: skip
        rows = self.w.layers[0].w_qkv is not None
        self._keep = {}  # keep-all vectors, shared by the layers
        for op, sites_of in (("qkv", ("attn_in",)), ("o", ("o_in",)),
                             ("mlp", ("mlp_in", "down_in"))):  # fmt: skip
            if self.ops[op] != "triton" or (rows and op != "o"):
                continue  # torch, or our row-gather kernels over every row (rows layout)
            for t in self.site_thresholds:
                for s in sites_of:
                    if t[s] is None:
                        n = width[s]
                        if n not in self._keep:
                            self._keep[n] = torch.full((n,), -1.0, device=dev)
                        t[s] = self._keep[n]
        # a site whose threshold is one number (TEAL, keep-all) passes it to the one-token
        # kernel as a float: no threshold loads (read once here, never inside a step)
        self._scalar = [{s: _constant(t) for s, t in sites.items()}
                        for sites in self.site_thresholds]  # fmt: skip
        self._qkv_all = torch.arange(self.H + 2 * self.Hkv, device=dev)  # every W_QKV block
        self._heads_all = torch.arange(self.H, device=dev)
        self._slots_all = query_slots(self._heads_all, self.H)  # once, not per step (GQA)
        self._mlp_all = torch.arange(a.d_mlp, device=dev, dtype=torch.int32)

    def _thr(self, i: int, site: str, x: torch.Tensor):
        """Layer i's threshold at ``site`` for input x: a float for one token where it is a
        single number, else the fp32 vector (None: the site is dense)."""
        scalar = self._scalar[i][site]
        return scalar if scalar is not None and x.shape[0] == 1 else self.site_thresholds[i][site]

    # ----------------------------------------------------------------------------- attention

    def _qkv(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """[1, (H + 2 Hkv) dh]: thresholded columns of W_QKV^T, or a dense projection."""
        lw, thr = self.w.layers[i], self._thr(i, "attn_in", x)
        if thr is not None:
            return threshold_gemv(x, lw.w_qkv_t, thr, bias=lw.b_qkv)
        if self.ops["qkv"] == "triton":  # rows layout: our gather-GEMV over every block
            return sparse_mlp_up(x, lw.w_qkv, self._qkv_all, bias=lw.b_qkv, activation="none",
                                 rows_per_index=self.dh, validate=False)  # fmt: skip
        return lw.qkv(x)

    def _out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """[1, d]: o [1, H dh] times W_O^T, thresholded (o_in) or dense."""
        lw, thr = self.w.layers[i], self._thr(i, "o_in", o)
        if thr is not None:
            return threshold_gemv(o, lw.w_o_t, thr, bias=lw.b_o)
        return _mm(o, lw.w_o_t, lw.b_o)

    def _qkv_rot(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """[1, (H + 2 Hkv) dh]: q/k/v of x with queries and keys turned at this position. One
        thresholded token finishes its sums inside the rotation (:func:`rope_sums`)."""
        rot = self.H + self.Hkv
        thr = self._thr(i, "attn_in", x) if self.cos is not None else None
        ws = threshold_sums(x, self.w.layers[i].w_qkv_t, thr) if thr is not None else None
        if ws is not None:
            out = torch.empty((1, ws.numel()), dtype=x.dtype, device=x.device)
            return rope_sums(ws, self.w.layers[i].b_qkv, out, self.cos, self.sin,
                             self._positions, n_rot=rot)  # fmt: skip
        qkv = self._qkv(i, x)
        if self.cos is not None:  # in place
            rope_(qkv, self.cos, self.sin, self._positions, n_rot=rot)
        return qkv

    def _attn_core(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        """[1, H dh]: this token's K/V appended to layer i's cache, every head attended."""
        H, Hkv, dh = self.H, self.Hkv, self.dh
        if self.ops["attn"] == "triton":  # our kernel appends K/V and attends, every head
            return sparse_attention_core(
                qkv, self.kv[i, 0][None], self.kv[i, 1][None], self._seqlen, self._heads_all,
                n_heads=H, kv_heads=None if H == Hkv else self._kv_all, scale=self.scale,
                q_slot=self._slots_all,
            )  # fmt: skip
        qkv = qkv.view(H + 2 * Hkv, dh)
        q, new = qkv[:H], qkv[H:].view(2, Hkv, dh)
        self.kv[i].index_copy_(2, self.pos_t, new.unsqueeze(2))
        return self._attend(i, q, self._cur_mask).view(1, H * dh)

    def _attn_all(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Attention over every head (dense, TEAL, WINA, CATS); x [1, d] -> [1, d]."""
        return self._out(i, self._attn_core(i, self._qkv_rot(i, x)))

    def _attend(self, i: int, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per head over layer i's cache; q [H, dh] -> [H, dh] (GQA by grouping)."""
        k, v = self.kv[i, 0], self.kv[i, 1]  # [Hkv, T, dh]
        qg = q.view(self.Hkv, self.H // self.Hkv, self.dh)
        s = torch.baddbmm(mask.view(1, 1, -1), qg, k.transpose(1, 2), alpha=self.scale)
        return torch.bmm(torch.softmax(s, dim=-1), v).view(self.H, self.dh)

    # ----------------------------------------------------------------------------- MLP

    def _mlp_torch(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP through cuBLAS (fused bias + ReLU epilogue where it applies)."""
        lw = self.w.layers[i]
        if (self.w.activation == "relu" and not self.arch.gated and lw.b_in is not None
                and lw.w_in is not None and x.is_cuda):  # fmt: skip
            h = torch._addmm_activation(lw.b_in, x, lw.w_in.t())  # cuBLASLt bias+ReLU epilogue
            return _mm(h, lw.w_down_t, lw.b_down)
        return _mm(self._act(lw.mlp_in(x)), lw.w_down_t, lw.b_down)

    def _gate_act(self, a: torch.Tensor) -> torch.Tensor:
        """act(gate) of a = [gate | up] (gated), or act(a) (fc1): what CATS thresholds."""
        act = _ACT[self.w.activation]
        return act(a[..., : self.arch.d_mlp]) if self.arch.gated else act(a)

    def _act(self, a: torch.Tensor) -> torch.Tensor:
        """act(a) (ReLU/GELU) or act(gate) * up (gated, a = [gate | up])."""
        g = self._gate_act(a)
        return g * a[..., self.arch.d_mlp :] if self.arch.gated else g

    def _mlp_all(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The MLP with its input (mlp_in) and down (down_in) columns thresholded, or dense."""
        lw = self.w.layers[i]
        t_in, t_down = self._thr(i, "mlp_in", x), self._thr(i, "down_in", x)
        if t_in is None and t_down is None:
            if self.ops["mlp"] != "triton":
                return self._mlp_torch(i, x)
            return fused_sparse_mlp(x, lw.w_in, lw.w_down_t, self._mlp_all,
                                    activation=self.w.activation, gated=self.arch.gated,
                                    b_in=lw.b_in, b_down=lw.b_down, validate=False)  # fmt: skip
        h = self._hidden(i, x, t_in)
        if t_down is None:
            return _mm(h, lw.w_down_t, lw.b_down)
        return threshold_gemv(h, lw.w_down_t, t_down, bias=lw.b_down)

    def _hidden(self, i: int, x: torch.Tensor, t_in) -> torch.Tensor:
        """The MLP's hidden activations of x (mlp_in thresholded by ``t_in``, or dense)."""
        lw = self.w.layers[i]
        if t_in is None:
            return self._act(lw.mlp_in(x))
        # one token: the activation runs in the GEMV's finalize launch
        return threshold_gemv_act(x, lw.w_in_t, t_in, activation=self.w.activation,
                                  gated=self.arch.gated, bias=lw.b_in)  # fmt: skip

    def _mlp_cats(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """CATS: dense gate, up/down rows of the neurons with |act(gate)| > thr only."""
        lw, thr = self.w.layers[i], self.site_thresholds[i].get("gate")
        if thr is None:
            return self._mlp_all(i, x)
        return cats_mlp(x, lw.w_in, lw.w_down_t, thr, activation=self.w.activation,
                        b_in=lw.b_in, b_down=lw.b_down)  # fmt: skip
