"""Deferred KV for sparsely selected heads during generation (Deja Vu §4.2).

With contextual head sparsity a token computes only its selected heads, so it writes no key or
value for the others. When a later token selects a head, the cache lacks that head's history;
DejaVu keeps each token's (normalised) hidden state ``y_t`` and recomputes the missing
``K = y W_K`` and ``V = y W_V`` on demand — cheap, because decoding is bound by reading weights.

:class:`DeferredKVCache` is a ``transformers`` ``DynamicCache`` that does exactly that: entries a
token did not compute are written as NaN (so any use of them would poison the output), the
hidden state entering ``k_proj``/``v_proj`` is kept through a forward pre-hook, and when a head
is needed its missing entries are recomputed (with RoPE at their positions for Llama-family
models) before attention reads the cache. Which heads a token uses must be known *before* its
attention runs, so heads come from the predictors (or a static set), never the oracle.

:func:`generate` decodes greedily with it inside :func:`dejavu_lab.sparsify.sparsified`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .arch import Arch, get_arch, require_plain_blocks
from .budgets import budgets, n_keep, topk_mask
from .hooks import hooks
from .sparsify import StaticSets, sparsified
from .sparsify.dejavu import _predictor_input

__all__ = ["DeferredKVCache", "Generation", "cache_keyword", "generate"]


class DeferredKVCache(DynamicCache):
    """A DynamicCache whose per-head entries are computed only when a token selects the head.

    ``keep_fn(layer) -> bool [b, q, n_heads]`` gives the current step's selected query heads; a
    key/value head is needed by a token when any query head of its group is selected.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")  # 4 query heads in 2 groups (2 KV heads)
    >>> keep = torch.tensor([True, True, False, False])  # only group 0 selected
    >>> cache = DeferredKVCache(m.model, m.arch, lambda layer: keep.expand(1, 3, 4))
    >>> k, v = cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)  # 3 tokens
    >>> k[0, 0].isnan().any().item(), k[0, 1].isnan().all().item(), cache.skipped
    (False, True, 3)
    """

    def __init__(self, model, arch: Arch, keep_fn, deferred: bool = True):
        super().__init__(config=model.config)
        self.model, self.arch, self.keep_fn, self.deferred = model, arch, keep_fn, deferred
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> [b, seq, d] input of k/v_proj
        self.have: dict[int, torch.Tensor] = {}  # layer -> bool [b, kv, seq] entry computed
        self.skipped = 0  # (token, layer, kv head) entries not computed when their token ran
        self.recomputed = 0  # ... of which later recomputed from hidden states

    def store_hidden(self, layer: int, y: torch.Tensor) -> None:  # y: [b, q, d]
        old = self.hidden.get(layer)
        self.hidden[layer] = y.detach() if old is None else torch.cat([old, y.detach()], 1)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [b, kv, q, dh] for the current tokens (all heads computed
        # by the HF module; we keep only what a sparse kernel would have computed)
        if not self.deferred:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        b, kv, q, _ = key_states.shape
        keep = self.keep_fn(layer_idx)  # [b, q, h]
        need_tok = keep.view(b, q, kv, -1).any(-1).transpose(1, 2)  # [b, kv, q]
        nan = torch.full((), float("nan"), dtype=key_states.dtype, device=key_states.device)
        k_new = torch.where(need_tok[..., None], key_states, nan)
        v_new = torch.where(need_tok[..., None], value_states, nan)
        self.skipped += int((~need_tok).sum())
        super().update(k_new, v_new, layer_idx, *args, **kwargs)
        old = self.have.get(layer_idx)
        have = need_tok if old is None else torch.cat([old, need_tok], -1)
        missing = ~have & need_tok.any(-1, keepdim=True)  # needed now, never computed
        layer = self.layers[layer_idx]
        if missing.any():
            k_re, v_re = self._recompute(layer_idx)  # [b, kv, seq, dh]
            layer.keys = torch.where(missing[..., None], k_re, layer.keys)
            layer.values = torch.where(missing[..., None], v_re, layer.values)
            self.recomputed += int(missing.sum())
            have = have | missing
        self.have[layer_idx] = have
        return layer.keys, layer.values

    def _recompute(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every stored token of layer ``i`` from its hidden states: [b, kv, s, dh]."""
        arch, y = self.arch, self.hidden[i]  # y: [b, s, d]
        b, s, _ = y.shape
        k_proj, v_proj = arch.part(self.model, i, "k"), arch.part(self.model, i, "v")
        # F.linear, not the modules: calling k_proj would re-enter the hidden-state hook
        k = (
            torch.nn.functional.linear(y, k_proj.weight, k_proj.bias)
            .view(b, s, arch.n_kv_heads, arch.d_head)
            .transpose(1, 2)
        )
        v = (
            torch.nn.functional.linear(y, v_proj.weight, v_proj.bias)
            .view(b, s, arch.n_kv_heads, arch.d_head)
            .transpose(1, 2)
        )
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if arch.family == "llama" and rotary is not None:
            pos = torch.arange(s, device=y.device)[None].expand(b, s)
            cos, sin = rotary(v, position_ids=pos)  # [b, s, dh]
            cos, sin = cos[:, None].to(k.dtype), sin[:, None].to(k.dtype)
            half = k.shape[-1] // 2
            rotated = torch.cat([-k[..., half:], k[..., :half]], -1)
            k = k * cos + rotated * sin
        return k, v


