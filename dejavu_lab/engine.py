"""A batch-1 decoder with a static KV cache, dense or contextually sparse (Deja Vu §4.3–4.4, §5.1).

Built from a Hugging Face OPT or Llama-family model's weights (:mod:`dejavu_lab.engine_weights`
lays them out once: fused QKV, ``W_O`` and ``W2`` transposed). Dense and sparse decoding share
the embedding, the norms (:func:`dejavu_lab.kernels.row_norm`), residual stream, KV cache and
``lm_head``; only the block internals differ:

- dense: cuBLAS GEMVs over every row, attention over every head in PyTorch;
- sparse: the Triton gather-GEMVs of :mod:`dejavu_lab.kernels` over the kept neurons (MLP) and
  the kept heads' rows of ``W_QKV`` / ``W_O^T``, and the attention kernel
  (:func:`dejavu_lab.kernels.sparse_attention_core`) over the kept heads' cache only.

The kept sets of layer ``l + 1`` are chosen by DejaVu's low-rank predictors from layer ``l``'s
input (lookahead, Knowl 2) — on a second CUDA stream, so they leave the critical path — or set
by hand (:meth:`Decoder.set_indices`: oracle or random sets, for timing). Skipped heads write no
K/V (Knowl 5): the attention input of the last ``kv_window`` tokens is kept per layer, a kept
head recomputes its K/V over that window in the same weight pass (a union batch, Knowl 12), and
every ``kv_window`` tokens one dense K/V pass over the window fills every head — memory stays
``n_layers x kv_window x d``. The whole decode step (predictors included) is captured in one
CUDA graph (:meth:`Decoder.capture`), as gpt-fast does, so launch overhead stays small.

>>> from dejavu_lab.models import random_model
>>> m = random_model("tiny-llama").model
>>> dec = Decoder(m, max_seq_len=16)
>>> dec.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape
torch.Size([1, 7])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checks import engine as check_engine
from .engine_sets import KeptSets
from .engine_weights import DecoderWeights, EngineError, decoder_weights
from .kernels import (
    kv_window_write,
    row_norm,
    sparse_attention_core,
    sparse_mlp_down,
    sparse_mlp_up,
)
from .sparsify import budgets

__all__ = ["Decoder", "EngineError", "SparseConfig"]


@dataclass(frozen=True)
class SparseConfig:
    """What the sparse path keeps per token (sparsity = fraction removed, as in the paper).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 256 neurons, 4 heads
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> dec.k_mlp, dec.k_heads, dec.window  # kept per token; deferred-KV window
    (64, 2, 16)
    >>> dec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).shape  # the sparse kernels
    torch.Size([1, 6])
    """

    mlp_sparsity: float = 0.0  # MLP neurons removed (OPT-175B in §5.1: 0.85)
    head_sparsity: float = 0.0  # query heads removed (§5.1: 0.5)
    kv_window: int = 16  # deferred KV window (1-32 tokens); 0 computes every head's K/V each step
    side_stream: bool = True  # lookahead predictors on a second CUDA stream (else inline)

    def __post_init__(self):
        budgets(self.mlp_sparsity, 1, "mlp_sparsity")
        budgets(self.head_sparsity, 1, "head_sparsity")
        check_engine.size(self.kv_window, "kv_window", maximum=32, hint="tokens; 0 = no deferral")
        if not 0 <= self.kv_window <= 32:
            raise EngineError(f"kv_window={self.kv_window} must lie in [0, 32] tokens.")


def _norm(x: torch.Tensor, p: tuple, kind: str) -> torch.Tensor:
    w, b, eps = p  # one program per row: torch's kernel takes ~15 us for one row on an H200
    return row_norm(x, w, b if kind == "layer" else None, eps=eps, kind=kind)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-split form; x [..., dh], cos/sin broadcastable to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


_ACT = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}


class Decoder(KeptSets):
    """Greedy batch-1 decoding of one sequence of up to ``max_seq_len`` tokens.

    ``model`` is a HF model or the :class:`DecoderWeights` of one (to share them between
    decoders). ``sparse=None`` runs the dense path; a :class:`SparseConfig` runs the sparse kernels (fp16 or
    bf16 weights). ``predictors`` is any object with ``mlp_scores(layer, x)`` and
    ``head_scores(layer, x)`` returning [1, n] scores (``dejavu_lab.predictors.Predictors``,
    lookahead mode); without it the kept sets are the ones given to :meth:`set_indices`
    (default: the first k units).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model
    >>> dec, ids = Decoder(m, max_seq_len=16), torch.tensor([[5, 6, 7]])
    >>> torch.allclose(dec.prefill(ids), m(ids).logits[:, -1], atol=1e-4)  # last prompt position
    True
    >>> dec.generate(ids, 5).tolist() == m.generate(ids, max_new_tokens=5, do_sample=False).tolist()
    True
    """

    def __init__(self, model, *, max_seq_len: int, sparse: SparseConfig | None = None,
                 predictors=None, arch=None):  # fmt: skip
        # a DecoderWeights is shared as is (dense and sparse decoders over one copy)
        self.w = model if isinstance(model, DecoderWeights) else decoder_weights(model, arch)
        a = self.arch = self.w.arch
        self.sparse = sparse
        self.predictors = predictors
        if sparse is not None and self.w.dtype not in (torch.float16, torch.bfloat16):
            raise EngineError(
                f"the sparse path runs the fp16/bf16 kernels but the weights are {self.w.dtype}; "
                "load the model with dtype=torch.float16 (or bfloat16)."
            )
        if predictors is not None and getattr(predictors, "mode", "lookahead") != "lookahead":
            raise EngineError(
                "the engine runs lookahead predictors (Knowl 2); train mode='lookahead'."
            )
        if predictors is not None and sparse is None:
            raise EngineError("predictors were given without a SparseConfig; pass sparse=...")
        max_seq_len = check_engine.size(max_seq_len, "max_seq_len", minimum=2)  # whole tokens
        if max_seq_len > self.w.max_positions:
            raise EngineError(
                f"max_seq_len={max_seq_len} exceeds the model's {self.w.max_positions} positions."
            )
        self.max_seq_len = int(max_seq_len)
        dev, dt = self.w.device, self.w.dtype
        self.H, self.Hkv, self.dh = a.n_heads, a.n_kv_heads, a.d_head
        self.scale = 1.0 / math.sqrt(self.dh)
        # deferred KV needs one KV head per query head; GQA computes all (few) KV heads instead
        mha = self.H == self.Hkv
        self.window = sparse.kv_window if (sparse and mha and sparse.head_sparsity > 0) else 0
        t_alloc = self.max_seq_len + max(self.window, 1)
        # kv: [L, 2, Hkv, T, dh] static cache (zeros: never NaN, even where deferred)
        self.kv = torch.zeros(a.n_layers, 2, self.Hkv, t_alloc, self.dh, dtype=dt, device=dev)
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
        self._side = None
        if sparse is not None:
            self._init_sparse(sparse)

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
        return F.linear(x, self.w.lm_head)  # [S, V]

    def _block(self, i: int, x: torch.Tensor, attn, mlp) -> torch.Tensor:
        lw, kind = self.w.layers[i], self.w.norm
        if self.arch.pre_ln:
            h = x + attn(i, _norm(x, lw.ln_attn, kind))
            return h + mlp(i, _norm(h, lw.ln_mlp, kind))
        h = _norm(x + attn(i, x), lw.ln_attn, kind)  # post-LN (OPT-350m)
        return _norm(h + mlp(i, h), lw.ln_mlp, kind)

    def _mlp_dense(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw = self.w.layers[i]
        if (
            self.w.activation == "relu"
            and not self.arch.gated
            and lw.b_in is not None
            and x.is_cuda
        ):
            h = torch._addmm_activation(lw.b_in, x, lw.w_in.t())  # cuBLASLt bias+ReLU epilogue
            return (
                torch.addmm(lw.b_down, h, lw.w_down_t) if lw.b_down is not None else h @ lw.w_down_t
            )
        a = F.linear(x, lw.w_in, lw.b_in)
        act = _ACT[self.w.activation]
        h = (
            act(a[..., : self.arch.d_mlp]) * a[..., self.arch.d_mlp :]
            if self.arch.gated
            else act(a)
        )
        return h @ lw.w_down_t if lw.b_down is None else torch.addmm(lw.b_down, h, lw.w_down_t)

    def _mlp_sparse(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw, n, idx = self.w.layers[i], self.arch.d_mlp, self.mlp_idx[i]
        gated, b = self.arch.gated, lw.b_in
        h = sparse_mlp_up(
            x, lw.w_in[:n], idx, bias=None if b is None else b[:n], activation=self.w.activation,
            up_weight=lw.w_in[n:] if gated else None,
            up_bias=None if (b is None or not gated) else b[n:], validate=False,
        )  # fmt: skip
        return sparse_mlp_down(h, lw.w_down_t, idx, bias=lw.b_down, validate=False)

    def _per_step(self) -> None:
        """Tensors every layer of this step shares, computed once: mask or length, RoPE rows."""
        if self.sparse is None:  # the dense attention masks the static cache
            self._cur_mask = torch.where(self.ar_t <= self.pos_t, self._zero, self._ninf)  # [T]
        else:  # the sparse attention kernel reads positions < seqlen
            self._seqlen = self.pos_t + 1  # [1] tokens in the cache with this one
        if self.window:
            self._slot = self.pos_t - self.base_t  # [1] row of this token in the window
        if self.cos is not None:
            # [B, 1, dh]: one row per projected token (the window rows, or this token)
            positions = self.base_t + self.ar_w if self.window else self.pos_t
            self._cos_b = self.cos[positions, None]
            self._sin_b = self.sin[positions, None]

    def _attend(self, i: int, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per head over layer i's cache; q [H, dh] -> [H, dh] (GQA by grouping)."""
        k, v = self.kv[i, 0], self.kv[i, 1]  # [Hkv, T, dh]
        qg = q.view(self.Hkv, self.H // self.Hkv, self.dh)
        s = torch.baddbmm(mask.view(1, 1, -1), qg, k.transpose(1, 2), alpha=self.scale)
        return torch.bmm(torch.softmax(s, dim=-1), v).view(self.H, self.dh)

    def _attn_dense(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw, H, Hkv, dh = self.w.layers[i], self.H, self.Hkv, self.dh
        qkv = F.linear(x, lw.w_qkv, lw.b_qkv).view(H + 2 * Hkv, dh)
        if self.cos is not None:
            qk = _rotate(qkv[: H + Hkv], self._cos_b[0], self._sin_b[0])
            q, new = qk[:H], torch.stack((qk[H:], qkv[H + Hkv :]))
        else:
            q, new = qkv[:H], qkv[H:].view(2, Hkv, dh)
        self.kv[i].index_copy_(2, self.pos_t, new.unsqueeze(2))
        o = self._attend(i, q, self._cur_mask).view(1, H * dh)
        return o @ lw.w_o_t if lw.b_o is None else torch.addmm(lw.b_o, o, lw.w_o_t)

    def _attn_sparse(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw, dh, k, nkv = self.w.layers[i], self.dh, self.k_heads, self.n_kv_sel
        heads = self.head_idx[i]
        if self.window:  # union batch: this token plus the window's stored inputs (Knowl 5)
            self.hwin[i].index_copy_(0, self._slot, x)
            xb = self.hwin[i]
        else:
            xb = x
        qkv = sparse_mlp_up(xb, lw.w_qkv, self.qkv_idx[i], bias=lw.b_qkv, activation="none",
                            rows_per_index=dh, validate=False)  # [B, (k + 2 nkv) dh]  # fmt: skip
        blocks = qkv.view(xb.shape[0], k + 2 * nkv, dh)
        if self.cos is not None:  # row b sits at positions[b]; this token's row is at pos
            blocks[:, : k + nkv] = _rotate(blocks[:, : k + nkv], self._cos_b, self._sin_b)
        if self.window:  # the kept heads' K/V over the whole window, then this token's row
            kv_window_write(qkv, self.kv[i, 0], self.kv[i, 1], heads, self.base_t, n_q=k)
            qkv = qkv.index_select(0, self._slot)  # [1, (k + 2 nkv) dh]
        # appends this token's K/V (again, in the window case) and attends, kept heads only
        o = sparse_attention_core(
            qkv, self.kv[i, 0][None], self.kv[i, 1][None], self._seqlen, heads, n_heads=self.H,
            kv_heads=None if self.window else self._kv_all, scale=self.scale,
        )  # [1, k dh]  # fmt: skip
        return sparse_mlp_down(o, lw.w_o_t, heads, bias=lw.b_o, rows_per_index=dh,
                               validate=False)  # fmt: skip

    def _flush(self) -> None:
        """Dense K/V of every head for the window's tokens, then open a new window (Knowl 5)."""
        H, Hkv, dh, W, b = self.H, self.Hkv, self.dh, self.window, self.base
        for i, lw in enumerate(self.w.layers):
            bias = None if lw.b_qkv is None else lw.b_qkv[H * dh :]
            kv = F.linear(self.hwin[i], lw.w_qkv[H * dh :], bias).view(W, 2, Hkv, dh)
            kk = kv[:, 0]
            if self.cos is not None:
                kk = _rotate(kk, self.cos[b : b + W, None], self.sin[b : b + W, None])
            self.kv[i, 0, :, b : b + W] = kk.transpose(0, 1)
            self.kv[i, 1, :, b : b + W] = kv[:, 1].transpose(0, 1)
        self.base += W
        self.base_t.fill_(self.base)

    # ----------------------------------------------------------------------------- steps

    def _step_body(self) -> torch.Tensor:
        """One greedy decode step on the static buffers (what the CUDA graph records)."""
        x = self._embed(self.tok_t, self.pos_t)  # [1, d]
        self._per_step()
        sparse = self.sparse is not None
        attn = self._attn_sparse if sparse else self._attn_dense
        mlp = self._mlp_sparse if sparse else self._mlp_dense
        pred = sparse and self.predictors is not None
        side = self._side if (pred and x.is_cuda and self.sparse.side_stream) else None
        if pred:
            self._predict(0, x)
        keep = []  # layer inputs read on the side stream stay allocated until the join
        for i in range(self.arch.n_layers):
            if pred and i + 1 < self.arch.n_layers:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self._predict(i + 1, x)
                    keep.append(x)
                else:
                    self._predict(i + 1, x)
            x = self._block(i, x, attn, mlp)
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
        logits = self._head(x)  # [1, V]
        nxt = logits.argmax(-1)
        self.tokens.index_copy_(0, self.pos_t + 1, nxt)
        self.tok_t.copy_(nxt)
        self.pos_t.add_(1)
        return logits

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense forward over the prompt ids [1, S] (or [S]); fills the cache; logits [1, V]."""
        ids = check_engine.prompt(ids, vocab=self.w.embed.shape[0])  # a batch is not flattened
        ids = ids.reshape(-1).to(self.w.device)
        S = ids.numel()
        if S < 1 or S >= self.max_seq_len:
            raise EngineError(
                f"the prompt has {S} tokens but the cache holds {self.max_seq_len}; build the "
                "Decoder with a larger max_seq_len (prompt + new tokens)."
            )
        H, Hkv, dh = self.H, self.Hkv, self.dh
        pos = self.ar_t[:S]
        x = self._embed(ids, pos)

        def attn(i, xn):
            lw = self.w.layers[i]
            qkv = F.linear(xn, lw.w_qkv, lw.b_qkv).view(S, H + 2 * Hkv, dh)
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            if self.cos is not None:
                c, s = self.cos[:S, None], self.sin[:S, None]
                q, k = _rotate(q, c, s), _rotate(k, c, s)
            self.kv[i, 0, :, :S] = k.transpose(0, 1)
            self.kv[i, 1, :, :S] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=H != Hkv,
            )[0].transpose(0, 1).reshape(S, H * dh)  # fmt: skip
            return o @ lw.w_o_t if lw.b_o is None else torch.addmm(lw.b_o, o, lw.w_o_t)

        for i in range(self.arch.n_layers):
            x = self._block(i, x, attn, self._mlp_dense)
        logits = self._head(x[-1:])
        self.pos, self.base = S, S
        self.pos_t.fill_(S)
        self.base_t.fill_(S)
        nxt = logits.argmax(-1)
        self.tok_t.copy_(nxt)
        self.tokens[:S] = ids
        self.tokens[S : S + 1] = nxt
        if self.sparse is not None and self.window and not hasattr(self, "hwin"):
            self.hwin = torch.zeros(self.arch.n_layers, self.window, self.arch.d_model,
                                    dtype=self.w.dtype, device=self.w.device)  # fmt: skip
        return logits

    def _before_step(self) -> None:
        if self.pos >= self.max_seq_len:
            raise EngineError(f"the cache is full ({self.max_seq_len} tokens); build a larger one.")
        if self.window and self.pos - self.base >= self.window:
            self._flush()

    @torch.no_grad()
    def step(self, token=None) -> torch.Tensor:
        """Decode one token (default: the greedy choice of the last step); logits [1, V]."""
        if self.pos == 0:
            raise EngineError("call prefill(prompt_ids) before step().")
        self._before_step()
        if token is not None:
            self.tok_t.fill_(check_engine.size(token, "token", maximum=self.w.embed.shape[0] - 1))
        self.pos_t.fill_(self.pos)
        logits = self._replay() if self.graph is not None else self._step_body()
        self.pos += 1
        return logits

    def _replay(self) -> torch.Tensor:
        self.graph.replay()
        return self._graph_logits

    @torch.no_grad()
    def capture(self) -> None:
        """Record the decode step in a CUDA graph (after :meth:`prefill`); replays are positionless."""
        if not (self.w.device.type == "cuda" and torch.cuda.is_available()):
            raise EngineError("CUDA graph capture needs the model on a GPU; on CPU call step().")
        if self.pos == 0:
            raise EngineError("call prefill(prompt_ids) before capture().")
        self._side = self._side or torch.cuda.Stream()
        saved = (self.tok_t.clone(), self.pos_t.clone())
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):  # compile the Triton kernels, create cuBLAS handles
            for _ in range(2):
                self.pos_t.copy_(saved[1])
                self._step_body()
        torch.cuda.current_stream().wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._graph_logits = self._step_body()
        self.tok_t.copy_(saved[0])
        self.pos_t.copy_(saved[1])

    @torch.no_grad()
    def decode(self, n: int) -> None:
        """``n`` greedy steps with no host synchronisation (graph replays when captured)."""
        n = check_engine.size(n, "n")  # whole steps, >= 0
        if self.pos + n > self.max_seq_len:
            raise EngineError(
                f"{n} more tokens would pass the cache's {self.max_seq_len}; build a larger one."
            )
        for _ in range(n):
            self._before_step()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step_body()
            self.pos += 1

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *, graph: bool | None = None):
        """Greedy continuation of ids [1, S]: [1, S + max_new_tokens] (like HF ``generate``)."""
        ids = check_engine.prompt(ids, vocab=self.w.embed.shape[0])  # [1, S], ints in the vocab
        max_new_tokens = check_engine.size(max_new_tokens, "max_new_tokens", minimum=1)
        S = ids.reshape(-1).numel()
        if S + max_new_tokens > self.max_seq_len:
            raise EngineError(
                f"prompt {S} + {max_new_tokens} new tokens exceed the cache's {self.max_seq_len}."
            )
        self.prefill(ids)
        use_graph = self.w.device.type == "cuda" if graph is None else graph
        if use_graph and self.graph is None:
            self.capture()
        elif not use_graph:
            self.graph = None
        self.decode(max_new_tokens - 1)
        return self.tokens[: S + max_new_tokens][None].clone()

    # ----------------------------------------------------------------------------- profiling

    def parts(self) -> dict:
        """Zero-argument callables running one part of a decode step over every layer, for
        timing by :mod:`kernels.bench_engine` (each replays on the current static buffers)."""
        L, sparse = self.arch.n_layers, self.sparse is not None
        attn = self._attn_sparse if sparse else self._attn_dense
        mlp = self._mlp_sparse if sparse else self._mlp_dense
        d = self.arch.d_model
        x = torch.randn(1, d, dtype=self.w.dtype, device=self.w.device)

        def run_attn():
            self._per_step()
            for i in range(L):
                attn(i, _norm(x, self.w.layers[i].ln_attn, self.w.norm))

        def run_mlp():
            for i in range(L):
                mlp(i, _norm(x, self.w.layers[i].ln_mlp, self.w.norm))

        out = {"attention": run_attn, "mlp": run_mlp, "lm_head": lambda: self._head(x)}
        if sparse and self.predictors is not None:
            out["predictors"] = lambda: [self._predict(i, x) for i in range(L)]
        return out
