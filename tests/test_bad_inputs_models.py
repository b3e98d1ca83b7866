"""Bad inputs through the public API, models and engine: a model spec or folder that is not one
(none, a number, a folder without weights, tokenizer or a shard, a truncated file, a file for a
folder) and the decode engine's shapes and settings; each is refused where it enters, with the
error type of the module it enters, in one sentence that says what to do, and no file changes.
Then the good inputs beside them still work.

Each case is ``(id, make, error, words)``: ``make(w)`` builds the call from the shared objects
``w`` (tiny random models, a tiny model folder, a collection, a predictor file, a decoder).
"""

from __future__ import annotations

import json

import pytest
import torch
from _audit import refuse
from _bad_inputs import call, copy_folder

from dejavu_lab.checks import InputError
from dejavu_lab.corpus import perplexity
from dejavu_lab.engine import Decoder, EngineError, SparseConfig
from dejavu_lab.hooks import run_with_cache
from dejavu_lab.models import ModelNotFoundError, load_model, random_model


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
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in MODELS]
)
def test_model_specs_and_folders(bad_inputs, make, error, words):
    refuse([bad_inputs.root], make(bad_inputs), error, *words)


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in ENGINE]
)
def test_engine(bad_inputs, make, error, words):
    refuse([bad_inputs.root], make(bad_inputs), error, *words)


def test_good_inputs_still_work(bad_inputs):
    """The checks accept what they should: int32 ids, a Path spec, a 0-d tensor token."""
    w = bad_inputs
    assert perplexity(w.llama, w.ids.int(), progress=False) > 1
    assert load_model(w.folder).arch.n_layers == 2  # a pathlib.Path
    w.decoder.prefill(w.ids[:1, :3] % 100)
    w.decoder.step(torch.tensor(5))
    assert run_with_cache(w.llama, w.ids.short(), "blocks.0.hook_resid_pre")[0].shape[0] == 4
