"""Architecture adapters: one small table per family mapping canonical parts to HF modules.

Deja Vu (§4, Fig. 4) sparsifies two things per block: the MLP's hidden neurons (rows of W1 /
columns of W2) and the attention heads (slices of W_Q, W_K, W_V and W_O). Everything in this
package reaches those weights through an :class:`Arch`, so a chapter written once runs on OPT
(the paper's model: ReLU MLP, fc1/fc2, out_proj, pre-LN, or post-LN with project_in/out as in
OPT-350m) and on Llama-family models (SwiGLU gate/up/down, grouped-query attention, o_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ARCH_TABLES", "Arch", "UnsupportedArchitectureError", "get_arch", "SUPPORTED"]


class UnsupportedArchitectureError(ValueError):
    """The model's ``config.model_type`` has no adapter.

    >>> from transformers import GPT2Config
    >>> get_arch(GPT2Config())
    Traceback (most recent call last):
    ...
    dejavu_lab.arch.UnsupportedArchitectureError: Architecture 'gpt2' is not supported; ...
    """


@dataclass(frozen=True)
class ArchTable:
    """Where each canonical part lives, as attribute paths (relative to the model or a layer).

    >>> ARCH_TABLES["opt"].mlp_in, ARCH_TABLES["llama"].mlp_in
    (('fc1',), ('mlp.gate_proj', 'mlp.up_proj'))
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
    ln_mlp: str  # norm around the MLP
    mlp: str | None  # the MLP as one module (gated families); None where fc1/fc2 sit in the layer


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
)

# model_type -> table. Llama-family models whose module names match Llama's share its table.
ARCH_TABLES: dict[str, ArchTable] = {
    "opt": _OPT,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
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
    """

    family: str  # "opt" or "llama" (the table used)
    model_type: str  # config.model_type, e.g. "opt", "llama", "qwen2"
    n_layers: int
    d_model: int  # residual width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (== n_heads without GQA)
    d_head: int
    d_mlp: int  # hidden neurons per MLP
    gated: bool  # SwiGLU-style gate*up (True) or a plain activation MLP (False)
    activation: str  # "relu", "silu", "gelu", …
    pre_ln: bool  # norm before each sub-block (True) or after the residual add (OPT-350m: False)
    table: ArchTable

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return _get(model, self.table.layers)

    def layer(self, model: nn.Module, i: int) -> nn.Module:
        return self.layers(model)[i]

    def part(self, model: nn.Module, i: int, name: str) -> nn.Module:
        """A module of layer ``i`` by canonical name: attn, q, k, v, o, mlp_out, ln_attn, ln_mlp."""
        return _get(self.layer(model, i), getattr(self.table, name))

    def mlp_in(self, model: nn.Module, i: int) -> list[nn.Linear]:
        """[W1] for ReLU MLPs, [gate, up] for gated MLPs."""
        return [_get(self.layer(model, i), p) for p in self.table.mlp_in]

    def final_norm(self, model: nn.Module) -> nn.Module:
        return _get(model, self.table.final_norm)

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads


def get_arch(model_or_config) -> Arch:
    """The adapter for a transformers model or config.

    >>> from dejavu_lab.models import random_model
    >>> get_arch(random_model("tiny-opt").model).family
    'opt'
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCH_TABLES:
        raise UnsupportedArchitectureError(
            f"Architecture {model_type!r} is not supported; supported model types are "
            f"{', '.join(SUPPORTED)} (add a table to dejavu_lab.arch for another family)."
        )
    table = ARCH_TABLES[model_type]
    if model_type == "opt":
        n_heads = cfg.num_attention_heads
        act = cfg.activation_function
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
            activation=act,
            pre_ln=bool(cfg.do_layer_norm_before),
            table=table,
        )
    n_heads = cfg.num_attention_heads
    return Arch(
        family="llama",
        model_type=model_type,
        n_layers=cfg.num_hidden_layers,
        d_model=cfg.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        d_head=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        d_mlp=cfg.intermediate_size,
        gated=True,
        activation=cfg.hidden_act,
        pre_ln=True,
        table=table,
    )


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)
