"""Decoding B = 1..32 sequences in lockstep, dense or contextually sparse (Deja Vu Appendix C.1).

:class:`BatchDecoder` is the batch-1 :class:`~dejavu_lab.engine.Decoder` (same weights layout,
kernels and CUDA-graph step; batch-aware blocks and sets, :mod:`~dejavu_lab.engine.batch_blocks`,
:mod:`~dejavu_lab.engine.batch_sets`) with one static KV-cache slot per sequence: a prompt of
any length starts at position 0 of its own slot, positions and lengths are per sequence, and no
padding token is ever attended. Prefill runs the batch-1 dense prefill on each slot; each decode
step embeds B tokens and runs every block on [B, d] rows.

Sparse decoding in a batch (Polar Sparsity, Shrestha et al. 2025, makes the same split):

- **MLP** — one kept set per layer and step, the union of the live sequences' top-k, capped
  by ``union_budget`` (:mod:`~dejavu_lab.engine.batch_sets`): MLP sparsity fades as the batch
  grows (chapter 35);
- **attention** — each sequence keeps its own heads: ``W_QKV`` and ``W_O`` read the union of
  the batch's heads, the attention kernel reads only the heads each sequence keeps from its own
  cache (``head_mask``), so the KV-cache reads, which dominate at large batches and long
  prompts, shrink with each sequence's own head sparsity whatever the batch.

Deferred KV (§4.2) needs the K/V of every token of the window recomputed for the kept heads
in each step; in a batch that is ``B x W`` rows, and the gather-GEMVs take at most 32, so the
window is ``W = min(kv_window, 32 // B)`` (4 or more, else no deferral): the heads outside the
batch's union write no K/V for ``W`` steps, then one dense K/V pass over the window fills them
for every sequence. From B = 16 (``kv_window=16``) every KV head is computed each step, as with
GQA models always.

TEAL, WINA and CATS run unchanged: their kernels threshold each row (token) on its own, 1-32 rows
per launch, and attention reads every head of each sequence's own cache.

Sequences that emit ``eos_token_id`` stop contributing: they leave the unions, their attention
reads nothing, and their later tokens are ``eos_token_id``. Next tokens are greedy or sampled
inside the CUDA graph (Gumbel-max on ``torch.rand``); one graph is captured per batch size.

>>> import torch
>>> from dejavu_lab.models import random_model
>>> m = random_model("tiny-llama").model
>>> dec = BatchDecoder(m, max_seq_len=16, max_batch=4)
>>> out = dec.generate([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], max_new_tokens=4)
>>> [o.shape[0] for o in out]  # each prompt + 4 new tokens
[7, 6]
"""

from __future__ import annotations

import contextlib

import torch

from ..checks import engine as check_engine
from .attention import every_head
from .batch_blocks import BatchAttention, BatchKeptHeads
from .batch_prompts import batch_prompts
from .batch_sets import BatchSets
from .config import EngineError, SparseConfig
from .decoder import Decoder, _norm
from .greedy import argmax_rows, sample_rows
from .int4 import is_int4
from .mlp import KeptMLP
from .weights import DecoderWeights

__all__ = ["MAX_BATCH", "BatchDecoder"]

MAX_BATCH = 32  # the decoding kernels take 1-32 rows (one union index set)


