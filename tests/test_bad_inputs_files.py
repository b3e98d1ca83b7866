"""Damaged files through the public API: a predictor file or a collection edited, emptied or
from another model is refused where it is opened, with the error type of the module it enters,
in one sentence that says what to do, and nothing on disk changes. Cases as in
``test_bad_inputs_api``: ``(id, make, error, words)``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _audit import refuse
from _bad_inputs import (
    W,
    call,
    damaged_collection,
    damaged_predictor_file,
    empty_file,
    with_tensor,
)

from dejavu_lab.collect import (
    CollectConfig,
    CollectionError,
    collect,
    open_collection,
)
from dejavu_lab.predictors import (
    PredictorConfig,
    PredictorError,
    load_predictors,
    train_predictors,
)


def collect_again(w, model, max_tokens: int):
    """Collect from ``model`` into the good collection's folder (``max_tokens`` of it)."""
    config = CollectConfig(window=W, max_tokens=max_tokens)
    return collect(model, None, config, w.col.path, windows=w.ids, progress=False)


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
        lambda w: call(load_predictors, empty_file(w)),
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
        lambda w: lambda: collect_again(w, w.other, 4 * W),
        CollectionError,
        "collected from another model",
    ),
    (
        "collect-into-another-configs-folder",
        lambda w: lambda: collect_again(w, w.llama, 2 * W),
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


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in FILES]
)
def test_predictor_files_and_collections(bad_inputs, make, error, words):
    refuse([bad_inputs.root], make(bad_inputs), error, *words)
