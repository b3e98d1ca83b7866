"""Bad inputs through the public API: each one is refused where it enters, with the
error type of the module it enters, in one sentence that says what to do, and no file changes.

Each case is ``(id, make, error, words)``: ``make(w)`` builds the call from the shared objects
``w`` (tiny random models, a tiny model folder, a collection, a predictor file, a decoder).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _audit import refuse
from _tiny_folder import build
from safetensors.torch import load_file, save_file

from dejavu_lab.checks import InputError
from dejavu_lab.checks.hooks import HookError
from dejavu_lab.collect import (
    CollectConfig,
    CollectionError,
    collect,
    fingerprint,
    open_collection,
)
from dejavu_lab.corpus import CorpusError, perplexity, token_windows, window_nll
from dejavu_lab.engine import Decoder, EngineError, SparseConfig
from dejavu_lab.hooks import hooks, run_with_cache, run_with_hooks
from dejavu_lab.models import ModelNotFoundError, load_model, random_model
from dejavu_lab.predictors import (
    PredictorConfig,
    PredictorError,
    Predictors,
    evaluate,
    load_predictors,
    train_predictors,
)
from dejavu_lab.sparsify import sparse_perplexity

W = 8


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs-api")
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


TOKENS = [
    (
        "perplexity-list",
        lambda w: lambda: perplexity(w.llama, [[1, 2, 3]]),
        CorpusError,
        "got a list",
        "torch.tensor",
    ),
    (
        "perplexity-numpy",
        lambda w: lambda: perplexity(w.llama, np.ones((2, 4), int)),
        CorpusError,
        "got a ndarray",
    ),
    (
        "perplexity-float",
        lambda w: lambda: perplexity(w.llama, w.ids.float()),
        CorpusError,
        "dtype torch.float32",
    ),
    (
        "perplexity-bool",
        lambda w: lambda: perplexity(w.llama, w.ids > 5),
        CorpusError,
        "dtype torch.bool",
    ),
    (
        "perplexity-1d",
        lambda w: lambda: perplexity(w.llama, w.ids[0]),
        CorpusError,
        "[None] for one window",
    ),
    (
        "perplexity-3d",
        lambda w: lambda: perplexity(w.llama, w.ids[None]),
        CorpusError,
        "must be 2-D",
    ),
    (
        "perplexity-empty",
        lambda w: lambda: perplexity(w.llama, w.ids[:0]),
        CorpusError,
        "non-empty",
    ),
    (
        "perplexity-one-token-window-is-nan",
        lambda w: lambda: perplexity(w.llama, w.ids[:, :1]),
        CorpusError,
        "perplexity is NaN",
    ),
    (
        "perplexity-id-at-vocab",
        lambda w: lambda: perplexity(w.llama, w.ids + 128),
        CorpusError,
        "vocabulary has 128 tokens",
    ),
    (
        "perplexity-negative-id",
        lambda w: lambda: perplexity(w.llama, w.ids - 200),
        CorpusError,
        "negative id",
    ),
    (
        "perplexity-longer-than-positions",
        lambda w: lambda: perplexity(w.opt, torch.zeros(1, 2049, dtype=torch.long)),
        CorpusError,
        "2048 positions",
    ),
    (
        "window-nll-batch-size-0",
        lambda w: lambda: window_nll(w.llama, w.ids, batch_size=0),
        CorpusError,
        "batch_size must be at least 1",
    ),
    (
        "window-nll-batch-size-float",
        lambda w: lambda: window_nll(w.llama, w.ids, batch_size=1.5),
        CorpusError,
        "batch_size",
    ),
    (
        "sparse-perplexity-float",
        lambda w: lambda: sparse_perplexity(w.llama, w.ids.half()),
        CorpusError,
        "integer token ids",
    ),
    (
        "run-with-cache-list",
        lambda w: lambda: run_with_cache(w.llama, [1, 2, 3]),
        CorpusError,
        "got a list",
    ),
    (
        "run-with-cache-float",
        lambda w: lambda: run_with_cache(w.llama, w.ids.float()),
        CorpusError,
        "integer token ids",
    ),
    (
        "run-with-cache-out-of-vocab",
        lambda w: lambda: run_with_cache(w.llama, w.ids * 100),
        CorpusError,
        "ids up to",
    ),
    (
        "run-with-cache-1d",
        lambda w: lambda: run_with_cache(w.llama, w.ids[0]),
        CorpusError,
        "input_ids[None]",
    ),
    (
        "run-with-hooks-too-long",
        lambda w: lambda: run_with_hooks(w.opt, torch.zeros(1, 3000, dtype=torch.long), {}),
        CorpusError,
        "at most 2048",
    ),
    (
        "collect-float-windows",
        lambda w: (
            lambda: collect(
                w.llama,
                None,
                CollectConfig(window=W, max_tokens=W),
                w.root / "x1",
                windows=w.ids.float(),
                progress=False,
            )
        ),
        CorpusError,
        "integer token ids",
    ),
    (
        "collect-windows-other-width",
        lambda w: (
            lambda: collect(
                w.llama,
                None,
                CollectConfig(window=4, max_tokens=8),
                w.root / "x2",
                windows=w.ids,
                progress=False,
            )
        ),
        CollectionError,
        "CollectConfig(window=8",
    ),
    (
        "collect-window-beyond-positions",
        lambda w: (
            lambda: collect(
                w.opt,
                None,
                CollectConfig(window=4096, max_tokens=4096),
                w.root / "x3",
                progress=False,
            )
        ),
        CollectionError,
        "2048 positions",
    ),
    (
        "collect-out-of-vocab",
        lambda w: (
            lambda: collect(
                w.llama,
                None,
                CollectConfig(window=W, max_tokens=W),
                w.root / "x4",
                windows=w.ids + 500,
                progress=False,
            )
        ),
        CorpusError,
        "vocabulary",
    ),
    (
        "collect-no-tokenizer",
        lambda w: (
            lambda: collect(
                w.llama, None, CollectConfig(window=W, max_tokens=W), w.root / "x5", progress=False
            )
        ),
        CollectionError,
        "windows=",
    ),
    (
        "collect-config-not-a-config",
        lambda w: lambda: collect(w.llama, None, {"window": 8}, w.root / "x6", windows=w.ids),
        CollectionError,
        "CollectConfig",
    ),
    (
        "evaluate-list-windows",
        lambda w: lambda: evaluate(w.llama, [[1, 2]], w.pred, progress=False),
        CorpusError,
        "list",
    ),
    (
        "evaluate-not-predictors",
        lambda w: lambda: evaluate(w.llama, w.ids, "p.safetensors", progress=False),
        PredictorError,
        "load_predictors",
    ),
    (
        "token-windows-text-list",
        lambda w: lambda: token_windows(load_model(w.folder).tokenizer, ["a", "b"], 4),
        CorpusError,
        "join the documents",
    ),
    (
        "token-windows-text-bytes",
        lambda w: lambda: token_windows(load_model(w.folder).tokenizer, b"some text", 4),
        CorpusError,
        "got a bytes",
    ),
    (
        "token-windows-no-tokenizer",
        lambda w: lambda: token_windows(None, "text", 4),
        CorpusError,
        "tokenizer",
    ),
    (
        "token-windows-float-window",
        lambda w: lambda: token_windows(load_model(w.folder).tokenizer, "text " * 100, 8.5),
        CorpusError,
        "window must be",
    ),
    (
        "token-windows-max-windows-negative",
        lambda w: lambda: token_windows(load_model(w.folder).tokenizer, "text " * 100, 4, -1),
        CorpusError,
        "max_windows",
    ),
    (
        "token-windows-max-windows-zero",
        lambda w: lambda: token_windows(load_model(w.folder).tokenizer, "text " * 100, 4, 0),
        CorpusError,
        "None takes every window",
    ),
]

CONFIGS = [
    (f"predictor-{field}-{value!r}", {field: value}, words)
    for field, value, words in [
        ("mlp_rank", 0, "mlp_rank must be at least 1"),
        ("mlp_rank", -1, "mlp_rank must be at least 1"),
        ("mlp_rank", 2.5, "mlp_rank"),
        ("head_rank", 0, "head_rank must be at least 1"),
        ("epochs", 0, "train for at least one epoch"),
        ("epochs", True, "epochs"),
        ("batch_size", 0, "batch_size must be at least 1"),
        ("patience", 0, "patience"),
        ("lr", 0.0, "lr must be a finite number > 0"),
        ("lr", float("nan"), "lr"),
        ("lr", -1e-3, "lr"),
        ("val_fraction", 0.0, "(0, 1)"),
        ("val_fraction", 1.0, "(0, 1)"),
        ("val_fraction", 1.5, "(0, 1)"),
        ("val_fraction", float("nan"), "val_fraction"),
        ("max_pos_weight", 0, "max_pos_weight"),
        ("mlp_sparsity", 1.0, "[0, 1)"),
        ("head_sparsity", -0.1, "[0, 1)"),
        ("seed", 1.5, "seed"),
        ("mode", "ahead", "'same' or 'lookahead'"),
    ]
] + [
    (f"collect-{field}-{value!r}", {field: value}, words)
    for field, value, words in [
        ("window", 8.5, "window must be at least 2"),
        ("window", 1, "window must be at least 2"),
        ("window", "512", "window"),
        ("max_tokens", 100, "max_tokens >= window"),
        ("max_tokens", 1024.5, "max_tokens"),
        ("chunk_windows", 0, "chunk_windows"),
        ("skip_windows", -1, "skip_windows"),
        ("skip_windows", 1.5, "skip_windows"),
        ("mlp_label_sparsity", 1.0, "[0, 1)"),
        ("corpus", "wiki", "choose one of demo, wikitext-2, c4"),
        ("corpus", None, "Unknown corpus None"),
    ]
]

HOOKS = [
    (
        "hook-returns-list",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, replace_hook(lambda t: t.tolist())),
        HookError,
        "returned a list",
    ),
    (
        "hook-returns-numpy",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, replace_hook(lambda t: t.numpy())),
        HookError,
        "returned a ndarray",
    ),
    (
        "hook-returns-float64",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, replace_hook(lambda t: t.double())),
        HookError,
        ".to(torch.float32)",
    ),
    (
        "hook-returns-wrong-shape",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, replace_hook(lambda t: t[..., :10])),
        HookError,
        "must keep",
    ),
    (
        "hook-returns-other-device",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, replace_hook(lambda t: t.to("meta"))),
        HookError,
        "return .to('cpu')",
    ),
    (
        "hook-returns-at-read-only-point",
        lambda w: (
            lambda: run_with_hooks(w.llama, w.ids, {"blocks.0.hook_resid_mid": lambda t, n: t})
        ),
        HookError,
        "read-only",
    ),
    (
        "hook-not-callable",
        lambda w: lambda: run_with_hooks(w.llama, w.ids, {"blocks.0.mlp.hook_post": "print"}),
        HookError,
        "not a function",
    ),
    (
        "names-empty-list",
        lambda w: lambda: run_with_cache(w.llama, w.ids, names=[]),
        KeyError,
        "No hook point matches []",
    ),
    (
        "names-predicate-matching-nothing",
        lambda w: lambda: run_with_cache(w.llama, w.ids, names=lambda n: "hook_mlp_in" in n),
        KeyError,
        "the predicate",
    ),
    (
        "names-not-strings",
        lambda w: lambda: run_with_cache(w.llama, w.ids, names=[0, 1]),
        KeyError,
        "must be strings",
    ),
    (
        "names-glob-matching-nothing",
        lambda w: lambda: run_with_cache(w.llama, w.ids, names="blocks.9.*"),
        KeyError,
        "layers 0..1",
    ),
    (
        "hooks-context-with-bad-name",
        lambda w: lambda: hooks(w.llama, {"blocks.0.mlp.hook_pre_act": print}).__enter__(),
        KeyError,
        "use names like",
    ),
]


def _empty(w):
    path = w.root / "empty.safetensors"
    path.write_bytes(b"")
    return path


def _no_weights(w):
    d = copy_folder(w, "no-weights")
    (d / "model.safetensors").unlink(missing_ok=True)
    return d


def _no_tokenizer(w):
    d = copy_folder(w, "no-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink(missing_ok=True)
    return d


def _truncated(w):
    d = copy_folder(w, "truncated")
    data = (w.folder / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    return d


def _missing_shard(w):
    d = copy_folder(w, "missing-shard")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


MODELS = [
    ("spec-none", lambda w: lambda: load_model(None), ModelNotFoundError, "non-empty string"),
    ("spec-int", lambda w: lambda: load_model(42), ModelNotFoundError, "got 42"),
    ("spec-blank", lambda w: lambda: load_model("  "), ModelNotFoundError, "Model spec"),
    (
        "device-cuda-without-cuda",
        lambda w: lambda: load_model(w.folder, device="cuda"),
        InputError,
        "no usable CUDA GPU",
        "device='cpu'",
    ),
    (
        "device-not-a-device",
        lambda w: lambda: load_model(w.folder, device="gpu"),
        InputError,
        "not a torch device",
    ),
    (
        "random-model-cuda-without-cuda",
        lambda w: lambda: random_model("tiny-opt", device="cuda"),
        InputError,
        "no usable CUDA GPU",
    ),
    (
        "random-spec-cuda-without-cuda",
        lambda w: lambda: load_model("random:tiny-llama", device="cuda:1"),
        InputError,
        "CUDA",
    ),
    (
        "folder-without-weights",
        lambda w: call(load_model, _no_weights(w)),
        ModelNotFoundError,
        "no weights",
        "copy the weight files",
    ),
    (
        "folder-without-tokenizer",
        lambda w: call(load_model, _no_tokenizer(w)),
        ModelNotFoundError,
        "no tokenizer files",
        "save_pretrained",
    ),
    (
        "folder-with-truncated-weights",
        lambda w: call(load_model, _truncated(w)),
        ModelNotFoundError,
        "is truncated",
        "download it again",
    ),
    (
        "folder-with-missing-shard",
        lambda w: call(load_model, _missing_shard(w)),
        ModelNotFoundError,
        "weight shard",
        "model-00002-of-00002.safetensors",
    ),
    (
        "path-that-is-a-file",
        lambda w: lambda: load_model(w.folder / "config.json"),
        ModelNotFoundError,
        "not a model directory",
    ),
]

FILES = [
    (
        "predictor-edited-shape",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w,
                "shape.safetensors",
                with_tensor("mlp.0.down.weight", lambda t: t[:2].contiguous()),
            ),
        ),
        PredictorError,
        "has shape (2, 64)",
        "metadata implies (4, 64)",
    ),
    (
        "predictor-missing-tensor",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w,
                "missing.safetensors",
                lambda t: {k: v for k, v in t.items() if "heads.1" not in k},
            ),
        ),
        PredictorError,
        "lacks",
    ),
    (
        "predictor-extra-tensor",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w, "extra.safetensors", lambda t: {**t, "mlp.9.up.bias": torch.zeros(3)}
            ),
        ),
        PredictorError,
        "unexpected tensors",
    ),
    (
        "predictor-nan-weights",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w, "nan.safetensors", with_tensor("heads.0.up.bias", lambda t: t * float("nan"))
            ),
        ),
        PredictorError,
        "NaN or infinite",
    ),
    (
        "predictor-inf-weights",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w, "inf.safetensors", with_tensor("mlp.1.up.weight", lambda t: t / 0)
            ),
        ),
        PredictorError,
        "NaN or infinite",
    ),
    (
        "predictor-no-fingerprint-metadata",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w,
                "nofp.safetensors",
                meta=lambda m: {k: v for k, v in m.items() if k != "fingerprint"},
            ),
        ),
        PredictorError,
        "no 'fingerprint' metadata",
    ),
    (
        "predictor-non-json-config",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w, "nonjson.safetensors", meta=lambda m: {**m, "config": "{mlp_rank: 4"}
            ),
        ),
        PredictorError,
        "non-JSON metadata 'config'",
    ),
    (
        "predictor-config-a-list",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(w, "list.safetensors", meta=lambda m: {**m, "config": "[4, 2]"}),
        ),
        PredictorError,
        "is a list, not a dict",
    ),
    (
        "predictor-config-rank-0",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w,
                "rank0.safetensors",
                meta=lambda m: {
                    **m,
                    "config": json.dumps({**json.loads(m["config"]), "mlp_rank": 0}),
                },
            ),
        ),
        PredictorError,
        "holds a bad config (mlp_rank must be at least 1",
    ),
    (
        "predictor-fingerprint-incomplete",
        lambda w: call(
            load_predictors,
            damaged_predictor_file(
                w,
                "fp.safetensors",
                meta=lambda m: {**m, "fingerprint": json.dumps({"model_type": "llama"})},
            ),
        ),
        PredictorError,
        "incomplete model fingerprint",
    ),
    (
        "predictor-plain-safetensors",
        lambda w: call(
            load_predictors, damaged_predictor_file(w, "plain.safetensors", meta=lambda m: {})
        ),
        PredictorError,
        "not dejavu-lab predictors",
    ),
    (
        "predictor-path-is-a-folder",
        lambda w: lambda: load_predictors(w.root),
        PredictorError,
        "is a folder; pass one of its predictor files",
    ),
    (
        "predictor-empty-file",
        lambda w: call(load_predictors, _empty(w)),
        PredictorError,
        "truncated or damaged",
    ),
    (
        "predictor-for-another-model",
        lambda w: lambda: load_predictors(w.pred_file, w.other),
        PredictorError,
        "another model",
    ),
    (
        "manifest-empty",
        lambda w: call(open_collection, damaged_collection(w, "m-empty", "")),
        CollectionError,
        "is empty",
        "collect again",
    ),
    (
        "manifest-a-list",
        lambda w: call(open_collection, damaged_collection(w, "m-list", "[]")),
        CollectionError,
        "holds a list",
    ),
    (
        "manifest-not-json",
        lambda w: call(open_collection, damaged_collection(w, "m-json", '{"format": 1,')),
        CollectionError,
        "not valid JSON",
    ),
    (
        "manifest-no-fingerprint",
        lambda w: call(
            open_collection,
            damaged_collection(
                w, "m-fp", lambda m: {k: v for k, v in m.items() if k != "fingerprint"}
            ),
        ),
        CollectionError,
        "lacks the model fingerprint",
    ),
    (
        "manifest-zero-chunks",
        lambda w: call(
            open_collection, damaged_collection(w, "m-zero", lambda m: {**m, "n_chunks": 0})
        ),
        CollectionError,
        "n_chunks=0",
    ),
    (
        "manifest-other-format",
        lambda w: call(
            open_collection, damaged_collection(w, "m-format", lambda m: {**m, "format": 99})
        ),
        CollectionError,
        "another version",
    ),
    (
        "collection-from-another-model",
        lambda w: lambda: open_collection(w.col.path, w.other),
        CollectionError,
        "collected from another model",
    ),
    (
        "collect-into-another-models-folder",
        lambda w: (
            lambda: collect(
                w.other,
                None,
                CollectConfig(window=W, max_tokens=4 * W),
                w.col.path,
                windows=w.ids,
                progress=False,
            )
        ),
        CollectionError,
        "collected from another model",
    ),
    (
        "collect-into-another-configs-folder",
        lambda w: (
            lambda: collect(
                w.llama,
                None,
                CollectConfig(window=W, max_tokens=2 * W),
                w.col.path,
                windows=w.ids,
                progress=False,
            )
        ),
        CollectionError,
        "another model or config",
    ),
    (
        "collect-into-a-folder-with-an-empty-manifest",
        lambda w: call(
            collect,
            w.llama,
            None,
            CollectConfig(window=W, max_tokens=4 * W),
            damaged_collection(w, "m-empty-2", ""),
            windows=w.ids,
            progress=False,
        ),
        CollectionError,
        "is empty",
    ),
    (
        "collection-layer-out-of-range",
        lambda w: lambda: w.col.layer(2),
        CollectionError,
        "layer must be a whole number in [0, 1]",
    ),
    (
        "train-on-a-list",
        lambda w: lambda: train_predictors([w.col], progress=False),
        PredictorError,
        "got a list",
    ),
    (
        "train-on-a-folder-without-manifest",
        lambda w: lambda: train_predictors(w.root / "tiny-folder", progress=False),
        CollectionError,
        "run `dejavu-lab collect`",
    ),
    (
        "train-with-a-dict-config",
        lambda w: lambda: train_predictors(w.col, {"mlp_rank": 4}, progress=False),
        PredictorError,
        "PredictorConfig",
    ),
    (
        "train-with-an-empty-training-split",
        lambda w: call(
            train_predictors,
            open_collection(damaged_collection(w, "m-one-token", lambda m: {**m, "n_tokens": 1})),
            PredictorConfig(mlp_rank=4, epochs=1),
            progress=False,
        ),
        PredictorError,
        "leaving none to train on",
    ),
]

ENGINE = [
    (
        "prefill-batch-is-not-flattened",
        lambda w: lambda: w.decoder.prefill(w.ids[:2] % 100),
        EngineError,
        "batch of 1",
        "shape (2, 8)",
    ),
    (
        "prefill-float",
        lambda w: lambda: w.decoder.prefill(w.ids[:1].float()),
        EngineError,
        "integer token ids",
    ),
    (
        "prefill-list",
        lambda w: lambda: w.decoder.prefill([1, 2, 3]),
        EngineError,
        "torch.tensor([ids])",
    ),
    (
        "prefill-out-of-vocab",
        lambda w: lambda: w.decoder.prefill(w.ids[:1] + 1000),
        EngineError,
        "tokenize with this model",
    ),
    (
        "generate-batch",
        lambda w: lambda: w.decoder.generate(w.ids[:2, :3], 2),
        EngineError,
        "batch of 1",
    ),
    (
        "generate-zero-new-tokens",
        lambda w: lambda: w.decoder.generate(w.ids[:1, :3], 0),
        EngineError,
        "max_new_tokens must be at least 1",
    ),
    (
        "generate-fractional-new-tokens",
        lambda w: lambda: w.decoder.generate(w.ids[:1, :3], 2.5),
        EngineError,
        "max_new_tokens",
    ),
    ("decode-negative", lambda w: lambda: w.decoder.decode(-1), EngineError, "n must be"),
    (
        "step-fractional-token",
        lambda w: lambda: (w.decoder.prefill(w.ids[:1, :3]), w.decoder.step(1.5)),
        EngineError,
        "token",
    ),
    (
        "max-seq-len-fractional",
        lambda w: lambda: Decoder(w.opt, max_seq_len=16.5),
        EngineError,
        "max_seq_len must be at least 2",
    ),
    (
        "max-seq-len-string",
        lambda w: lambda: Decoder(w.opt, max_seq_len="16"),
        EngineError,
        "max_seq_len",
    ),
    (
        "max-seq-len-one",
        lambda w: lambda: Decoder(w.opt, max_seq_len=1),
        EngineError,
        "max_seq_len must be at least 2",
    ),
    (
        "kv-window-fractional",
        lambda w: lambda: SparseConfig(kv_window=2.5),
        EngineError,
        "kv_window",
    ),
]


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in TOKENS]
)
def test_token_ids_and_windows(w, make, error, words):
    refuse([w.root], make(w), error, *words)


@pytest.mark.parametrize("fields,words", [pytest.param(c[1], c[2], id=c[0]) for c in CONFIGS])
def test_config_dataclasses(fields, words, tmp_path):
    cls = CollectConfig if next(iter(fields)) in CollectConfig.__dataclass_fields__ else None
    cls = cls or PredictorConfig
    error = CollectionError if cls is CollectConfig else PredictorError
    refuse([tmp_path], lambda: cls(**fields), error, words)


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in HOOKS]
)
def test_hooks(w, make, error, words):
    refuse([w.root], make(w), error, *words)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in w.llama.modules()) == 0


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in MODELS]
)
def test_model_specs_and_folders(w, make, error, words):
    refuse([w.root], make(w), error, *words)


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in FILES]
)
def test_predictor_files_and_collections(w, make, error, words):
    refuse([w.root], make(w), error, *words)


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in ENGINE]
)
def test_engine(w, make, error, words):
    refuse([w.root], make(w), error, *words)


def test_good_inputs_still_work(w):
    """The checks accept what they should: int32 ids, a Path spec, a 0-d tensor token."""
    assert perplexity(w.llama, w.ids.int(), progress=False) > 1
    assert load_model(w.folder).arch.n_layers == 2  # a pathlib.Path
    w.decoder.prefill(w.ids[:1, :3] % 100)
    w.decoder.step(torch.tensor(5))
    assert run_with_cache(w.llama, w.ids.short(), "blocks.0.hook_resid_pre")[0].shape[0] == 4
