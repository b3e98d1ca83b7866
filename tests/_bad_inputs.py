"""What the bad-input tests through the API share (``test_bad_inputs_api``,
``test_bad_inputs_files``): the objects each case is made from and the helpers that damage
copies of their files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from _tiny_folder import build
from safetensors.torch import load_file, save_file

from dejavu_lab.collect import (
    CollectConfig,
    collect,
    fingerprint,
)
from dejavu_lab.engine import Decoder
from dejavu_lab.models import random_model
from dejavu_lab.predictors import (
    PredictorConfig,
    Predictors,
)

W = 8


def shared(root: Path) -> SimpleNamespace:
    """The objects the cases are made from, built under ``root``: tiny random models, a
    collection, a predictor file, a tiny model folder and a decoder."""
    llama = random_model("tiny-llama")
    ids = torch.randint(0, 128, (4, W), generator=torch.Generator().manual_seed(0))
    col = collect(
        llama.model,
        None,
        CollectConfig(window=W, max_tokens=4 * W),
        root / "col",
        windows=ids,
        progress=False,
    )
    pred = Predictors(fingerprint(llama.model), PredictorConfig(mlp_rank=4, head_rank=2))
    return SimpleNamespace(
        root=root,
        llama=llama.model,
        opt=random_model("tiny-opt").model,
        other=random_model("tiny-llama", seed=1).model,
        ids=ids,
        col=col,
        pred=pred,
        pred_file=pred.save(root / "pred.safetensors"),
        folder=build(root / "tiny-folder"),
        decoder=Decoder(random_model("tiny-opt").model, max_seq_len=16),
    )


def call(fn, *args, **kwargs):
    """The call to refuse; its arguments (damaged files, …) are made before the snapshot."""
    return lambda: fn(*args, **kwargs)


def copy_folder(w, name: str) -> Path:
    """A fresh copy of the tiny model folder to damage."""
    dest = w.root / name
    if not dest.exists():
        shutil.copytree(w.folder, dest)
    return dest


def damaged_predictor_file(w, name: str, tensors=None, meta=None) -> Path:
    """A copy of the good predictor file with edited tensors and/or metadata."""
    from safetensors import safe_open

    with safe_open(str(w.pred_file), "pt") as f:
        old_meta = f.metadata()
    t = load_file(w.pred_file)
    t = tensors(t) if tensors else t
    m = meta(dict(old_meta)) if meta else old_meta
    path = w.root / name
    save_file(t, str(path), metadata=m)
    return path


def damaged_collection(w, name: str, manifest) -> Path:
    """A copy of the good collection whose manifest.json is replaced by ``manifest`` (text)."""
    dest = w.root / name
    if not dest.exists():
        shutil.copytree(w.col.path, dest)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest(dict(w.col.manifest)))
    (dest / "manifest.json").write_text(text)
    return dest


def with_tensor(key, fn):
    def edit(t):
        t[key] = fn(t[key])
        return t

    return edit


def replace_hook(value):
    """A hook at blocks.0.mlp.hook_post returning ``value(t)``."""
    return {"blocks.0.mlp.hook_post": lambda t, name: value(t)}


def empty_file(w):
    """An empty file where a predictor file should be."""
    path = w.root / "empty.safetensors"
    path.write_bytes(b"")
    return path
