"""Bad-input audit: through the public API and the CLI, each mistake a user can make gets one
clear sentence (an error type and a message saying what is wrong and what to do), and leaves
caches, predictor files and recorded results exactly as they were.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _audit import log
from transformers import GPT2Config

from dejavu_lab import results
from dejavu_lab.arch import UnsupportedArchitectureError
from dejavu_lab.assets import AssetError, fetch
from dejavu_lab.cli.main import main as cli
from dejavu_lab.collect import fingerprint
from dejavu_lab.corpus import CorpusError, load_text, token_windows
from dejavu_lab.hooks import run_with_cache, run_with_hooks
from dejavu_lab.kernels import sparse_attention, sparse_mlp_down, sparse_mlp_up
from dejavu_lab.models import ModelNotFoundError, load_model, random_model
from dejavu_lab.predictors import PredictorConfig, PredictorError, Predictors, load_predictors
from dejavu_lab.sparsify import sparse_perplexity, sparsified


def one_sentence(exc: BaseException) -> str:
    msg = str(exc).strip("'\"")
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    assert len(msg) < 400, msg
    log(type(exc).__name__, msg)
    return msg


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny-llama")


# ----------------------------------------------------------------------------- models, arch


@pytest.mark.parametrize(
    "spec,error,words",
    [
        ("", ModelNotFoundError, "non-empty string"),
        ("./missing-model-dir", ModelNotFoundError, "not a model directory"),
        ("random:opt-7b", ModelNotFoundError, "Unknown preset 'opt-7b'"),
    ],
)
def test_bad_model_specs(spec, error, words):
    with pytest.raises(error) as e:
        load_model(spec)
    assert words in one_sentence(e.value)


def test_unknown_hub_model_offline_through_the_cli():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dejavu_lab.cli",
            "perplexity",
            "--model",
            "facebook/opt-nonexistent-1b",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("dejavu-lab: error: Cannot load model 'facebook/opt-nonexistent-1b'")
    assert "offline" in err and "HF_HOME" in err


def test_unsupported_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(str(tmp_path))
    assert "supported model types are" in one_sentence(e.value)


# ----------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("value", [-0.1, 1.0, math.nan, 1.5, [0.5, 0.5, 0.5]])
def test_budgets_outside_zero_one(tiny, value):
    model, _, _ = tiny
    with pytest.raises(ValueError) as e:
        with sparsified(model, mlp_sparsity=value):
            pass
    assert "[0, 1)" in one_sentence(e.value) or "layers" in one_sentence(e.value)


def test_bad_sparsity_mode(tiny):
    with pytest.raises(ValueError) as e:
        with sparsified(tiny.model, mlp_sparsity=0.5, mode="magic"):
            pass
    assert "mode must be one of" in one_sentence(e.value)


def test_static_mode_without_static_sets(tiny):
    with pytest.raises(ValueError) as e:
        with sparsified(tiny.model, mlp_sparsity=0.5, mode="static"):
            pass
    assert "static_sets" in one_sentence(e.value)


@pytest.mark.parametrize("flag", ["1.0", "-0.1", "nan"])
def test_budget_through_the_cli(flag, capsys):
    code = cli(["perplexity", "--model", "demo", "--mlp-sparsity", flag, "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0 and err.startswith("dejavu-lab: error:") and "[0, 1)" in err


# ----------------------------------------------------------------------------- text


def test_empty_text_and_short_text(demo_tokenizer):
    with pytest.raises(CorpusError) as e:
        token_windows(demo_tokenizer, "", window=512)
    assert "the text is empty" in one_sentence(e.value)
    with pytest.raises(CorpusError) as e:
        token_windows(demo_tokenizer, "A short sentence.", window=512)
    assert "pass a longer text or a smaller window" in one_sentence(e.value)


def test_unknown_corpus():
    with pytest.raises(CorpusError) as e:
        load_text("the-pile")
    assert "choose one of" in one_sentence(e.value)


def test_corpus_shorter_than_a_window_through_sparse_perplexity(tiny):
    with pytest.raises(CorpusError) as e:
        sparse_perplexity(tiny.model, torch.zeros(0, 8, dtype=torch.long), mlp_sparsity=0.5)
    one_sentence(e.value)


@pytest.fixture(scope="module")
def demo_tokenizer(demo):
    return demo[1]


# ----------------------------------------------------------------------------- hooks


def test_unknown_hook_name(tiny):
    with pytest.raises(KeyError) as e:
        run_with_cache(tiny.model, torch.tensor([[1, 2]]), names="blocks.0.mlp.hook_gate")
    assert "use names like" in one_sentence(e.value)


def test_writing_a_read_only_hook(tiny):
    with pytest.raises(ValueError) as e:
        run_with_hooks(
            tiny.model, torch.tensor([[1, 2]]), {"blocks.0.hook_resid_mid": lambda t, n: t + 1}
        )
    assert "read-only" in one_sentence(e.value)


# ----------------------------------------------------------------------------- kernels


def mlp_inputs(dtype=torch.float16, n=64, d=32):
    x = torch.randn(d, dtype=dtype)
    w = torch.randn(n, d, dtype=dtype)
    return x, w, torch.tensor([3, 1, 7], dtype=torch.int64)


@pytest.mark.parametrize(
    "case,words",
    [
        ("fp32", "float16 or bfloat16"),
        ("mixed dtype", "dtype"),
        ("shape", "shape"),
        ("range", "must lie in [0, 63]"),
        ("duplicate", "duplicate"),
        ("float index", "int"),
        ("device", "is on meta but the input is on cpu"),
    ],
)
def test_sparse_mlp_up_rejects(case, words):
    x, w, idx = mlp_inputs()
    if case == "fp32":
        x, w = x.float(), w.float()
    elif case == "mixed dtype":
        w = w.to(torch.bfloat16)
    elif case == "shape":
        w = w[:, :16]
    elif case == "range":
        idx = torch.tensor([3, 64])
    elif case == "duplicate":
        idx = torch.tensor([3, 3])
    elif case == "float index":
        idx = idx.float()
    elif case == "device":
        w = w.to("meta")
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        sparse_mlp_up(x, w, idx)
    assert words.lower() in one_sentence(e.value).lower()


def test_sparse_mlp_down_rejects_wrong_activation_length():
    h = torch.randn(5, dtype=torch.float16)
    w_t = torch.randn(64, 32, dtype=torch.float16)
    with pytest.raises((ValueError, TypeError)) as e:
        sparse_mlp_down(h, w_t, torch.tensor([1, 2, 3]))
    one_sentence(e.value)


def test_sparse_attention_rejects_out_of_range_heads():
    n_heads, dh, d, ctx = 4, 8, 32, 6
    x = torch.randn(1, d, dtype=torch.float16)
    w_qkv = torch.randn(3 * n_heads * dh, d, dtype=torch.float16)
    w_o_t = torch.randn(n_heads * dh, d, dtype=torch.float16)
    k = torch.randn(1, n_heads, ctx + 1, dh, dtype=torch.float16)
    seqlens = torch.tensor([ctx], dtype=torch.int32)
    with pytest.raises((ValueError, TypeError)) as e:
        sparse_attention(
            x, w_qkv, w_o_t, k, k.clone(), seqlens, torch.tensor([0, 9]), n_heads=n_heads
        )
    one_sentence(e.value)


# ----------------------------------------------------------------------------- files


def test_truncated_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    bad = tmp_path / "lee_background.cor"
    bad.write_text("Hundreds of people")  # a download cut short
    before = digest(bad)
    with pytest.raises(AssetError) as e:
        fetch("lee_background.cor")
    assert "corrupt" in one_sentence(e.value) and digest(bad) == before


@pytest.fixture
def predictor_file(tmp_path, tiny):
    model, _, arch = tiny
    return Predictors(fingerprint(model, arch), PredictorConfig()).save(tmp_path / "p.safetensors")


def test_truncated_predictor_file(predictor_file, tiny):
    data = predictor_file.read_bytes()
    predictor_file.write_bytes(data[: len(data) // 2])
    before = digest(predictor_file)
    with pytest.raises(PredictorError) as e:
        load_predictors(predictor_file, tiny.model)
    assert "truncated or damaged" in one_sentence(e.value)
    assert digest(predictor_file) == before


def test_predictor_file_from_another_model(predictor_file):
    before = digest(predictor_file)
    other = random_model("tiny-opt").model
    with pytest.raises(PredictorError) as e:
        load_predictors(predictor_file, other)
    assert "another model" in one_sentence(e.value) and digest(predictor_file) == before


def test_missing_predictor_file(tmp_path):
    with pytest.raises(PredictorError) as e:
        load_predictors(tmp_path / "none.safetensors")
    assert "train" in one_sentence(e.value)


@pytest.mark.parametrize(
    "content,words",
    [
        ({"rows": [{"ms": 1.0}]}, "no 'provenance'"),
        ({"provenance": {"gpu": "H200"}, "rows": [{"ms": 1.0}]}, "provenance lacks"),
        ("{not json", "not valid JSON"),
    ],
)
def test_results_files_with_missing_provenance(tmp_path, monkeypatch, content, words):
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    path = tmp_path / "bench.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    before = digest(path)
    with pytest.raises(results.ResultsError) as e:
        results.load("bench")
    assert words in one_sentence(e.value) and digest(path) == before


def test_results_name_must_be_bare(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    with pytest.raises(ValueError) as e:
        results.save("../escape", [{"ms": 1.0}], command="test")
    assert "bare name" in one_sentence(e.value) and list(tmp_path.iterdir()) == []
