"""A GGUF checkpoint dequantised once and cached as a Hugging Face folder, keyed by its sha256.

transformers reads a GGUF file by dequantising every weight (the demo model: ~15 s; the Qwen2.5
0.5B / 1.5B Q4_K_M files: ~36 / ~61 s on one CPU core), and it refuses to ``save_pretrained`` such
a model ("quantized with gguf and is not serializable"). So :func:`converted` writes the
dequantised weights itself, once, as a folder any later load reads in seconds::

    $DEJAVU_LAB_CACHE/gguf/<file stem>-<first 16 hex digits of the file's sha256>/
        config.json            the model's config (without GGUF's quantization_config)
        tokenizer files        the tokenizer transformers built from the GGUF's vocabulary
        model.safetensors      every weight in float32: the exact dequantised values, so a
                               bf16 or fp16 load casts from it as a load of the GGUF itself would
        source.json            the GGUF's name, size and sha256

Keyed by content, not by path: moving or renaming the file finds its cache entry (by the sha256
in the folder's name), and a changed file gets a new one. The folder is written under a
temporary name and renamed into place when complete; two processes converting the same file take turns (:func:`dejavu_lab.atomic.locked`,
one lock file per entry), and the second finds the folder there. An entry costs 4 bytes per
parameter (the 1.5B: 6.2 GB); delete the folder to free it.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from . import assets, atomic
from .arch import SUPPORTED, UnsupportedArchitectureError, get_arch
from .errors import AssetError, ModelNotFoundError

__all__ = ["converted", "entry_dir"]

_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space"


def entry_dir(file_name: str, sha256: str) -> Path:
    """The cache folder of a GGUF named ``file_name`` with content hash ``sha256``.

    >>> entry_dir("SmolLM2-135M-Instruct.Q4_1.gguf", "b179c952" * 8).relative_to(assets.cache_dir())
    PosixPath('gguf/smollm2-135m-instruct.q4_1-b179c952b179c952')
    """
    stem = Path(file_name).stem.lower()
    return assets.cache_dir() / "gguf" / f"{stem}-{sha256[:16]}"


def converted(
    spec: str,
    file_name: str,
    sha256: str,
    source: Callable[[], Path],
    *,
    quiet: bool = False,
) -> Path:
    """The cached folder of a GGUF checkpoint, converting it first if it is not there yet.

    ``file_name`` and ``sha256`` name the entry; ``source()`` returns the GGUF file and is
    called only when the entry is missing (it may download it: :func:`dejavu_lab.assets.fetch`).
    ``spec`` is what the user passed, for error messages; ``quiet`` hides the notice on stderr.

    >>> from dejavu_lab.models import DEMO_ASSET
    >>> asset = assets.ASSETS[DEMO_ASSET]
    >>> path = converted("demo", asset.filename, asset.sha256, lambda: assets.fetch(DEMO_ASSET))
    >>> sorted(p.name for p in path.glob("*.json"))[:3]
    ['config.json', 'source.json', 'tokenizer.json']
    """
    out = entry_dir(file_name, sha256)
    if (found := _find(out)) is not None:
        return found
    try:
        root = atomic.make_dirs(out.parent, hint=_HINT)
        with atomic.locked(
            root / f".{out.name}.lock", what=f"converting {file_name} into the cache", hint=_HINT
        ):
            if (found := _find(out)) is not None:  # converted while we waited
                return found
            file = source()
            _convert(file, spec, sha256, out, quiet=quiet)
    except (atomic.WriteError, atomic.BusyError) as e:
        raise AssetError(str(e)) from None
    return out


def _find(out: Path) -> Path | None:
    """``out``, or the entry of the same content under another file name, if complete."""
    sha = out.name.rpartition("-")[2]
    for entry in [out, *sorted(out.parent.glob(f"*-{sha}"))]:
        # a folder is renamed into place only once every file is written
        if (entry / "config.json").exists() and (entry / "model.safetensors").exists():
            return entry
    return None


def _convert(file: Path, spec: str, sha256: str, out: Path, *, quiet: bool) -> None:
    """Dequantise ``file`` to float32 and write config, tokenizer and weights into ``out``."""
    from safetensors.torch import save_model

    where = dict(pretrained_model_name_or_path=file.parent, gguf_file=file.name)
    get_arch(_gguf_config(where, spec))  # an unsupported family fails before dequantising
    if not quiet:
        print(
            f"dejavu_lab: dequantising {file.name} once; the float32 weights are cached in {out}",
            file=sys.stderr,
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32, **_dequantized())
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as e:
        raise _bad_gguf(spec, e) from None
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    for stale in out.parent.glob(f".{out.name}.convert-*"):  # a killed conversion's (we hold
        shutil.rmtree(stale, ignore_errors=True)  # this entry's lock: no one else writes them)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.convert-", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a cache entry reads like any folder
        AutoConfig.for_model(**cfg).save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp, spec)
        save_model(model, str(tmp / "model.safetensors"))  # shared (tied) weights stored once
        source = {"gguf": file.name, "bytes": file.stat().st_size, "sha256": sha256}
        (tmp / "source.json").write_text(json.dumps(source, indent=1))
        del model  # the caller loads the folder next: do not hold two copies
        gc.collect()
        if out.exists():  # a half-written folder from an older version: replace it
            shutil.rmtree(out)
        os.replace(tmp, out)
    except ModelNotFoundError:  # an OSError too, but not a disk's: its own sentence
        raise
    except OSError as e:
        raise atomic.WriteError(atomic.WriteError.explain(e, out.parent, _HINT)) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# Text whose tokens a saved tokenizer must reproduce: spaces, tabs, newlines, digits, code, accents
_PROBE = "The fire crossed Hill Top  on\tSunday.\n\ndef f(x):\n    return x**2  # 3.14 café 東京\n"


def _save_tokenizer(tokenizer, folder: Path, spec: str) -> None:
    """Save the GGUF's tokenizer so that it reads back the same: transformers rebuilds some
    tokenizer classes from their own definition rather than the saved ``tokenizer.json`` (a
    byte-level vocabulary in a Gemma-3 GGUF came back splitting spaces differently), so when the
    class does not read back the same, the folder names the generic class, which reads
    ``tokenizer.json`` as it was written."""
    tokenizer.save_pretrained(folder)
    want = tokenizer(_PROBE).input_ids
    if AutoTokenizer.from_pretrained(folder)(_PROBE).input_ids == want:
        return
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(settings, indent=2))
    if AutoTokenizer.from_pretrained(folder)(_PROBE).input_ids != want:
        raise ModelNotFoundError(
            f"The tokenizer of {spec!r} does not read back the same once saved, so it cannot be "
            "cached; convert the GGUF to a Hugging Face folder with its own tokenizer files."
        )


def _dequantized() -> dict:
    """``from_pretrained`` options that unpack every GGUF weight into a plain float tensor.

    Recent transformers may keep some families' weights packed in GGUF blocks (our hooks and
    kernels need plain ``nn.Linear`` weights), and for the families it dequantises anyway it
    warns, when asked for bfloat16, that the weights "stay quantized" -- they do not. Asking
    for dequantisation outright does both right and silences the warning.
    """
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: GGUF weights are always dequantised
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _gguf_config(where: dict, spec: str):
    """The GGUF's config, read from its header; a family transformers cannot read, one sentence."""
    try:
        return AutoConfig.from_pretrained(**where)
    except ValueError as e:
        if "not supported" in str(e):  # transformers' GGUF reader lacks the architecture
            raise UnsupportedArchitectureError(
                f"transformers cannot read {where['gguf_file']!r}: "
                f"{str(e).splitlines()[0].rstrip('.')}; convert it to a Hugging Face folder, or "
                f"use a GGUF of a supported family ({', '.join(SUPPORTED)})."
            ) from None
        raise _bad_gguf(spec, e) from None
    except Exception as e:  # the gguf reader raises many kinds for a damaged file
        raise _bad_gguf(spec, e) from None


def _bad_gguf(spec: str, e: Exception) -> ModelNotFoundError:
    why = str(e).splitlines()[0][:200] if str(e) else ""
    return ModelNotFoundError(
        f"Cannot read {spec!r} as a GGUF model ({type(e).__name__}{': ' + why if why else ''}); "
        "check that the file is complete (re-download it) and that the gguf package is installed."
    )