@dataclass
class Generation:
    """What :func:`generate` returns.

    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.sparsify import static_sets
    >>> m = random_model("tiny-llama")
    >>> static = static_sets(m.model, torch.randint(0, 128, (2, 8)), progress=False)
    >>> g = generate(m.model, torch.tensor([[1, 2, 3, 4]]), 4, head_sparsity=0.5, static=static)
    >>> g.tokens.shape, g.logits.shape, g.head_keep[0].shape  # 4 prompt + 4 new tokens
    (torch.Size([1, 8]), torch.Size([1, 4, 128]), torch.Size([1, 7, 4]))
    """

    tokens: torch.Tensor  # [b, prompt + new] prompt then generated ids
    logits: torch.Tensor  # [b, new, vocab] the logits each new token was chosen from
    skipped: int = 0  # KV entries not computed when their token ran
    recomputed: int = 0  # ... recomputed later, when a token selected their head
    head_keep: dict = field(default_factory=dict)  # layer -> bool [b, seq, h] heads used


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``"cache"`` in transformers 5.24
    (where ``past_key_values`` is deprecated, to go in 5.40), ``"past_key_values"`` before it.

    >>> from dejavu_lab.models import random_model
    >>> cache_keyword(random_model("tiny-llama").model) in ("cache", "past_key_values")
    True
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 16,
    *,
    mlp_sparsity=0.0,
    head_sparsity=0.0,
    dense_layers=(),
    predictors=None,
    static: StaticSets | None = None,
    deferred: bool = True,
    arch: Arch | None = None,
) -> Generation:
    """Greedy decoding with predicted (or static) contextual sparsity and deferred KV.

    ``deferred=False`` computes every head's K/V for every token (a dense KV cache) — the
    outputs are the same, which is the point of deferring.

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> from dejavu_lab.predictors import PredictorConfig, Predictors
    >>> m, prompt = random_model("tiny-llama"), torch.tensor([[1, 2, 3, 4]])
    >>> _ = torch.manual_seed(0)
    >>> pred = Predictors(fingerprint(m.model), PredictorConfig())  # untrained is enough here
    >>> runs = [generate(m.model, prompt, 4, head_sparsity=0.5, predictors=pred, deferred=d)
    ...         for d in (True, False)]
    >>> runs[0].skipped, runs[0].recomputed  # KV entries skipped, of which later recomputed
    (6, 4)
    >>> torch.equal(runs[0].tokens, runs[1].tokens)  # same tokens as with a dense KV cache
    True
    """
    arch = arch or get_arch(model)
    require_plain_blocks(arch, "deferred KV")  # it recomputes K/V outside the model
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [batch, prompt] with prompt ≥ 1 token, got "
            f"{tuple(input_ids.shape)}."
        )
    if (predictors is None) == (static is None):
        raise ValueError(
            "generate needs exactly one of predictors= or static= to pick heads "
            "before attention runs (the oracle needs the heads' outputs)."
        )
    mode = "predicted" if predictors is not None else "static"
    kw = dict(
        mlp_sparsity=mlp_sparsity,
        head_sparsity=head_sparsity,
        mode=mode,
        dense_layers=dense_layers,
        predictors=predictors,
        static=static,
        arch=arch,
    )
    hs = budgets(head_sparsity, arch.n_layers, "head_sparsity")
    for i in dense_layers:
        hs[i] = 0.0
    static_heads = static.head_keep(hs) if static is not None else None
    inputs: dict[str, torch.Tensor] = {}
    used: dict[int, list] = {}

    def keep_fn(i: int) -> torch.Tensor:
        x = inputs[f"pre{i}"]  # [b, q, d] the current tokens' layer input
        if hs[i] == 0:
            keep = torch.ones(*x.shape[:-1], arch.n_heads, dtype=torch.bool, device=x.device)
        elif static_heads is not None:
            keep = static_heads[i].to(x.device).expand(*x.shape[:-1], arch.n_heads)
        else:
            keep = topk_mask(
                predictors.head_scores(i, _predictor_input(predictors, inputs, i, "heads")),
                n_keep(hs[i], arch.n_heads),
            )
        used.setdefault(i, []).append(keep.cpu())
        return keep

    cache = DeferredKVCache(model, arch, keep_fn, deferred=deferred)

    def on_pre(t, name):
        inputs[f"pre{name.split('.')[1]}"] = t.detach()

    handles = []
    for i in range(arch.n_layers):
        handles.append(
            arch.part(model, i, "k").register_forward_pre_hook(
                lambda mod, args, i=i: cache.store_hidden(i, args[0])
            )
        )
    cache_arg = cache_keyword(model)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    step_logits = []
    try:
        with sparsified(model, **kw), hooks(model, {"blocks.*.hook_resid_pre": on_pre}, arch):
            nxt = ids
            for _ in range(max_new_tokens):
                out = model(input_ids=nxt, use_cache=True, **{cache_arg: cache})
                last = out.logits[:, -1].float()
                step_logits.append(last.cpu())
                nxt = last.argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
    finally:
        for h in handles:
            h.remove()
    return Generation(
        tokens=ids.cpu(),
        logits=torch.stack(step_logits, 1),
        skipped=cache.skipped,
        recomputed=cache.recomputed,
        head_keep={i: torch.cat(v, 1) for i, v in used.items()},
    )
