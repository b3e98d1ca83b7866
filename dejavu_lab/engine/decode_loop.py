"""Running a decoder over one sequence: the dense prefill, the decode steps and their CUDA graph.

:class:`DecodeLoop` is the half of :class:`~dejavu_lab.engine.decoder.Decoder` a caller drives:
:meth:`~DecodeLoop.prefill` runs the prompt densely and fills the KV cache (reporting each site's
input to the decoder's ``_taps`` when set: calibration, :mod:`~dejavu_lab.engine.thresholds`);
:meth:`~DecodeLoop.step` decodes one token; :meth:`~DecodeLoop.capture` records the step in a
CUDA graph that :meth:`~DecodeLoop.decode` replays with no host synchronisation; and
:meth:`~DecodeLoop.generate` continues a prompt greedily, like HF ``generate``. The step itself
(embedding, blocks, ``lm_head``, the greedy choice on the device) is the decoder's
``_step_body``; the batched and tensor-parallel decoders override parts of both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import engine as check_engine
from .attention import rotate
from .config import EngineError
from .mlp import gate_act
from .weights import linear_t

__all__ = ["DecodeLoop"]


class DecodeLoop:
    """The calls that run a :class:`~dejavu_lab.engine.decoder.Decoder`: a base class of it,
    reading the cache, buffers, weights and blocks the decoder sets up.

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama").model, max_seq_len=16)
    >>> isinstance(dec, DecodeLoop), dec.prefill(torch.tensor([[1, 2, 3]])).shape
    (True, torch.Size([1, 128]))
    >>> dec.step().shape, dec.pos  # the greedy token of the prefill, fed back
    (torch.Size([1, 128]), 4)
    """

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
        tap = self._taps or (lambda i, site, t: None)
        masked = _prefill_masker(self.w.prefill_masks)

        def attn(i, xn):
            lw = self.w.layers[i]
            tap(i, "attn_in", xn)
            xn = masked(i, "attn_in", xn)
            qkv = lw.qkv(xn).view(S, H + 2 * Hkv, dh)
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            if self.cos is not None:
                c, s = self.cos[:S, None], self.sin[:S, None]
                q, k = rotate(q, c, s), rotate(k, c, s)
            self.kv[i, 0, :, :S] = k.transpose(0, 1)
            self.kv[i, 1, :, :S] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=H != Hkv,
            )[0].transpose(0, 1).reshape(S, H * dh)  # fmt: skip
            tap(i, "o_in", o)
            return linear_t(masked(i, "o_in", o), lw.w_o_t, lw.b_o)

        def mlp(i, xn):
            lw, n = self.w.layers[i], self.arch.d_mlp
            tap(i, "mlp_in", xn)
            a = lw.mlp_in(masked(i, "mlp_in", xn))
            g = gate_act(a, self.w.activation, self.arch.gated, n)  # what CATS thresholds
            h = g * a[:, n:] if self.arch.gated else g
            tap(i, "gate", g)
            tap(i, "down_in", h)
            return linear_t(h, lw.w_down_t, lw.b_down)

        for i in range(self.arch.n_layers):
            x = self._block(i, x, lambda xn, i=i: attn(i, xn), lambda xn, i=i: mlp(i, xn))
        logits = self._head(x[-1:])
        self.pos, self.base = S, S
        self.pos_t.fill_(S)
        self.base_t.fill_(S)
        nxt = logits.argmax(-1)
        self.tok_t.copy_(nxt)
        self.tokens[:S] = ids
        self.tokens[S : S + 1] = nxt
        if self.window and self.st.hwin is None:  # the deferred window's attention inputs
            self.st.hwin = torch.zeros(self.arch.n_layers, self.window, self.arch.d_model,
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
        self._advance()
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
        self._side_stream()
        choices = self._kernel_choices()
        if len(choices) > 1 and self.kernel_choice is None:
            self.kernel_choice = self._time_choices(choices)
        self._record()

    def _record(self) -> None:
        """Warm the step up on a side stream (Triton compiles, cuBLAS handles), then record it."""
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

    def _kernel_choices(self) -> list[dict]:
        """Kernel settings of this step, the fastest of which the first :meth:`capture` keeps
        (:meth:`_time_choices`); a decoder with one way to run its step has none."""
        return []

    def _apply_choice(self, choice: dict) -> None:
        raise NotImplementedError  # a decoder with _kernel_choices sets them here

    def _time_choices(self, choices: list[dict], replays: int = 16) -> dict:
        """Record the step under each choice, time ``replays`` graph replays at this position
        (the step advances the device's position: it is set back before each replay, and each
        replay rewrites this token's cache rows, which the real step writes again), keep the
        fastest: ``{"chosen": choice, "ms": [ms per step of each choice], "choices": choices}``."""
        times, saved = [], (self.tok_t.clone(), self.pos_t.clone())

        def replay():
            self.tok_t.copy_(saved[0])
            self.pos_t.copy_(saved[1])
            self.graph.replay()

        for choice in choices:
            self._apply_choice(choice)
            self._record()
            for _ in range(2):
                replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        self.tok_t.copy_(saved[0])
        self.pos_t.copy_(saved[1])
        best = choices[min(range(len(choices)), key=times.__getitem__)]
        self._apply_choice(best)
        self.graph = None
        return {"chosen": best, "ms": times, "choices": choices}

    def _side_stream(self) -> None:
        """Create the lookahead predictors' stream once, at SparseConfig's priority."""
        if self._side is None:
            sp = self.sparse
            self._side = torch.cuda.Stream(priority=sp.side_priority if sp is not None else 0)

    def _steps_left(self) -> float:
        """Decode steps the cache still has room for."""
        return self.max_seq_len - self.pos

    def _advance(self) -> None:
        """Count one decoded step (the batched decoder counts steps, not positions)."""
        self.pos += 1

    @torch.no_grad()
    def decode(self, n: int) -> None:
        """``n`` decode steps with no host synchronisation (graph replays when captured)."""
        n = check_engine.size(n, "n")  # whole steps, >= 0
        if n > self._steps_left():
            raise EngineError(
                f"{n} more tokens would pass the cache's {self.max_seq_len}; build a larger one."
            )
        for _ in range(n):
            self._before_step()
            self.graph.replay() if self.graph is not None else self._step_body()
            self._advance()

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


def _prefill_masker(masks: dict):
    """``(layer, site, x) -> x`` with ``|x| <= t`` zeroed where ``masks`` has a threshold (the
    sites of a folded refit), else ``x`` itself."""
    if not masks:
        return lambda i, site, x: x
    ready: dict = {}

    def masked(i: int, site: str, x: torch.Tensor) -> torch.Tensor:
        t = masks.get((i, site))
        if t is None:
            return x
        if isinstance(t, torch.Tensor):
            t = ready.setdefault((i, site), t.to(x.device, torch.float32))
        return x * (x.abs().float() > t)

    return masked
