"""Model specs, devices and model folders, checked before a single weight is read.

Seen before these checks: ``load_model(Path(...))`` refused a ``pathlib.Path``; ``device="cuda"``
on a machine without CUDA loaded the whole model and then failed with
``AssertionError: Torch not compiled with CUDA enabled``; a folder with a truncated
``model.safetensors`` ended in ``SafetensorError: incomplete metadata, file not fully covered``;
a folder without tokenizer files loaded every weight and then printed a 6-line ``ValueError``
about slow tokenizers. Each is one sentence here (``ModelNotFoundError`` for specs and folders,
:class:`~dejavu_lab.errors.InputError` for devices).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from ..errors import InputError, ModelNotFoundError

__all__ = ["device", "model_dir", "model_spec", "not_a_bundle"]

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.msgpack", "*.h5", "*.ckpt")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
    "tokenizer.tiktoken",
)


def _error(msg: str):
    return ModelNotFoundError(msg)


def model_spec(spec) -> str:
    """A model spec as a string: ``pathlib.Path`` and other path-likes are accepted.

    >>> model_spec(Path("models") / "opt-125m")
    'models/opt-125m'
    >>> model_spec(None)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.ModelNotFoundError: Model spec must be a non-empty string or path, got None; ...
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise _error(
            f"Model spec must be a non-empty string or path, got {spec!r}; pass 'demo', a "
            "Hugging Face id, a local folder or 'random:<preset>'."
        )
    return spec


def device(value) -> torch.device:
    """A device this machine has, said before the model loads (not after 15 s of loading).

    >>> device("cpu")
    device(type='cpu')
    >>> device("cuda") if not torch.cuda.is_available() else None  # on this CPU machine
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: device='cuda' but this machine has no usable CUDA GPU (torch ...
    """
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(
            f"device {value!r} is not a torch device; use 'cpu', 'cuda', 'cuda:1' or 'mps'."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise InputError(
                f"device={value!r} but this machine has no usable CUDA GPU (torch "
                f"{torch.__version__}, {build}); use device='cpu' or run on a GPU machine."
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise InputError(f"device={value!r} but this machine has {n} GPU(s): cuda:0..{n - 1}.")
    if dev.type == "mps" and not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    ):
        raise InputError(f"device={value!r} but MPS (Apple GPU) is not available; use 'cpu'.")
    return dev


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (header and data sizes against the file size)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                return f"is truncated ({size} bytes, its header alone needs {8 + n})"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"has an unreadable header ({type(e).__name__})"
    if not isinstance(header, dict):
        return "has an unreadable header (not a JSON object)"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"is truncated ({size} of {need} bytes)"
    return None


def model_dir(path: str | Path) -> str | Path:
    """A local model folder holds a config, whole weights and a tokenizer (or a GGUF file).

    A ``str`` is a Hugging Face hub id and passes unchecked (the hub says what it holds).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "config.json").write_text('{"model_type": "llama"}')
    >>> model_dir(folder)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.ModelNotFoundError: /... holds config.json but no weights ...
    """
    if isinstance(path, str) or path.is_file():
        return path  # a hub id, or a single file (a GGUF) that its own reader checks
    if any(path.glob("*.gguf")):
        return path  # the GGUF reader brings config, weights and tokenizer in one file
    if not (path / "config.json").is_file():
        raise _error(
            f"{path} has no config.json; pass a folder written by save_pretrained (config.json, "
            "weights and tokenizer files) or one holding a .gguf file."
        )
    weights = sorted(p for g in WEIGHT_GLOBS for p in path.glob(g) if p.is_file())
    if not weights:
        raise _error(
            f"{path} holds config.json but no weights (model.safetensors or pytorch_model.bin); "
            "copy the weight files into it or save the model there with save_pretrained."
        )
    for index in path.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise _error(f"{index} is not a valid weights index; copy it again.") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise _error(
                f"{path} lacks {len(missing)} weight shard(s) named in {index.name} (e.g. "
                f"{missing[0]}); copy or download them again."
            )
    for w in weights:
        if w.suffix == ".safetensors" and (why := _safetensors_problem(w)):
            raise _error(f"{w} {why}; copy or download it again.")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise _error(
            f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...); "
            "save them there with tokenizer.save_pretrained(folder)."
        )
    return path


def not_a_bundle(model):
    """Refuse the whole ``load_model()`` result where its model is meant; ``model`` back.

    ``load_model`` returns ``(model, tokenizer, arch)``; passed whole, the tuple used to reach
    the adapter lookup as "Architecture None is not supported".

    >>> from dejavu_lab.models import random_model
    >>> not_a_bundle(random_model("tiny-llama"))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: got the whole load_model() result (model, tokenizer, arch) where the model goes; pass its .model (e.g. lm = load_model(...); lm.model), or unpack it: model, tokenizer, arch = load_model(...).
    """
    if isinstance(model, tuple) and all(hasattr(model, a) for a in ("model", "arch")):
        raise InputError(
            "got the whole load_model() result (model, tokenizer, arch) where the model goes; "
            "pass its .model (e.g. lm = load_model(...); lm.model), or unpack it: "
            "model, tokenizer, arch = load_model(...)."
        )
    return model
