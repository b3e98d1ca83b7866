"""load_model on GGUF files (a file, or a folder holding one) for every family the GGUF reader has.

Tiny random Llama and Gemma-3 models are written as fp32 GGUF files here (llama.cpp's tensor
names, its q/k row order for Llama and its ``1 + weight`` norms for Gemma, a byte-level
tokenizer), then read back through :func:`dejavu_lab.models.load_model`; the real demo GGUF is
read from a folder too.
"""

import os

import gguf
import numpy as np
import pytest
import torch

from dejavu_lab import assets
from dejavu_lab.arch import UnsupportedArchitectureError
from dejavu_lab.corpus import token_windows
from dejavu_lab.models import DEMO_ASSET, ModelNotFoundError, gguf_file, load_model, random_model


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE), indexed by byte."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_gguf(model, path, add_bos: bool = False) -> None:
    """``model`` (tiny Llama or Gemma-3) as an fp32 GGUF file laid out as llama.cpp writes it."""
    cfg = model.config
    gemma = cfg.model_type == "gemma3_text"
    arch = gguf.MODEL_ARCH.GEMMA3 if gemma else gguf.MODEL_ARCH.LLAMA
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base((rope["full_attention"] if gemma else rope)["rope_theta"])
    if gemma:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    tokens = _byte_alphabet()[: cfg.vocab_size - 3] + ["<unk>", "<bos>", "<eos>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    w.add_unk_token_id(len(tokens) - 3)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(add_bos)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf, t in model.state_dict().items():
        if cfg.tie_word_embeddings and hf == "lm_head.weight":
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        a = t.detach().float().numpy()
        if gemma and "norm" in hf:
            a = a + 1  # llama.cpp stores Gemma's norm gains as 1 + weight
        if not gemma and (".attn_q." in name or ".attn_k." in name):  # llama.cpp's rope rows
            h = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            a = a.reshape(h, 2, a.shape[0] // h // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder: the tiny GGUFs' conversions stay out of the real cache."""
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path / "cache"))


def tiny(preset):
    # GGUF carries neither Gemma-3's query_pre_attn_scalar nor its layer pattern: transformers
    # reads them as the real models' values (256; five local layers to one global), so the
    # tiny model uses those here
    kw = dict(query_pre_attn_scalar=256, layer_types=["sliding_attention"] * 3)
    model, _, arch = random_model(preset, **(kw if preset == "tiny-gemma3" else {}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model, arch


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("as_folder", [True, False], ids=["folder", "file"])
def test_gguf_file_or_folder_loads_the_same_model(cache, tmp_path, preset, as_folder):
    model, arch = tiny(preset)
    write_gguf(model, tmp_path / "tiny.Q8_0.gguf")
    spec = tmp_path if as_folder else tmp_path / "tiny.Q8_0.gguf"  # pathlib.Path works too
    got, tokenizer, got_arch = load_model(spec)
    assert got_arch == arch and next(got.parameters()).dtype == torch.float32
    ids = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert tokenizer("ab c").input_ids == [97, 98, 32, 99]  # byte-level: a, b, space, c


def test_gguf_tokenizer_asking_for_bos_gets_it_in_windows(cache, tmp_path):
    model, _ = tiny("tiny-gemma3")
    write_gguf(model, tmp_path / "g.gguf", add_bos=True)
    _, tokenizer, _ = load_model(str(tmp_path / "g.gguf"))
    w = token_windows(tokenizer, "abcdefgh " * 8, window=8)
    assert w.add_bos and (w[:, 0] == tokenizer.bos_token_id).all()


def test_bad_gguf_specs_are_one_sentence(cache, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="holds neither config.json nor a .gguf file"):
        load_model(str(tmp_path / "empty"))
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"x")
    (two / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); pass"):
        load_model(str(two))
    with pytest.raises(ModelNotFoundError, match="Cannot read .* as a GGUF model.*magic"):
        load_model(str(two / "a.gguf"))
    model, _ = tiny("tiny-llama")
    write_gguf(model, tmp_path / "ok.gguf")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "m.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes()[:3000])  # truncated
    with pytest.raises(ModelNotFoundError, match="check that the file is complete") as e:
        load_model(str(cut))
    assert "\n" not in str(e.value)
    (cut / "config.json").write_text("{}")  # a Hugging Face folder: not read as a GGUF
    assert gguf_file("facebook/opt-125m") is None and gguf_file(cut) is None


def test_gguf_of_an_architecture_we_have_no_table_for(cache, tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")  # transformers reads it; we don't
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        load_model(tmp_path)


@pytest.mark.slow
def test_folder_holding_only_the_demo_gguf(tmp_path, demo):
    gguf_path = assets.fetch(DEMO_ASSET)
    os.symlink(gguf_path, tmp_path / gguf_path.name)
    model, tokenizer, arch = load_model(str(tmp_path))
    demo_model, demo_tok, demo_arch = demo
    assert arch == demo_arch
    text = "The fire crossed the highway near Hill Top on Sunday."
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, demo_tok(text, return_tensors="pt").input_ids)
    with torch.no_grad():  # the demo model is this GGUF dequantised: the same weights
        torch.testing.assert_close(model(ids).logits, demo_model(ids).logits)
