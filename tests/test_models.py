"""dejavu_lab.models and dejavu_lab.arch: the real demo model, presets, and bad specs."""

import re
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config

from dejavu_lab.arch import UnsupportedArchitectureError, get_arch
from dejavu_lab.models import PRESETS, ModelNotFoundError, load_model, random_model

ENGLISH = {
    "the",
    "a",
    "an",
    "of",
    "and",
    "to",
    "in",
    "was",
    "is",
    "as",
    "by",
    "with",
    "but",
    "it",
    "on",
    "for",
    "that",
    "he",
    "she",
    "they",
    "i",
    "his",
    "her",
    "there",
    "were",
}


@pytest.mark.slow
def test_demo_model_generates_english(demo):
    model, tokenizer, arch = demo
    assert (
        arch.family,
        arch.n_layers,
        arch.d_model,
        arch.n_heads,
        arch.n_kv_heads,
        arch.d_mlp,
    ) == ("llama", 30, 576, 9, 3, 1536)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    words = [w.lower() for w in re.findall(r"[A-Za-z']+", text)]
    assert len(words) >= 12, text
    assert sum(w in ENGLISH for w in words) / len(words) > 0.2, text


@pytest.mark.parametrize(
    "name",
    ["opt-125m", "opt-350m", "opt-6.7b", "opt-175b", "llama-2-13b", "llama-3-8b", "gemma-3-1b"],
)
def test_presets_build_on_meta_with_published_sizes(name):
    model, tok, arch = random_model(name, device="meta")
    n = sum(p.numel() for p in model.parameters())
    published = {
        "opt-125m": 125e6,
        "opt-350m": 331e6,
        "opt-6.7b": 6.7e9,
        "opt-175b": 175e9,
        "llama-2-13b": 13.0e9,
        "llama-3-8b": 8.0e9,
        "gemma-3-1b": 1.0e9,  # 999,885,952 (google/gemma-3-1b-pt)
    }[name]
    assert abs(n / published - 1) < 0.05, n
    assert tok is None and next(model.parameters()).device.type == "meta"
    shape = PRESETS[name]
    assert (arch.d_model, arch.n_layers, arch.n_heads, arch.d_mlp) == (
        shape.d_model,
        shape.n_layers,
        shape.n_heads,
        shape.d_mlp,
    )


def test_opt350m_preset_is_post_ln_with_projections():
    model, _, arch = random_model("opt-350m", device="meta")
    assert arch.pre_ln is False and model.model.decoder.project_in is not None


def test_random_spec_through_load_model_is_deterministic():
    a = load_model("random:tiny-llama").model
    b = random_model("tiny-llama").model
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelNotFoundError, match="Unknown preset 'opt-7b'.*opt-6.7b"):
        load_model("random:opt-7b")


def test_unsupported_architecture_lists_supported(tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported.*llama.*opt"):
        random_model(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        load_model(str(tmp_path))  # fails on config.json, before looking for weights


@pytest.mark.parametrize("spec", ["", "./no/such/model", "/no/such/dir"])
def test_bad_local_specs(spec):
    with pytest.raises(ModelNotFoundError, match="spec must be|not a model directory"):
        load_model(spec)


def test_unknown_hub_id_offline_is_one_sentence():
    code = (
        "from dejavu_lab.models import load_model\n"
        "try:\n    load_model('facebook/opt-nonexistent-1b')\n"
        "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ModelNotFoundError: Cannot load model 'facebook/opt-nonexistent-1b'")
    assert "offline" in line and "HF_HOME" in line and "\n" not in line


def test_arch_accessors_point_at_the_right_modules():
    model, _, arch = random_model("tiny-llama")
    assert arch.part(model, 1, "o") is model.model.layers[1].self_attn.o_proj
    gate, up = arch.mlp_in(model, 0)
    assert gate is model.model.layers[0].mlp.gate_proj and up.out_features == arch.d_mlp
    assert arch.heads_per_kv == 2
    model, _, arch = random_model("tiny-opt")
    assert arch.mlp_in(model, 0)[0] is model.model.decoder.layers[0].fc1
    assert get_arch(model.config).family == "opt"
