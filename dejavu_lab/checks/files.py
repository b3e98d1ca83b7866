"""Files read back from disk: predictor files and collection manifests.

Unchecked, a file edited by hand, written by another tool or version, or from another model fails
as a ``KeyError: 'fingerprint'``, a ``JSONDecodeError``, a 20-line ``size mismatch`` from
``load_state_dict``, an ``AttributeError: 'list' object has no attribute 'get'`` — or loads:
NaN weights "predict" every unit as active. Each is one sentence here naming the file:
``PredictorError`` for predictor files, ``CollectionError`` for collections.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CollectionError
from ..vocab import COLLECTION_FORMAT as FORMAT
from ..vocab import FINGERPRINT_KEYS, FINGERPRINT_VERSION, fingerprint_id

__all__ = [
    "finite",
    "manifest",
    "metadata_json",
    "older_fingerprint",
    "read_manifest",
    "same_model",
    "state_matches",
]


def _collection_error(msg: str):
    return CollectionError(msg)


def metadata_json(meta: dict, key: str, path, error: type[Exception], kind: type = dict):
    """The JSON value of metadata ``key`` in a safetensors file, of type ``kind``.

    >>> from dejavu_lab.predictors import PredictorError
    >>> metadata_json({"config": "{mlp_rank: 8}"}, "config", "p.safetensors", PredictorError)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: p.safetensors has non-JSON metadata 'config'; the ...
    """
    again = "the file was edited or written by another tool: train the predictors again."
    if key not in meta:
        raise error(f"{path} has no {key!r} metadata; {again}")
    try:
        value = json.loads(meta[key])
    except (TypeError, ValueError):
        raise error(f"{path} has non-JSON metadata {key!r}; {again}") from None
    if not isinstance(value, kind):
        raise error(
            f"{path} metadata {key!r} is a {type(value).__name__}, not a {kind.__name__}; {again}"
        )
    return value


def state_matches(expected: dict, tensors: dict, path, error: type[Exception]) -> None:
    """The tensors of a file have exactly the names and shapes its metadata implies.

    >>> from dejavu_lab.predictors import PredictorError
    >>> state_matches({"w": torch.zeros(8, 64)}, {"w": torch.zeros(4, 64)}, "p.safetensors",
    ...               PredictorError)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: p.safetensors: tensor w has shape (4, 64) but its ...
    """
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = (
            f"lacks {len(missing)} tensors (e.g. {missing[0]})"
            if missing
            else (f"has {len(extra)} unexpected tensors (e.g. {extra[0]})")
        )
        raise error(f"{path} {what}; the file is damaged or edited: train the predictors again.")
    for k, want in expected.items():
        got = tensors[k]
        if tuple(got.shape) != tuple(want.shape):
            raise error(
                f"{path}: tensor {k} has shape {tuple(got.shape)} but its metadata implies "
                f"{tuple(want.shape)}; the file was edited: train the predictors again."
            )


def finite(tensors: dict, path, error: type[Exception]) -> None:
    """No NaN or infinite weights (a diverged training, or an edited file).

    >>> from dejavu_lab.predictors import PredictorError
    >>> finite({"w": torch.tensor([1.0, float("nan")])}, "p.safetensors", PredictorError)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: p.safetensors: tensor w holds NaN or infinite ...
    """
    for k, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise error(
                f"{path}: tensor {k} holds NaN or infinite values (a diverged training or an "
                "edited file); train the predictors again, with a lower lr if it diverged."
            )


def manifest(obj, path) -> dict:
    """A parsed collection manifest has the fields :func:`dejavu_lab.collect.collect` writes.

    >>> manifest([], "col/manifest.json")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CollectionError: col/manifest.json holds a list, not a collection ...
    """
    again = "delete the folder and collect again."
    if not isinstance(obj, dict):
        raise _collection_error(
            f"{path} holds a {type(obj).__name__}, not a collection manifest; {again}"
        )
    if obj.get("format") != FORMAT:
        raise _collection_error(
            f"{path} has format {obj.get('format')!r}, not {FORMAT} (another version of "
            f"dejavu-lab wrote it); {again}"
        )
    fp, cfg = obj.get("fingerprint"), obj.get("config")
    if not isinstance(fp, dict) or any(k not in fp for k in FINGERPRINT_KEYS if k != "version"):
        raise _collection_error(f"{path} lacks the model fingerprint; {again}")
    if not isinstance(cfg, dict) or "window" not in cfg:
        raise _collection_error(f"{path} lacks the collect config; {again}")
    for key in ("n_chunks", "n_tokens"):
        v = obj.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _collection_error(f"{path} has {key}={v!r}, not a count >= 1; {again}")
    return obj


def read_manifest(path: str | Path) -> dict:
    """Read and check ``manifest.json`` of a collection folder.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "manifest.json").write_text("")
    >>> read_manifest(folder / "manifest.json")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CollectionError: /.../manifest.json is empty, not a collection manifest; ...
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _collection_error(
            f"Cannot read {path} ({getattr(e, 'strerror', None) or type(e).__name__}); check "
            "its permissions, or delete the folder and collect again."
        ) from None
    if not text.strip():
        raise _collection_error(
            f"{path} is empty, not a collection manifest; delete the folder and collect again."
        )
    try:
        obj = json.loads(text)
    except ValueError:
        raise _collection_error(
            f"{path} is not valid JSON (cut short or edited); delete the folder and collect again."
        ) from None
    return manifest(obj, path)


def same_model(man: dict, fp: dict, where) -> None:
    """A collection was collected from the model it is used with (same fingerprint).

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> a, b = (fingerprint(random_model("tiny-llama", seed=s).model) for s in (0, 1))
    >>> same_model({"fingerprint": a}, b, "col")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CollectionError: col was collected from another model (llama-L2-d64-...
    """
    theirs = man["fingerprint"]
    if older_fingerprint(theirs):
        raise _collection_error(
            f"{where} was collected under the older model fingerprint, which saw 8 rows of 3 "
            "weight matrices only and cannot tell this model from another of its shape; delete "
            "it and collect again."
        )
    if any(theirs.get(k) != fp.get(k) for k in FINGERPRINT_KEYS):
        raise _collection_error(
            f"{where} was collected from another model ({fingerprint_id(theirs)}; this one is "
            f"{fingerprint_id(fp)}); collect from this model with `dejavu-lab collect`, or load "
            "the model it came from."
        )


def older_fingerprint(fp: dict) -> bool:
    """Whether a fingerprint read from a file predates the whole-model one (it hashed 8 rows of
    3 weight matrices, so a model differing elsewhere got the same one).

    >>> older_fingerprint({"model_type": "llama", "weights_sha256": "0123456789abcdef"})
    True
    """
    return not isinstance(fp, dict) or fp.get("version") != FINGERPRINT_VERSION