class BatchDecoder(Decoder):
    """Lockstep decoding of up to ``max_batch`` (<= 32) sequences of up to ``max_seq_len`` tokens.

    The batch-1 decoder's step, prefill and graphs with batch-aware blocks
    (:mod:`~dejavu_lab.engine.batch_blocks`) and, for DejaVu, batch-aware sets
    (:class:`~dejavu_lab.engine.batch_sets.BatchSets`). The arguments of
    :class:`~dejavu_lab.engine.Decoder`, plus ``max_batch`` (cache slots),
    ``union_budget`` (DejaVu: the largest fraction of MLP neurons a step's union reads; None:
    the whole union) and ``eos_token_id`` (None: every sequence runs ``max_new_tokens``).

    >>> import torch
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model
    >>> dec = BatchDecoder(m, max_seq_len=16, max_batch=2)
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])  # left-padded, HF-style
    >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    >>> out = dec.generate(ids, 3, attention_mask=mask)
    >>> hf = m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    >>> out.tolist() == hf.tolist()
    True
    """

    fuse_epilogues = False  # its blocks are batched (batch_blocks); the fused step is batch 1
    # dense batches run cuBLAS over the rows layout: over the columns through our kernels a
    # batch of 16 ran at 0.46x cuBLAS's tokens/s (1.07x at B = 1; Llama-3-8B, prompt 2048,
    # an H100, results/engine_batch_columns_h100.json)
    dense_columns = False

    def __init__(self, model, *, max_seq_len: int, max_batch: int = MAX_BATCH,
                 sparse: SparseConfig | None = None, predictors=None, arch=None,
                 dense_ops: str | dict | None = None, union_budget: float | None = None,
                 eos_token_id: int | None = None):  # fmt: skip
        self.max_batch = check_engine.size(
            max_batch, "max_batch", minimum=1, maximum=MAX_BATCH, hint="sequences decoded together"
        )
        if sparse is not None and sparse.fused:
            raise EngineError("fused=True runs batch 1 only; use SparseConfig(fused=False).")
        int4 = isinstance(model, DecoderWeights) and is_int4(model)
        if int4 and sparse is not None and sparse.method == "dejavu":
            raise EngineError("DejaVu on int4 weights runs batch 1 only; decode it with Decoder.")
        if isinstance(model, DecoderWeights) and model.prefill_masks:
            raise EngineError(
                "refit weights (fold_refit) run in the batch-1 Decoder only; use Decoder."
            )
        if sparse is not None and sparse.method == "rsparse":
            raise EngineError(
                "R-Sparse's low-rank terms run in the batch-1 Decoder only; use Decoder."
            )
        self._union_budget = union_budget  # read by _new_sets
        super().__init__(model, max_seq_len=max_seq_len, sparse=sparse, predictors=predictors,
                         arch=arch, dense_ops=dense_ops)  # fmt: skip
        bm, dev, T = self.max_batch, self.w.device, self.kv.shape[4]
        L, vocab = self.arch.n_layers, self.w.embed.shape[0]
        if eos_token_id is not None:
            eos_token_id = check_engine.size(eos_token_id, "eos_token_id", maximum=vocab - 1)
        self.eos = eos_token_id
        z = dict(dtype=torch.long, device=dev)
        self.tok_t, self.pos_t, self.base_t = (torch.zeros(bm, **z) for _ in range(3))  # [B]
        self.st.pos_t, self.st.base_t = self.pos_t, self.base_t
        self.tokens = torch.zeros(bm, T + 1, **z)  # [B, T + 1] each sequence's tokens
        self.step_t, self.wstart_t = torch.zeros(1, **z), torch.zeros(1, **z)
        self._eos_t = torch.tensor(eos_token_id or 0, **z)
        self.live_t = torch.ones(bm, dtype=torch.bool, device=dev)  # still generating
        self._live_f = torch.ones(bm, device=dev)
        self._live_heads = torch.ones(bm, self.H, dtype=torch.int8, device=dev)
        self._live_log = torch.zeros(self.max_seq_len + 1, dtype=torch.int32, device=dev)
        self._ar_b = torch.arange(bm, device=dev)
        self._temp_t = torch.ones(1, device=dev)
        self._gen = torch.Generator(device=dev) if dev.type == "cpu" else None
        self.kv_window = self.window  # at batch 1; self.W is the current batch's
        if self.window:  # deferred KV: window rows (b, r) at b * W + r, at most 32 of them
            self.st.hwin = torch.zeros(
                L, MAX_BATCH, self.arch.d_model, dtype=self.w.dtype, device=dev
            )
        self.B, self.W, self.lengths, self.n_steps, self.wstart = 0, 0, [], 0, 0
        self._sample, self._graphs = False, {}
        if self.sets is None and union_budget is not None:
            raise EngineError("union_budget caps DejaVu's MLP union; use method='dejavu'.")

    def _new_cache(self, t_alloc: int) -> torch.Tensor:
        """kv: [L, 2, B_max, Hkv, T, dh], one slot per sequence (zeros: never NaN)."""
        shape = (self.arch.n_layers, 2, self.max_batch, self.Hkv, t_alloc, self.dh)
        return torch.zeros(shape, dtype=self.w.dtype, device=self.w.device)

    def _new_sets(self, sparse: SparseConfig) -> BatchSets:
        """Each sequence's kept sets and the batch's unions (:mod:`~dejavu_lab.engine.batch_sets`)."""
        return BatchSets(self.arch, sparse, self.w.device, window=self.window,
                         predictors=self.predictors, max_batch=self.max_batch,
                         max_seq_len=self.max_seq_len, union_budget=self._union_budget)  # fmt: skip

    def _new_blocks(self) -> tuple[list, list]:
        """The batch-1 decoder's blocks, with each sequence's own heads and cache slots."""
        L, st, w = range(self.arch.n_layers), self.st, self.w
        t = self.site_thresholds  # every head (thresholded or not): the projections
        proj = [every_head(w.layers[i], self.kv[i], st, t[i]) for i in L]
        if self.sets is None:
            _, mlp = super()._new_blocks()
            return [BatchAttention(proj[i], self.kv[i], st) for i in L], mlp
        attn = [BatchKeptHeads(proj[i], self.kv[i], st, i, self.sets) for i in L]
        # a union holding every neuron runs the dense MLP (cuBLAS)
        mlp = [KeptMLP(w.layers[i], w, i, self.sets, fused=False, dense_when_full=True) for i in L]
        return attn, mlp

    def _window_for(self, B: int) -> int:
        """The deferred-KV window at batch size B: B x W rows fit one gather-GEMV (<= 32)."""
        return 0 if self.sets is None else self.sets.window_for(B)

    def _per_step(self) -> None:
        st, B, W = self.st, self.B, self.W
        pos = self.pos_t[:B]
        st.B, st.ar_b, st.live_heads = B, self._ar_b[:B], self._live_heads[:B]
        st.seqlen = pos + 1  # [B] tokens in each cache with this one
        self._live_heads[:B].copy_(self.live_t[:B, None].expand(B, self.H))
        if self._masked:  # [B, T] own positions only
            st.mask = torch.where(self.ar_t[None] <= pos[:, None], self._zero, self._ninf)
        if W:  # window row b * W + slot holds this step's input of sequence b
            st.rows = self._ar_b[:B] * W + (self.step_t - self.wstart_t)
            st.positions = (self.base_t[:B, None] + self.ar_w[None, :W]).reshape(-1)
        else:
            st.positions = pos

    def _flush(self) -> None:
        """Every KV head's K/V over the window of every sequence, then a new window (§4.2)."""
        B, W = self.B, self.W
        positions = (self.base_t[:B, None] + self.ar_w[None, :W]).reshape(-1)
        for attn in self.attn:
            attn.flush(B, W, positions)
        self.base_t[:B] += W
        self.wstart += W
        self.wstart_t.fill_(self.wstart)

    # ----------------------------------------------------------------------------- steps

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens [B]: argmax, or Gumbel-max sampling at temperature (no host sync)."""
        if not self._sample:
            return argmax_rows(logits)
        return sample_rows(logits, self._temp_t, self._gen)

    def _accept(self, nxt: torch.Tensor, at: torch.Tensor) -> None:
        """Record next tokens [B] at positions ``at``; a finished sequence emits eos only."""
        B = self.B
        if self.eos is not None:
            live = self.live_t[:B]
            nxt = torch.where(live, nxt, self._eos_t)
            live.logical_and_(nxt != self._eos_t)
            self._live_f[:B].copy_(live)
        self.tokens.index_put_((self._ar_b[:B], at), nxt)
        self.tok_t[:B].copy_(nxt)

    def _step_body(self) -> torch.Tensor:
        """One decode step of the batch on the static buffers (what the CUDA graph records)."""
        B = self.B
        self._live_log.index_copy_(0, self.step_t, self._live_f[:B].sum().int()[None])
        x = self._embed(self.tok_t[:B], self.pos_t[:B])  # [B, d]
        self._per_step()
        if self.sets is not None and self.predictors is None:
            self.sets.select()  # every layer's unions from the given sets, in a few launches
        logits = self._head(self._layers(x))  # [B, V]
        if self.sets is not None:
            self.sets.log_unions(self.step_t)
        self._accept(self._choose(logits), self.pos_t[:B] + 1)
        self.pos_t[:B].add_(1)
        self.step_t.add_(1)
        return logits

    def _prompts(self, prompts, attention_mask=None) -> list[torch.Tensor]:
        return batch_prompts(prompts, attention_mask, vocab=self.w.embed.shape[0],
                             max_batch=self.max_batch, max_seq_len=self.max_seq_len,
                             device=self.w.device)  # fmt: skip

    @contextlib.contextmanager
    def _slot(self, b: int):
        """The batch-1 prefill's buffers pointed at sequence b's slot while it runs."""
        saved = self.kv, self.tokens, self.tok_t, self.pos_t, self.base_t
        self.kv, self.tokens = saved[0][:, :, b], saved[1][b]
        self.tok_t, self.pos_t, self.base_t = (t[b : b + 1] for t in saved[2:])
        try:
            yield
        finally:
            self.kv, self.tokens, self.tok_t, self.pos_t, self.base_t = saved

    def _start(self, lengths: list[int]) -> None:
        B = self.B = len(lengths)
        self.W = self._window_for(B)
        if self.sets is not None:
            self.sets.start(B, self._live_f)
        self.lengths, self.n_steps, self.wstart, self.graph = list(lengths), 0, 0, None
        lens = torch.tensor(lengths, device=self.w.device)
        self.pos_t[:B], self.base_t[:B] = lens, lens
        self.step_t.zero_()
        self.wstart_t.zero_()
        self.live_t[:B] = True
        self._live_f[:B] = 1.0

    @torch.no_grad()
    def prefill(self, prompts, attention_mask=None) -> torch.Tensor:
        """Dense prefill of each prompt in its own cache slot; logits [B, V] of each last token.

        ``prompts``: a list of 1-D id tensors, or [B, S] ids (``attention_mask`` marks the real
        tokens, e.g. left padding). The first new token is chosen as the step chooses it."""
        rows = self._prompts(prompts, attention_mask)
        logits = []
        for b, ids in enumerate(rows):
            with self._slot(b):
                logits.append(Decoder.prefill(self, ids))
        self._start([r.numel() for r in rows])
        logits = torch.cat(logits)  # [B, V]
        if self.eos is not None:  # not yet generated: eos until written
            for b, r in enumerate(rows):
                self.tokens[b, r.numel() + 1 :] = self.eos
        self._accept(self._choose(logits), self.pos_t[: self.B])
        return logits

    @torch.no_grad()
    def copy_prefill(self, other: BatchDecoder, slots=None) -> None:
        """Start from ``other``'s fresh prefill of the same model (its weights in any dtype: an
        fp32 prefill is several times faster on a CPU): its cache slots ``slots`` (default: its
        whole batch) become this decoder's sequences 0, 1, ..., so several configurations decode
        from one prefill (quality comparisons, benchmarks).

        >>> import torch
        >>> from dejavu_lab.models import random_model
        >>> m = random_model("tiny-llama").model
        >>> batch = BatchDecoder(m, max_seq_len=16, max_batch=2)
        >>> _ = batch.prefill([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> alone = BatchDecoder(m, max_seq_len=16, max_batch=1)  # or sparse, or in bf16
        >>> alone.copy_prefill(batch, slots=[1])  # sequence 1 alone, no second prefill
        >>> alone.lengths, torch.allclose(alone.step()[0], batch.step()[1], atol=1e-5)
        ([2], True)
        """
        same = (other.arch.n_layers, other.Hkv, other.dh, other.w.embed.shape)
        if same != (self.arch.n_layers, self.Hkv, self.dh, self.w.embed.shape):
            raise EngineError(
                "copy_prefill needs a decoder of the same model (its layers, heads, vocabulary)."
            )
        if other.B == 0 or other.n_steps:
            raise EngineError("copy_prefill copies a fresh prefill; call other.prefill first.")
        slots = list(range(other.B)) if slots is None else [int(b) for b in slots]
        if not 1 <= len(slots) <= self.max_batch or not set(slots) <= set(range(other.B)):
            raise EngineError(
                f"slots must name 1 to {self.max_batch} of the other decoder's sequences "
                f"0..{other.B - 1}."
            )
        lengths = [other.lengths[b] for b in slots]
        if max(lengths) >= self.max_seq_len:
            raise EngineError(f"a prompt of {max(lengths)} tokens does not fit this cache.")
        T, B = max(lengths), len(slots)
        at = torch.tensor(slots, device=self.w.device)
        self.kv[:, :, :B, :, :T] = other.kv[:, :, at, :, :T].to(self.kv.dtype)
        self.tokens[:B, : T + 1] = other.tokens[at, : T + 1]
        if self.eos is not None:
            for b, n in enumerate(lengths):
                self.tokens[b, n + 1 :] = self.eos
        self._start(lengths)
        self._accept(other.tokens[at, torch.tensor(lengths, device=at.device)], self.pos_t[:B])

    def rewind(self, lengths, *, unchecked: bool = False) -> None:
        """Decode again from the first ``lengths[b]`` tokens of slot b, whose keys and values
        are in the cache (prompt tokens or flushed ones), choosing the batch size: what a
        benchmark times at several batch sizes from one prefill. ``unchecked=True`` (timing
        only) starts there whatever the cache holds: a step reads the same bytes either way.

        >>> import torch
        >>> from dejavu_lab.models import random_model
        >>> dec = BatchDecoder(random_model("tiny-llama").model, max_seq_len=16, max_batch=2)
        >>> _ = dec.prefill([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])])
        >>> first = dec.step().argmax(-1)
        >>> dec.rewind([4, 3])  # back to the end of both prompts
        >>> torch.equal(dec.step().argmax(-1), first)
        True
        """
        lengths = [check_engine.size(n, "lengths[b]", minimum=1) for n in lengths]
        if not 1 <= len(lengths) <= self.max_batch:
            raise EngineError(f"rewind takes 1 to {self.max_batch} lengths, got {len(lengths)}.")
        if max(lengths) >= self.max_seq_len:
            raise EngineError(f"lengths must be below the cache's {self.max_seq_len} tokens.")
        known = [n + (self.wstart if self.W else self.n_steps) for n in self.lengths]
        for b, n in enumerate(lengths):
            if not unchecked and (b >= len(known) or n > known[b]):
                have = known[b] if b < len(known) else 0
                raise EngineError(
                    f"slot {b} holds {have} tokens with their keys and values, not {n}; prefill first."
                )
        toks = [int(self.tokens[b, n]) for b, n in enumerate(lengths)]
        self._start(lengths)
        self.tok_t[: self.B] = torch.tensor(toks, device=self.w.device)

    def _before_step(self) -> None:
        if self.B == 0:
            raise EngineError("call prefill(prompts) before stepping.")
        if max(self.lengths) + self.n_steps >= self.max_seq_len:
            raise EngineError(f"the cache is full ({self.max_seq_len} tokens); build a larger one.")
        if self.W and self.n_steps - self.wstart >= self.W:
            self._flush()

    @torch.no_grad()
    def step(self, tokens=None) -> torch.Tensor:
        """Decode one token per sequence (default: the ones chosen last; ``tokens`` [B] feeds
        given ones, e.g. teacher forcing); logits [B, V]."""
        self._before_step()
        if tokens is not None:
            t = torch.as_tensor(tokens).reshape(-1)
            if t.numel() != self.B or t.dtype.is_floating_point:
                raise EngineError(f"step takes one integer token per sequence ({self.B}).")
            vocab = self.w.embed.shape[0]
            if int(t.min()) < 0 or int(t.max()) >= vocab:
                raise EngineError(f"tokens must lie in [0, {vocab - 1}].")
            self.tok_t[: self.B] = t.to(self.w.device)
        logits = self._replay() if self.graph is not None else self._step_body()
        self._advance()
        return logits

    def _steps_left(self) -> float:
        """Steps before the longest sequence fills its cache slot (no batch: no limit here)."""
        if not self.B:
            return float("inf")
        return self.max_seq_len - max(self.lengths) - self.n_steps

    def _advance(self) -> None:
        self.n_steps += 1

    @torch.no_grad()
    def capture(self) -> None:
        """Record the decode step of the current batch size in a CUDA graph (one per size)."""
        if not (self.w.device.type == "cuda" and torch.cuda.is_available()):
            raise EngineError("CUDA graph capture needs the model on a GPU; on CPU call step().")
        if self.B == 0:
            raise EngineError("call prefill(prompts) before capture().")
        key = (self.B, self._sample)
        if key not in self._graphs:
            self._side_stream()
            state = (self.tok_t, self.pos_t, self.step_t, self.live_t, self._live_f, self.tokens)
            saved = [t.clone() for t in state]
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):  # compile the kernels, create cuBLAS handles
                for _ in range(2):
                    self._step_body()
                    for t, s in zip(state, saved, strict=True):
                        t.copy_(s)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._step_body()
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)
            self._graphs[key] = (graph, logits)
        self.graph, self._graph_logits = self._graphs[key]

    def _seed(self, seed: int | None) -> None:
        if seed is None:
            return
        if self._gen is not None:
            self._gen.manual_seed(seed)
        else:  # CUDA graphs replay the default generator's philox state
            torch.cuda.manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, *, attention_mask=None,
                 do_sample: bool = False, temperature: float = 1.0, seed: int | None = None,
                 graph: bool | None = None):  # fmt: skip
        """Continue every prompt by ``max_new_tokens`` (greedy, or sampled at ``temperature``
        with ``seed``): a list of 1-D tensors (prompt + new) for a list of prompts, [B, S + new]
        (HF ``generate``'s layout) for [B, S] ids."""
        rows = self._prompts(prompts, attention_mask)
        n = check_engine.size(max_new_tokens, "max_new_tokens", minimum=1)
        longest = max(r.numel() for r in rows)
        if longest + n > self.max_seq_len:
            raise EngineError(
                f"prompt {longest} + {n} new tokens exceed the cache's {self.max_seq_len}."
            )
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise EngineError(f"temperature={temperature!r} must be a number > 0.")
        self._sample = bool(do_sample)
        self._temp_t.fill_(float(temperature))
        try:
            self._seed(seed)
            self.prefill(rows)
            use_graph = self.w.device.type == "cuda" if graph is None else graph
            if use_graph:
                self.capture()
            self._seed(None if seed is None else seed + 1)
            done = 0
            while done < n - 1:  # stop early once every sequence has finished (one sync / 16)
                chunk = min(16, n - 1 - done)
                self.decode(chunk)
                done += chunk
                if self.eos is not None and not bool(self.live_t[: self.B].any()):
                    break
        finally:
            self._sample = False
        new = torch.stack([self.tokens[b, r.numel() : r.numel() + n] for b, r in enumerate(rows)])
        if isinstance(prompts, torch.Tensor):
            ids = prompts if prompts.dim() == 2 else prompts[None]
            return torch.cat((ids, new.to(ids.device)), 1)
        return [torch.cat((r, t)) for r, t in zip(rows, new, strict=True)]

    def union_sizes(self):
        """The realised union per layer and decode step since the last prefill, one row (dict)
        each (:meth:`~dejavu_lab.engine.batch_sets.BatchSets.union_sizes`)."""
        if self.sets is None:
            raise EngineError("union sizes are recorded for DejaVu's kept sets (method='dejavu').")
        if self.B == 0:
            raise EngineError("call prefill(prompts) and decode before reading union sizes.")
        return self.sets.union_sizes(self.n_steps, self._live_log)

    def parts(self) -> dict:
        """Zero-argument callables running one part of a decode step over every layer at the
        current batch size, for timing by :mod:`dejavu_lab.bench.engine` (``--batch``)."""
        L, attn, mlp, B = self.arch.n_layers, self.attn, self.mlp, self.B
        if self.W and self.n_steps - self.wstart >= self.W:
            self._flush()  # the window is full: a step would flush first (its rows are [0, W))
        x = torch.randn(B, self.arch.d_model, dtype=self.w.dtype, device=self.w.device)

        def run_attn():
            self._per_step()
            for i in range(L):
                attn[i](_norm(x, self.w.layers[i].ln_attn, self.w.norm))

        out = {"attention": run_attn, "lm_head": lambda: self._head(x),
               "mlp": lambda: [mlp[i](_norm(x, self.w.layers[i].ln_mlp, self.w.norm))
                               for i in range(L)]}  # fmt: skip
        if self.sets is not None:
            out["unions"] = (lambda: [self.sets.predict(i, x) for i in range(L)]) if (
                self.predictors is not None) else self.sets.select  # fmt: skip
        return out
