"""A batch-1 decoder with a static KV cache, dense or contextually sparse (Deja Vu §4.3–4.4, §5.1).

Built from a Hugging Face OPT or Llama-family model's weights (:mod:`dejavu_lab.engine.weights`
lays them out once: fused QKV, ``W_O`` and ``W2`` transposed). The decoder owns what every
method shares: the embedding, the norms (:func:`dejavu_lab.kernels.row_norm`), the residual
stream, the KV cache, ``lm_head``, the dense prefill, the decode step and its CUDA graph (the
calls that run them, from :meth:`~dejavu_lab.engine.decode_loop.DecodeLoop.prefill` to
:meth:`~dejavu_lab.engine.decode_loop.DecodeLoop.generate`, are its base class
:class:`~dejavu_lab.engine.decode_loop.DecodeLoop`). Each layer's attention and MLP are block
objects chosen once at construction (gpt-fast's Transformer / Attention / FeedForward split, the
sparse variants as siblings):

- dense: :class:`~dejavu_lab.engine.attention.DenseAttention`,
  :class:`~dejavu_lab.engine.mlp.DenseMLP` (cuBLAS, or our kernels at 100% kept);
- DejaVu: :class:`~dejavu_lab.engine.kept_heads.KeptHeads`, :class:`~dejavu_lab.engine.mlp.KeptMLP`
  (the Triton gather-GEMVs over the kept heads' rows of ``W_QKV`` / ``W_O^T`` and the kept
  neurons, the attention kernel over the kept heads' cache only), their sets in
  :class:`~dejavu_lab.engine.sets.KeptSets`;
- TEAL / WINA: :class:`~dejavu_lab.engine.attention.ThresholdAttention`,
  :class:`~dejavu_lab.engine.mlp.ThresholdMLP`; CATS: :class:`~dejavu_lab.engine.mlp.CatsMLP`;
- LaRoSA: TEAL's blocks over weights with its rotation of attention's output folded in;
  R-Sparse: :class:`~dejavu_lab.engine.lowrank.LowRankAttention`,
  :class:`~dejavu_lab.engine.lowrank.LowRankMLP` (TEAL's plus a low-rank term), from their plans
  (:mod:`~dejavu_lab.engine.plans`).

The kept sets of layer ``l + 1`` are chosen by DejaVu's low-rank predictors from layer ``l``'s
input (lookahead, §4.3) — on a second CUDA stream, so they leave the critical path — or set
by hand (:meth:`Decoder.set_indices`: oracle or random sets, for timing). Skipped heads write no
K/V (§4.2): the attention input of the last ``kv_window`` tokens is kept per layer, a kept
head recomputes its K/V over that window in the same weight pass (a union batch, Appendix C.1), and
every ``kv_window`` tokens one dense K/V pass over the window fills every head — memory stays
``n_layers x kv_window x d``. The whole step, predictors too, is one CUDA graph (gpt-fast's way).

>>> from dejavu_lab.models import random_model
>>> m = random_model("tiny-llama").model
>>> Decoder(m, max_seq_len=16).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape
torch.Size([1, 7])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import engine as check_engine
from ..kernels import row_norm, use_triton
from ..quant import Int4Weight
from .attention import StepState, every_head
from .config import PLANNED, EngineError, SparseConfig, default_ops, dense_layout
from .config import dense_ops as resolve_ops
from .decode_loop import DecodeLoop
from .fused_step import fused_layers
from .greedy import argmax_rows
from .int4 import check_int4_layout, is_int4, quantize_head, quantize_weights
from .int4_sparse import int4_blocks
from .kept_heads import KeptHeads
from .lookahead import Lookahead
from .lowrank import LowRank, LowRankAttention, LowRankMLP
from .mlp import KeptMLP, mlp_block
from .plans import check_factors, fold_rotations, plan_parts
from .sets import KeptSets
from .site_thresholds import keep_sites, layer_thresholds
from .weights import DecoderWeights, check_layout, decoder_weights, layout_for, linear_t

__all__ = ["Decoder"]


def _norm(x: torch.Tensor, p: tuple, kind: str) -> torch.Tensor:
    w, b, eps = p  # one program per row: torch's kernel takes ~15 us for one row on an H200
    return row_norm(x, w, b if kind == "layer" else None, eps=eps, kind=kind)


class Decoder(DecodeLoop):
    """Greedy batch-1 decoding of one sequence of up to ``max_seq_len`` tokens.

    ``model`` is a HF model or the :class:`DecoderWeights` of one (to share them between
    decoders; TEAL and WINA need its ``"columns"`` layout, see :func:`decoder_weights`).
    ``sparse=None`` runs the dense path; a :class:`SparseConfig` runs its method's kernels (fp16
    or bf16 weights). ``predictors`` (DejaVu) is any object with ``mlp_scores(layer, x)`` and
    ``head_scores(layer, x)`` returning [1, n] scores (``dejavu_lab.predictors.Predictors``,
    lookahead mode); without it the kept sets are the ones given to :meth:`set_indices`
    (default: the first k units). ``dense_ops`` picks, per dense op (``qkv``, ``attn``, ``o``,
    ``mlp``), torch (cuBLAS) or our kernels at 100% kept: ``"torch"``, ``"triton"`` or e.g.
    ``"qkv=triton,mlp=triton"`` (:func:`~dejavu_lab.engine.config.dense_ops`). The
    default (``None``) on a GPU with fp16/bf16 weights: a dense decoder built from a HF model
    stores the ``"columns"`` layout and runs every op through our kernels (the threshold GEMVs
    with every column kept and our attention core: the fastest batch-1 dense step measured,
    ``dense_columns`` in ``results/engine_methods.json``; ``dense_ops="torch"`` keeps the rows
    layout and cuBLAS); over given rows-layout weights, the attention core through our kernel
    and cuBLAS for the rest; on the CPU every op through torch. One-token steps of a pre-LN
    model finish each block in its residual add + norm (:mod:`~dejavu_lab.engine.fused_step`),
    DejaVu's included. ``weights="int4"`` quantises the layer matrices to group-wise int4 (``group``
    input channels per scale and min, laid out for the method) and runs every method's step over
    them (:mod:`~dejavu_lab.engine.int4`, :mod:`~dejavu_lab.engine.int4_sparse`); ``head="int4"``
    rounds ``lm_head`` too (:func:`~dejavu_lab.engine.int4.quantize_head`). Its parts: ``attn[i]`` and ``mlp[i]`` (layer i's blocks), ``sets``
    (DejaVu's kept sets, else None), ``st`` (what every block of a step reads).

    DejaVu on a GPU: the first :meth:`capture` times the step with each way the engine has to
    run it (the kept sets by ``torch.topk`` or our select kernel, the down projections by the
    split or the one-tile kernel; which is faster depends on the shape) and keeps the fastest;
    ``kernel_choice`` holds the timings (``SparseConfig(tune_kernels=False)``: the defaults).
    A model too large to be held twice: build ``decoder_weights(model, release=True)`` first.

    LaRoSA and R-Sparse (``SparseConfig(method="larosa" or "rsparse", plan=...)``) run their
    plan's thresholds through TEAL's kernels: LaRoSA over a copy of the weights with its
    rotation folded in (``model`` is left as it was), R-Sparse with a low-rank term per site
    (``lowrank_bytes``: what its factors add to a step).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model
    >>> dec, ids = Decoder(m, max_seq_len=16), torch.tensor([[5, 6, 7]])
    >>> torch.allclose(dec.prefill(ids), m(ids).logits[:, -1], atol=1e-4)  # last prompt position
    True
    >>> dec.generate(ids, 5).tolist() == m.generate(ids, max_new_tokens=5, do_sample=False).tolist()
    True

    """

    fuse_epilogues = True  # the fused step where it applies (False: the plain step)
    dense_columns = True  # GPU: the columns layout with every dense op through our kernels
    fuse_hidden = True  # the down GEMV finishes the gate/up sums (False: their own launch)

    def __init__(self, model, *, max_seq_len: int, sparse: SparseConfig | None = None,
                 predictors=None, arch=None, dense_ops: str | dict | None = None,
                 weights: str | None = None, group: int = 128, head: str | None = None):  # fmt: skip
        method = "dense" if sparse is None else sparse.method
        self.method = method  # one of engine.METHODS
        if weights not in (None, "int4"):
            raise EngineError(f"weights={weights!r} must be None (as loaded) or 'int4'.")
        if head not in (None, "int4"):
            raise EngineError(f"head={head!r} must be None (lm_head as loaded) or 'int4'.")
        int4 = weights == "int4" or (isinstance(model, DecoderWeights) and is_int4(model))
        if int4 and method in PLANNED:
            raise EngineError(
                f"the int4 engine runs dense, TEAL, WINA, CATS and DejaVu steps; {method}'s "
                "rotations or low-rank factors over int4 weights are not built yet."
            )
        # a DecoderWeights is shared as is (dense and sparse decoders over one copy)
        if isinstance(model, DecoderWeights):
            self.w = model
        else:
            rows = weights != "int4" or method in ("dejavu", "cats")
            layout = layout_for(method) if rows else "columns"
            if method == "dense" and rows and dense_ops is None and self.dense_columns:
                p = next(model.parameters())  # the fastest one-token dense step (GPU)
                layout = dense_layout(p.device, p.dtype)
            try:
                self.w = decoder_weights(model, arch, layout=layout)
            except torch.cuda.OutOfMemoryError as exc:
                raise EngineError(
                    "the engine's copies of the projections do not fit beside the model's own on "
                    f"{next(model.parameters()).device}; pass decoder_weights(model, release=True), "
                    "which frees the model's as it copies them (the model then no longer runs)."
                ) from exc
        # LaRoSA, R-Sparse: the plan's thresholds, rotations (folded into a copy) and factors
        given = (sparse.thresholds or {}) if sparse is not None else {}
        self.factors: dict = {}
        if method in PLANNED:
            rotations, self.factors = sparse.rotations or {}, sparse.factors or {}
            if sparse.plan is not None:
                hf = None if isinstance(model, DecoderWeights) else model
                given, rotations, self.factors = plan_parts(sparse.plan, self.w, hf)
            check_factors(self.factors, self.w.arch)
            if rotations:
                self.w = fold_rotations(self.w, rotations)
        if int4 and not is_int4(self.w):  # the layer matrices in int4, laid out for the method
            self.w = quantize_weights(self.w, group, method)  # (int4 weights: shared as they are)
        if head == "int4":
            if not int4:
                raise EngineError("head='int4' rounds lm_head beside int4 layer matrices; pass "
                                  "weights='int4' too.")  # fmt: skip
            self.w = quantize_head(self.w, group)
        self.int4 = int4
        columns = not int4 and self.w.layout == "columns"
        self.ops = resolve_ops(dense_ops if dense_ops is not None else
                               default_ops(self.w, columns=columns and self.dense_columns))  # fmt: skip
        a = self.arch = self.w.arch
        self.sparse = sparse
        self.predictors = predictors
        kernels = method != "dense" or "triton" in self.ops.values()
        if kernels and self.w.dtype not in (torch.float16, torch.bfloat16):
            raise EngineError(
                f"the {method} path runs the fp16/bf16 kernels but the weights are "
                f"{self.w.dtype}; load the model with dtype=torch.float16 (or bfloat16)."
            )
        if int4:
            check_int4_layout(self.w, method, sparse)
        else:
            check_layout(self.w, method, given)
        self.thresholds = given  # {(layer, site): float or fp32 [d_in]}: what the sites run
        if predictors is not None and getattr(predictors, "mode", "lookahead") != "lookahead":
            raise EngineError(
                "the engine runs lookahead predictors (§4.3); train mode='lookahead'."
            )
        if predictors is not None and method != "dejavu":
            raise EngineError(
                "predictors choose DejaVu's kept sets; pass sparse=SparseConfig(method='dejavu', ...)."
            )
        max_seq_len = check_engine.size(max_seq_len, "max_seq_len", minimum=2)  # whole tokens
        if max_seq_len > self.w.max_positions:
            raise EngineError(
                f"max_seq_len={max_seq_len} exceeds the model's {self.w.max_positions} positions."
            )
        self.max_seq_len = int(max_seq_len)
        dev, dt = self.w.device, self.w.dtype
        self.H, self.Hkv, self.dh = a.n_heads, a.n_kv_heads, a.d_head
        # deferred KV needs one KV head per query head; GQA computes all (few) KV heads instead
        mha = self.H == self.Hkv
        dejavu_heads = method == "dejavu" and sparse.head_sparsity > 0
        self.window = sparse.kv_window if (dejavu_heads and mha) else 0
        t_alloc = self.max_seq_len + max(self.window, 1)
        self.kv = self._new_cache(t_alloc)  # [L, 2, Hkv, T, dh]
        self.ar_t = torch.arange(t_alloc, device=dev)
        self.ar_w = torch.arange(max(self.window, 1), device=dev)
        self.pos_t = torch.zeros(1, dtype=torch.long, device=dev)  # position of the token fed
        self.base_t = torch.zeros(1, dtype=torch.long, device=dev)  # first deferred position
        self.tok_t = torch.zeros(1, dtype=torch.long, device=dev)  # the token fed next
        self.tokens = torch.zeros(t_alloc + 1, dtype=torch.long, device=dev)  # greedy output
        self._ninf = torch.tensor(float("-inf"), dtype=dt, device=dev)
        self._zero = torch.tensor(0.0, dtype=dt, device=dev)
        self.cos = self.sin = None
        if self.w.rotary is not None:
            pos = self.ar_t[None]
            probe = torch.zeros(1, dtype=torch.float32, device=dev)
            cos, sin = self.w.rotary(probe, pos)
            self.cos, self.sin = cos[0].to(dt), sin[0].to(dt)  # [T, dh]
        self.pos = 0  # host copy of pos_t
        self.base = 0
        self.graph = None
        self.kernel_choice = None  # the first capture's timed choice (DecodeLoop._time_choices)
        self._side = None
        self._taps = None  # a callable (layer, site, tensor) the prefill reports to (calibration)
        self.st = StepState(a, dev, cos=self.cos, sin=self.sin, ops=self.ops, window=self.window)
        self.st.pos_t, self.st.base_t = self.pos_t, self.base_t
        # PyTorch's attention masks the cache; our kernel reads positions < seqlen
        self._masked = method != "dejavu" and self.ops["attn"] == "torch"
        # the one-token step finishing each block in its residual add + norm (module doc)
        self._fusable_blocks = a.pre_ln and self.w.dtype in (torch.float16, torch.bfloat16)
        # per layer, each site's Threshold or None (-1 where a dense op runs their kernels)
        keep = keep_sites(self.ops, rows=self.w.layers[0].w_qkv is not None)
        self.site_thresholds = layer_thresholds(given, a, dev, keep)
        self.sets = None
        if method == "dejavu":
            self.sets = self._new_sets(sparse)
            self.k_mlp, self.k_heads = self.sets.k_mlp, self.sets.k_heads
        self.attn, self.mlp = self._new_blocks()

    def _new_cache(self, t_alloc: int) -> torch.Tensor:
        """The static KV cache [L, 2, Hkv, T, dh] (zeros: never NaN, even where deferred); a
        batched decoder (:mod:`~dejavu_lab.engine.batch`) allocates one slot per sequence."""
        shape = (self.arch.n_layers, 2, self.Hkv, t_alloc, self.dh)
        return torch.zeros(shape, dtype=self.w.dtype, device=self.w.device)

    def _kernel_choices(self) -> list[dict]:
        """DejaVu on a GPU: the kept sets by torch.topk or our select kernel (with predictors),
        the down projections by the split or the one-tile kernel. Which is faster depends on
        the shape: on an H100 both alternatives lose at OPT-13B and both win at OPT-30B
        (results/engine_dejavu_down.json, engine_dejavu_opt30b.json), so the first capture
        times each pair (``SparseConfig.tune_kernels``)."""
        sp = self.sparse
        if self.sets is None or sp is None or not sp.tune_kernels:
            return []
        topk = (False, True) if self.predictors is not None else (self.sets.topk_kernel,)
        down = (self.sets.down_mode,) if self.int4 else ("split", "tile")  # int4: its own GEMVs
        return [{"topk_kernel": t, "down_mode": d} for t in topk for d in down]

    def _apply_choice(self, choice: dict) -> None:
        self.sets.topk_kernel, self.sets.down_mode = choice["topk_kernel"], choice["down_mode"]

    def _new_sets(self, sparse: SparseConfig) -> KeptSets:
        """DejaVu's kept sets (a tensor-parallel rank cuts its predictors to its own units)."""
        return KeptSets(
            self.arch, sparse, self.w.device, window=self.window, predictors=self.predictors
        )

    def _new_blocks(self) -> tuple[list, list]:
        """Each layer's attention and MLP blocks, chosen once for the method (see
        :mod:`~dejavu_lab.engine.attention`, :mod:`~dejavu_lab.engine.mlp`)."""
        w, L = self.w, range(self.arch.n_layers)
        if self.int4:
            return int4_blocks(w, self.kv, self.st, self.site_thresholds, method=self.method,
                               sets=self.sets)  # fmt: skip
        if self.sets is not None:  # DejaVu
            fused = self.sparse.fused
            attn = [
                KeptHeads(w.layers[i], self.kv[i], self.st, i, self.sets, fused=fused) for i in L
            ]
            return attn, [KeptMLP(w.layers[i], w, i, self.sets, fused=fused) for i in L]
        every = torch.arange(self.arch.d_mlp, device=w.device, dtype=torch.int32)  # all layers'
        cats, triton, t = self.method == "cats", self.ops["mlp"] == "triton", self.site_thresholds
        mlp = [mlp_block(w.layers[i], w, t[i], cats=cats, triton=triton, every=every) for i in L]
        attn = [every_head(w.layers[i], self.kv[i], self.st, t[i]) for i in L]
        for i in L:  # R-Sparse: a layer with a low-rank term
            lr = {s: LowRank(*self.factors[(i, s)], t[i][s], w.dtype)
                  for s in ("attn_in", "o_in", "mlp_in", "down_in") if (i, s) in self.factors}  # fmt: skip
            if lr.get("attn_in") or lr.get("o_in"):
                attn[i] = LowRankAttention(w.layers[i], self.kv[i], self.st, t[i]["attn_in"],
                                           t[i]["o_in"], lr.get("attn_in"), lr.get("o_in"))  # fmt: skip
            if lr.get("mlp_in") or lr.get("down_in"):
                mlp[i] = LowRankMLP(w.layers[i], w, t[i]["mlp_in"], t[i]["down_in"],
                                    lr.get("mlp_in"), lr.get("down_in"))  # fmt: skip
        return attn, mlp

    @property
    def lowrank_bytes(self) -> int:
        """Bytes R-Sparse's low-rank terms read per step (0 for the other methods)."""
        return sum(lr.nbytes for b in (*self.attn, *self.mlp)
                   for lr in (getattr(b, n, None) for n in ("lr_in", "lr_o", "lr_down"))
                   if lr is not None)  # fmt: skip

    def set_indices(self, layer: int, *, mlp=None, heads=None) -> None:
        """Fix the kept neurons / heads of ``layer`` (used when no predictors are given)."""
        if self.sets is None:
            raise EngineError(
                "set_indices fixes DejaVu's kept sets; pass sparse=SparseConfig(method='dejavu', ...)."
            )
        self.sets.set_indices(layer, mlp=mlp, heads=heads)

    # ----------------------------------------------------------------------------- the blocks

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.w.embed)  # [S, d_embed]
        if self.w.project_in is not None:
            x = F.linear(x, self.w.project_in)
        if self.w.pos_embed is not None:
            x = x + F.embedding(pos + self.w.pos_offset, self.w.pos_embed)
        return x  # [S, d]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.w.final_norm is not None:
            x = _norm(x, self.w.final_norm, self.w.norm)
        if self.w.project_out is not None:
            x = F.linear(x, self.w.project_out)
        if isinstance(self.w.lm_head, Int4Weight):  # head="int4": the int4 GEMV (or dequantised)
            return linear_t(x, self.w.lm_head, None)
        return F.linear(x, self.w.lm_head)  # [S, V]

    def _block(self, i: int, x: torch.Tensor, attn, mlp) -> torch.Tensor:
        """Layer i on the residual stream x [S, d]; ``attn`` and ``mlp`` map a normed [S, d]."""
        lw, kind, r = self.w.layers[i], self.w.norm, self._reduce
        if self.arch.pre_ln:
            h = x + r(attn(_norm(x, lw.ln_attn, kind)))
            return h + r(mlp(_norm(h, lw.ln_mlp, kind)))
        h = _norm(x + r(attn(x)), lw.ln_attn, kind)  # post-LN (OPT-350m)
        return _norm(h + r(mlp(h)), lw.ln_mlp, kind)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """A block's output [S, d] as the residual stream adds it: itself here (all-reduced
        over the ranks in :mod:`dejavu_lab.engine.tp`)."""
        return t

    def _per_step(self) -> None:
        """Tensors every layer of this step shares, computed once: mask or length, positions."""
        st = self.st
        if self._masked:  # torch masks the cache
            st.mask = torch.where(self.ar_t <= self.pos_t, self._zero, self._ninf)  # [T]
        else:  # our attention kernel reads positions < seqlen
            st.seqlen = self.pos_t + 1  # [1] tokens in the cache with this one
        if self.window:
            st.slot = self.pos_t - self.base_t  # [1] row of this token in the window
        # [B]: the position of each projected token (the window's rows, or this token)
        st.positions = self.base_t + self.ar_w if self.window else self.pos_t

    def _flush(self) -> None:
        """Dense K/V of every head for the window's tokens, then open a new window (§4.2)."""
        blocks = None
        positions = self.base_t + self.ar_w  # the window's rows at their positions
        if self.sparse.fused:  # every K/V block
            blocks = torch.arange(self.H, self.H + 2 * self.Hkv, device=self.w.device)
        for attn in self.attn:
            attn.flush(self.base, blocks, positions)
        self.base += self.window
        self.base_t.fill_(self.base)

    # ----------------------------------------------------------------------------- steps

    def _step_body(self) -> torch.Tensor:
        """One greedy decode step on the static buffers (what the CUDA graph records)."""
        x = self._embed(self.tok_t, self.pos_t)  # [1, d]
        self._per_step()
        logits = self._head(self._layers(x))  # [1, V]
        nxt = argmax_rows(logits)  # two-stage: one block's reduction over V is slow
        self.tokens.index_copy_(0, self.pos_t + 1, nxt)
        self.tok_t.copy_(nxt)
        self.pos_t.add_(1)
        return logits

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        """Every block of a decode step on x [B, d], the lookahead predictors of layer i + 1
        on the side stream while layer i computes (a batched decoder shares this loop)."""
        look = self._lookahead(x)
        if self._fusable(x):  # one token: each block finished in its residual add + norm
            return fused_layers(x, self.w, self.attn, self.mlp, fuse_hidden=self.fuse_hidden,
                                lookahead=look)  # fmt: skip
        for i in range(self.arch.n_layers):
            if look is not None:
                look.before(i, x)
            x = self._block(i, x, self.attn[i], self.mlp[i])
            if look is not None:
                look.after()
        return x

    def _lookahead(self, x: torch.Tensor) -> Lookahead | None:
        """DejaVu's predictors around this step's layers, layer 0's sets predicted (or None)."""
        if self.predictors is None:
            return None
        side = self._side if (x.is_cuda and self.sparse.side_stream) else None
        look = Lookahead(self.sets.predict, self.arch.n_layers, side)
        look.start(x)
        return look

    def _fusable(self, x: torch.Tensor) -> bool:
        return (self.fuse_epilogues and self._fusable_blocks and x.shape[0] == 1
                and use_triton(x.device))  # fmt: skip

    # ----------------------------------------------------------------------------- profiling

    def parts(self) -> dict:
        """Zero-argument callables running one part of a decode step over every layer, for
        timing by :mod:`dejavu_lab.bench.engine` (each replays on the current static buffers)."""
        L, attn, mlp = self.arch.n_layers, self.attn, self.mlp
        x = torch.randn(1, self.arch.d_model, dtype=self.w.dtype, device=self.w.device)

        def run_attn():
            self._per_step()
            for i in range(L):
                attn[i](_norm(x, self.w.layers[i].ln_attn, self.w.norm))

        def run_mlp():
            for i in range(L):
                mlp[i](_norm(x, self.w.layers[i].ln_mlp, self.w.norm))

        out = {"attention": run_attn, "mlp": run_mlp, "lm_head": lambda: self._head(x)}
        if self.predictors is not None:
            out["predictors"] = lambda: [self.sets.predict(i, x) for i in range(L)]
        return out
