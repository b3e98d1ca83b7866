"""Bad inputs through the public API (token ids and windows, config dataclasses, hooks; models
and the engine are in ``test_bad_inputs_models.py``): each one is refused where it enters, with the
error type of the module it enters, in one sentence that says what to do, and no file changes.

Each case is ``(id, make, error, words)``: ``make(w)`` builds the call from the shared objects
``w`` (tiny random models, a tiny model folder, a collection, a predictor file, a decoder).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _audit import refuse
from _bad_inputs import (
    W,
    replace_hook,
)

from dejavu_lab.checks.hooks import HookError
from dejavu_lab.collect import (
    CollectConfig,
    CollectionError,
    collect,
)
from dejavu_lab.corpus import CorpusError, perplexity, token_windows, window_nll
from dejavu_lab.hooks import hooks, run_with_cache, run_with_hooks
from dejavu_lab.models import load_model
from dejavu_lab.predictors import (
    PredictorConfig,
    PredictorError,
    evaluate,
)
from dejavu_lab.sparsify import sparse_perplexity

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


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in TOKENS]
)
def test_token_ids_and_windows(bad_inputs, make, error, words):
    refuse([bad_inputs.root], make(bad_inputs), error, *words)


@pytest.mark.parametrize("fields,words", [pytest.param(c[1], c[2], id=c[0]) for c in CONFIGS])
def test_config_dataclasses(fields, words, tmp_path):
    cls = CollectConfig if next(iter(fields)) in CollectConfig.__dataclass_fields__ else None
    cls = cls or PredictorConfig
    error = CollectionError if cls is CollectConfig else PredictorError
    refuse([tmp_path], lambda: cls(**fields), error, words)


@pytest.mark.parametrize(
    "make,error,words", [pytest.param(c[1], c[2], c[3:], id=c[0]) for c in HOOKS]
)
def test_hooks(bad_inputs, make, error, words):
    refuse([bad_inputs.root], make(bad_inputs), error, *words)
    assert (
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in bad_inputs.llama.modules())
        == 0
    )
