"""Architecture adapters: one small table per family mapping canonical parts to HF modules.

Deja Vu (§4, Fig. 4) sparsifies two things per block: the MLP's hidden neurons (rows of W1 /
columns of W2) and the attention heads (slices of W_Q, W_K, W_V and W_O). Everything in this
package reaches those weights through an :class:`Arch`, so a chapter written once runs on OPT
(the paper's model: ReLU MLP, fc1/fc2, out_proj, pre-LN, or post-LN with project_in/out as in
OPT-350m), on Llama-family models (SwiGLU gate/up/down, grouped-query attention, o_proj) and on
Gemma-3 (Gemma Team 2025: GeGLU with a gelu-tanh gate, *sandwich* norms — an RMSNorm before and
after each sub-block —, per-head q/k norms, sliding-window layers beside global ones, one KV
head in the small sizes, embeddings scaled by sqrt(d)).

A table names every norm of a layer and where it sits. :meth:`Arch.check` (run by
:func:`get_arch` on a model and by :func:`dejavu_lab.hooks.hooks` on each layer it attaches to)
compares that with the layer's real modules, so a table put on a family whose layers it does
not describe — e.g. the Llama table on Gemma-3, whose module names match but whose post-norms
sit between the sub-blocks and the residual stream — is refused instead of giving hook points
that are not what their names say.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .checks.models import not_a_bundle
from .errors import ArchMismatchError, UnsupportedArchitectureError

__all__ = [
    "ARCH_TABLES",
    "Arch",
    "ArchMismatchError",
    "ArchTable",
    "UnsupportedArchitectureError",
    "get_arch",
    "require_plain_blocks",
    "SUPPORTED",
]


@dataclass(frozen=True)
class ArchTable:
    """Where each canonical part lives, as attribute paths (relative to the model or a layer).

    >>> ARCH_TABLES["opt"].mlp_in, ARCH_TABLES["llama"].mlp_in
    (('fc1',), ('mlp.gate_proj', 'mlp.up_proj'))
    >>> ARCH_TABLES["gemma3_text"].ln_attn_post  # the sandwich norm on the attention output
    'post_attention_layernorm'
    """

    layers: str  # ModuleList of decoder layers, from the CausalLM
    final_norm: str  # the norm before the unembedding, from the CausalLM
    attn: str  # attention module, from a layer
    q: str  # query projection, from a layer
    k: str
    v: str
    o: str  # output projection W_O, from a layer
    mlp_in: tuple[str, ...]  # W1 (ReLU) or (gate, up) (gated), from a layer
    mlp_out: str  # W2 / down_proj, from a layer
    ln_attn: str  # norm around attention (before it in pre-LN, after the add in post-LN)
    ln_mlp: str  # norm around the MLP (before it in pre-LN)
    mlp: str | None  # the MLP as one module (gated families); None where fc1/fc2 sit in the layer
    family: str = "llama"  # "opt", "llama" or "gemma3": how get_arch reads the config
    ln_attn_post: str | None = None  # sandwich norm on attention's output, before the add
    ln_mlp_post: str | None = None  # sandwich norm on the MLP's output, before the add
    qk_norm: tuple[str, ...] = ()  # per-head norms on queries and keys, inside attention
    norm_offset: float = 0.0  # RMSNorm gain = offset + weight (Gemma stores weight - 1)

    def norms(self) -> set[str]:
        """Every norm of a layer this table places (paths relative to the layer)."""
        named = (self.ln_attn, self.ln_mlp, self.ln_attn_post, self.ln_mlp_post, *self.qk_norm)
        return {n for n in named if n is not None}


_LLAMA = ArchTable(
    layers="model.layers",
    final_norm="model.norm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj",
    mlp_in=("mlp.gate_proj", "mlp.up_proj"),
    mlp_out="mlp.down_proj",
    ln_attn="input_layernorm",
    ln_mlp="post_attention_layernorm",
    mlp="mlp",
)

# Qwen3 = Llama + per-head q/k norms (inside attention: the hook points are unchanged).
_QWEN3 = ArchTable(**{**_LLAMA.__dict__, "qk_norm": ("self_attn.q_norm", "self_attn.k_norm")})

# Gemma-3: input_layernorm -> attn -> post_attention_layernorm -> add; pre_feedforward_layernorm
# -> MLP -> post_feedforward_layernorm -> add. Note post_attention_layernorm is NOT the MLP's
# input norm here as it is in Llama: reusing the Llama table would put hook_resid_mid and
# hook_attn_out in the wrong places.
_GEMMA3 = ArchTable(
    **{
        **_LLAMA.__dict__,
        "ln_mlp": "pre_feedforward_layernorm",
        "family": "gemma3",
        "ln_attn_post": "post_attention_layernorm",
        "ln_mlp_post": "post_feedforward_layernorm",
        "qk_norm": ("self_attn.q_norm", "self_attn.k_norm"),
        "norm_offset": 1.0,
    }
)
# The multimodal Gemma-3 (4B and up) wraps the same text model beside a vision tower.
_GEMMA3_MM = ArchTable(
    **{
        **_GEMMA3.__dict__,
        "layers": "model.language_model.layers",
        "final_norm": "model.language_model.norm",
    }
)

_OPT = ArchTable(
    layers="model.decoder.layers",
    final_norm="model.decoder.final_layer_norm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.out_proj",
    mlp_in=("fc1",),
    mlp_out="fc2",
    ln_attn="self_attn_layer_norm",
    ln_mlp="final_layer_norm",
    mlp=None,
    family="opt",
)

# model_type -> table. Llama-family models whose module names match Llama's share its table.
ARCH_TABLES: dict[str, ArchTable] = {
    "opt": _OPT,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _QWEN3,
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3_MM,
}
SUPPORTED = tuple(sorted(ARCH_TABLES))


@dataclass(frozen=True)
class Arch:
    """A model's shapes plus accessors for its canonical parts. Built by :func:`get_arch`.

    >>> from dejavu_lab.models import random_model
    >>> model, _, arch = random_model("tiny-llama")
    >>> arch.heads_per_kv, [w.out_features for w in arch.mlp_in(model, 0)]  # [gate, up]
    (2, [192, 192])
    >>> arch.part(model, 0, "o")
    Linear(in_features=64, out_features=64, bias=False)
    >>> g = random_model("tiny-gemma3").arch
    >>> g.family, g.activation, g.n_kv_heads, g.sandwich, g.layer_types[:2]
    ('gemma3', 'gelu_pytorch_tanh', 1, True, ('sliding_attention', 'full_attention'))
    """

    family: str  # "opt", "llama" or "gemma3" (the table's family)
    model_type: str  # config.model_type, e.g. "opt", "llama", "qwen2", "gemma3_text"
    n_layers: int
    d_model: int  # residual width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (== n_heads without GQA)
    d_head: int  # per head; n_heads * d_head may differ from d_model (Gemma-3)
    d_mlp: int  # hidden neurons per MLP
    gated: bool  # SwiGLU/GeGLU-style act(gate)*up (True) or a plain activation MLP (False)
    activation: str  # "relu", "silu", "gelu_pytorch_tanh", …
    pre_ln: bool  # norm before each sub-block (True) or after the residual add (OPT-350m: False)
    table: ArchTable
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(d_model))
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" / "full_attention", if any

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers of ``model``."""
        return _get(model, self.table.layers)

    def layer(self, model: nn.Module, i: int) -> nn.Module:
        """Decoder layer ``i`` of ``model``."""
        return self.layers(model)[i]

    def part(self, model: nn.Module, i: int, name: str) -> nn.Module:
        """A module of layer ``i`` by canonical name: attn, q, k, v, o, mlp_out, ln_attn, ln_mlp,
        ln_attn_post, ln_mlp_post (the last two only on sandwich-norm families)."""
        path = getattr(self.table, name)
        if path is None:
            raise KeyError(f"The {self.family!r} table has no {name!r} in its layers.")
        return _get(self.layer(model, i), path)

    def mlp_in(self, model: nn.Module, i: int) -> list[nn.Linear]:
        """[W1] for ReLU MLPs, [gate, up] for gated MLPs."""
        return [_get(self.layer(model, i), p) for p in self.table.mlp_in]

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm before the unembedding."""
        return _get(model, self.table.final_norm)

    @property
    def heads_per_kv(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def sandwich(self) -> bool:
        """True when a norm sits between each sub-block and the residual add (Gemma-2/3)."""
        return self.table.ln_attn_post is not None

    def post_norm_scale(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The per-element factor a sandwich RMSNorm applies to ``x`` [..., d]: [..., d] fp32.

        ``norm(x) == x * post_norm_scale(norm, x)``; with the factor fixed, the norm is linear,
        so each head's share of ``x`` keeps its share of the output (``attn.hook_result``).

        >>> from dejavu_lab.models import random_model
        >>> model, _, arch = random_model("tiny-gemma3")
        >>> norm, x = arch.part(model, 0, "ln_attn_post"), torch.randn(2, 3, 64)
        >>> torch.allclose(x * arch.post_norm_scale(norm, x), norm(x), atol=1e-6)
        True
        """
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", 1e-6)
        xf = x.float()
        rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return rms * (self.table.norm_offset + norm.weight.float())

    def check(self, model: nn.Module, layers=None) -> None:
        """Refuse with :class:`ArchMismatchError` unless every layer has the table's structure.

        The layer's norms (every submodule whose class is a norm) must be exactly the ones the
        table places, and every part the table names must exist.

        >>> from dejavu_lab.models import random_model
        >>> model, _, arch = random_model("tiny-gemma3")
        >>> arch.check(model)  # fits: returns None
        """
        try:
            mods = self.layers(model)
        except AttributeError:
            raise ArchMismatchError(
                f"The {self.table.family!r} adapter table does not fit this {type(model).__name__}: "
                f"it has no {self.table.layers!r}; use the table of its own model type "
                f"(supported: {', '.join(SUPPORTED)})."
            ) from None
        for i in range(len(mods)) if layers is None else layers:
            self._check_layer(mods[i], i)

    def _check_layer(self, layer: nn.Module, i: int) -> None:
        t = self.table
        if t in _FITS.get(layer, ()):
            return
        names = [t.attn, t.q, t.k, t.v, t.o, *t.mlp_in, t.mlp_out, t.mlp, *t.norms()]
        missing = [n for n in names if n is not None and not _has(layer, n)]
        have = {n for n, m in layer.named_modules() if n and _is_norm(m)}
        extra, absent = sorted(have - t.norms()), sorted(t.norms() - have)
        if not (missing or extra or absent):
            _FITS.setdefault(layer, set()).add(t)
            return
        why = []
        if missing:
            why.append(f"it names {', '.join(missing)}, which the layer lacks")
        if extra:
            why.append(f"the layer has norms the table does not place ({', '.join(extra)})")
        if absent and not missing:
            why.append(f"its norms {', '.join(absent)} are not norms in the layer")
        raise ArchMismatchError(
            f"The {t.family!r} adapter table does not fit layer {i} ({type(layer).__name__}) of "
            f"this {self.model_type!r} model: {'; '.join(why)}; hook points would not mean what "
            f"their names say, so use the table of the model's own type (supported: "
            f"{', '.join(SUPPORTED)}) or write one that places every norm."
        )


def get_arch(model_or_config) -> Arch:
    """The adapter for a transformers model or config; a model is also :meth:`Arch.check`-ed.

    >>> from dejavu_lab.models import random_model
    >>> get_arch(random_model("tiny-opt").model).family
    'opt'
    """
    cfg = getattr(not_a_bundle(model_or_config), "config", model_or_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCH_TABLES:
        raise UnsupportedArchitectureError(
            f"Architecture {model_type!r} is not supported; supported model types are "
            f"{', '.join(SUPPORTED)} (add a table to dejavu_lab.arch for another family)."
        )
    table = ARCH_TABLES[model_type]
    arch = _from_config(cfg, model_type, table)
    if isinstance(model_or_config, nn.Module):
        arch.check(model_or_config)
    return arch


def require_plain_blocks(arch: Arch, what: str = "the engine") -> None:
    """Refuse, in one sentence, a model whose blocks are more than pre-LN attention + MLP.

    For code that re-implements a block instead of running the model's own forward — the
    decoder in :mod:`dejavu_lab.engine`, the K/V recomputation of :mod:`dejavu_lab.deferred_kv`
    — and knows neither sandwich norms, nor per-head q/k norms, nor layers that mix local
    (sliding-window) and global attention.

    >>> from dejavu_lab.models import random_model
    >>> require_plain_blocks(random_model("tiny-llama").arch)  # fine: returns None
    >>> require_plain_blocks(random_model("tiny-gemma3").arch, "deferred KV")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.UnsupportedArchitectureError: deferred KV runs plain pre-LN blocks, but ...
    """
    extra = [
        "sandwich norms" if arch.sandwich else "",
        "per-head q/k norms" if arch.table.qk_norm else "",
        "sliding-window layers" if "sliding_attention" in arch.layer_types else "",
    ]
    if any(extra):
        raise UnsupportedArchitectureError(
            f"{what} runs plain pre-LN blocks, but this {arch.model_type!r} model has "
            f"{' and '.join(e for e in extra if e)}; use dejavu_lab.sparsify (the model's own "
            "forward) for quality runs on it."
        )


def _from_config(cfg, model_type: str, table: ArchTable) -> Arch:
    if table.family == "opt":
        n_heads = cfg.num_attention_heads
        return Arch(
            family="opt",
            model_type=model_type,
            n_layers=cfg.num_hidden_layers,
            d_model=cfg.hidden_size,
            n_heads=n_heads,
            n_kv_heads=n_heads,
            d_head=cfg.hidden_size // n_heads,
            d_mlp=cfg.ffn_dim,
            gated=False,
            activation=cfg.activation_function,
            pre_ln=bool(cfg.do_layer_norm_before),
            table=table,
        )
    if hasattr(cfg, "get_text_config"):  # multimodal Gemma-3: the text model's config
        cfg = cfg.get_text_config()
    n_heads = cfg.num_attention_heads
    gemma = table.family == "gemma3"
    layer_types = tuple(getattr(cfg, "layer_types", None) or ())
    sliding = getattr(cfg, "sliding_window", None)  # Mistral: every layer; Gemma-3: some
    if layer_types and "sliding_attention" not in layer_types:
        sliding = None
    return Arch(
        family=table.family,
        model_type=model_type,
        n_layers=cfg.num_hidden_layers,
        d_model=cfg.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        d_head=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        d_mlp=cfg.intermediate_size,
        gated=True,
        activation=getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        pre_ln=True,
        table=table,
        embed_scale=float(cfg.hidden_size**0.5) if gemma else 1.0,
        sliding_window=sliding,
        layer_types=layer_types,
    )


# layer -> tables already checked to fit it (a layer's structure does not change after loading)
_FITS: weakref.WeakKeyDictionary[nn.Module, set[ArchTable]] = weakref.WeakKeyDictionary()


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _is_norm(m: nn.Module) -> bool:
    """LayerNorm, RMSNorm and the families' own RMSNorm classes (LlamaRMSNorm, Gemma3RMSNorm…)."""
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")
