"""Gemma-3 adapter: sandwich norms keep the hook points' meaning; tables that do not fit refuse.

Tiny random Gemma-3 models (GeGLU, four norms per layer, q/k norms, local and global layers,
one KV head, h * d_head != d_model, scaled embeddings) with random norm gains, so a missing
``1 + weight`` or a norm put in the wrong place shows up in the identities.
"""

from dataclasses import replace

import pytest
import torch
from test_hooks import check_identities
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    Qwen3Config,
    SiglipVisionConfig,
)

from dejavu_lab import arch as arch_mod
from dejavu_lab.arch import (
    ARCH_TABLES,
    ArchMismatchError,
    UnsupportedArchitectureError,
    get_arch,
    require_plain_blocks,
)
from dejavu_lab.corpus import perplexity, token_windows, wants_bos
from dejavu_lab.hooks import hooks, run_with_cache, run_with_hooks
from dejavu_lab.measure import contextual_sparsity, head_stats, layer_cosine, residual_norms
from dejavu_lab.models import random_model
from dejavu_lab.sparsify import sparse_perplexity, sparsified, static_sets


def gemma(preset="tiny-gemma3", seed=0):
    model, tok, arch = random_model(preset, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Gemma initialises norm weights to 0 (gain 1); make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model, tok, arch


def test_tiny_gemma3_has_the_features_the_adapter_must_respect():
    model, _, arch = gemma()
    assert (arch.family, arch.model_type, arch.n_kv_heads, arch.heads_per_kv) == (
        "gemma3",
        "gemma3_text",
        1,
        4,
    )
    assert arch.n_heads * arch.d_head == 128 != arch.d_model == 64
    assert arch.gated and arch.activation == "gelu_pytorch_tanh"  # GeGLU
    assert arch.sandwich and arch.layer_types == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    )
    assert arch.sliding_window == 4 and arch.embed_scale == 8.0
    ids = torch.tensor([[3, 7, 11]])
    _, cache = run_with_cache(model, ids, "blocks.0.hook_resid_pre")
    emb = model.get_input_embeddings().weight[ids]
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], emb * 8.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_residual_identities_with_sandwich_norms(seed):
    model, _, arch = gemma(seed=seed)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))
    logits, cache = run_with_cache(model, ids)
    torch.testing.assert_close(logits, model(ids).logits)  # observing changes nothing
    # resid_post = resid_pre + attn_out + mlp_out; heads' results sum to attn_out
    check_identities(model, arch, cache, atol=1e-5)
    for i in range(arch.n_layers):  # hook_attn_out is the post-norm's output, not W_O's
        pre = cache[f"blocks.{i}.hook_resid_pre"]
        o_out = torch.einsum(
            "bphk,dhk->bpd",
            cache[f"blocks.{i}.attn.hook_z"],
            arch.part(model, i, "o").weight.view(-1, arch.n_heads, arch.d_head),
        )
        post_norm = arch.part(model, i, "ln_attn_post")
        torch.testing.assert_close(post_norm(o_out), cache[f"blocks.{i}.hook_attn_out"])
        assert not torch.allclose(o_out, cache[f"blocks.{i}.hook_attn_out"], atol=1e-3)
        ln = arch.part(model, i, "ln_attn")
        assert ln is model.model.layers[i].input_layernorm
        assert arch.part(model, i, "ln_mlp") is model.model.layers[i].pre_feedforward_layernorm
        assert pre.shape == (2, 9, 64)


def test_sliding_layers_see_only_their_window():
    model, _, arch = gemma()
    _, cache = run_with_cache(model, torch.randint(0, 128, (1, 9)), "blocks.*.attn.hook_pattern")
    for i, kind in enumerate(arch.layer_types):
        p = cache[f"blocks.{i}.attn.hook_pattern"][0]  # [h, q, k]
        far = torch.ones(9, 9, dtype=torch.bool).tril(-arch.sliding_window)  # k <= q - window
        if kind == "sliding_attention":
            assert p[:, far].abs().max() == 0
        else:
            assert p[:, far].min() > 0


def test_writable_points_replace_what_the_residual_receives():
    model, _, arch = gemma()
    ids = torch.randint(0, 128, (1, 6))
    _, cache = run_with_cache(model, ids)

    def zero(t, name):
        return torch.zeros_like(t)

    with hooks(model, {"blocks.1.hook_attn_out": zero, "blocks.1.hook_mlp_out": zero}):
        _, c2 = run_with_cache(model, ids, ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"])
    # both sub-blocks removed: the block passes its input through unchanged
    torch.testing.assert_close(c2["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_pre"])
    # zeroing every head's z removes attention's contribution (the post-norm maps 0 to 0)
    with hooks(model, {"blocks.0.attn.hook_z": zero}):
        _, c3 = run_with_cache(model, ids, ["blocks.0.hook_resid_mid", "blocks.0.hook_attn_out"])
    assert c3["blocks.0.hook_attn_out"].abs().max() == 0
    torch.testing.assert_close(c3["blocks.0.hook_resid_mid"], cache["blocks.0.hook_resid_pre"])


def test_multimodal_gemma3_wrapper_uses_its_text_model():
    text = Gemma3TextConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=128,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    arch = get_arch(model)
    assert (arch.model_type, arch.n_layers, arch.n_kv_heads) == ("gemma3", 2, 1)
    _, cache = run_with_cache(model, torch.randint(0, 100, (1, 7)))
    check_identities(model, arch, cache, atol=1e-5)


def test_qwen3_table_places_its_qk_norms():
    cfg = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        head_dim=16,
    )
    model, _, arch = random_model(cfg)
    _, cache = run_with_cache(model, torch.randint(0, 128, (1, 6)))
    check_identities(model, arch, cache, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# a table on the wrong family is refused, in one sentence, before anything runs


def test_llama_table_on_gemma3_is_refused(monkeypatch):
    model, _, arch = gemma()
    # the tempting mistake: reuse the Llama table (the module names match)
    monkeypatch.setitem(arch_mod.ARCH_TABLES, "gemma3_text", ARCH_TABLES["llama"])
    with pytest.raises(ArchMismatchError) as e:
        get_arch(model)
    msg = str(e.value)
    assert "'llama' adapter table does not fit layer 0 (Gemma3DecoderLayer)" in msg
    assert "pre_feedforward_layernorm" in msg and "post_feedforward_layernorm" in msg
    assert "\n" not in msg and msg.count(". ") == 0
    # handed over directly, the hooks refuse it before attaching anything
    bad = replace(arch, table=ARCH_TABLES["llama"])
    with pytest.raises(ArchMismatchError, match="does not fit layer 1"):
        run_with_hooks(model, torch.tensor([[1, 2]]), {"blocks.1.mlp.hook_post": print}, bad)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(
    "preset, table, match",
    [
        ("tiny-llama", "gemma3_text", "pre_feedforward_layernorm.*not norms in the layer|lacks"),
        ("tiny-llama", "opt", "'opt' adapter table .* has no 'model.decoder.layers'"),
        ("tiny-opt", "llama", "has no 'model.layers'"),
        ("tiny-gemma3", "qwen3", "post_feedforward_layernorm, pre_feedforward_layernorm"),
    ],
)
def test_tables_refuse_layers_they_do_not_describe(preset, table, match):
    model, _, arch = random_model(preset)
    with pytest.raises(ArchMismatchError, match=match):
        replace(arch, table=ARCH_TABLES[table]).check(model)


def test_the_engine_refuses_gemma3_in_one_sentence():
    from dejavu_lab.engine import Decoder

    model, _, _ = gemma()
    with pytest.raises(ValueError) as e:
        Decoder(model, max_seq_len=8)
    msg = str(e.value)
    assert "gemma3_text" in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------
# the measurements and the sparsify paths run on it


def test_oracle_and_static_sparsity_on_gemma3():
    model, _, arch = gemma()
    windows = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    dense = perplexity(model, windows, progress=False)
    assert sparse_perplexity(model, windows, progress=False) == dense
    record: dict = {}
    with sparsified(model, mlp_sparsity=0.5, head_sparsity=0.5, record=record):
        _, cache = run_with_cache(
            model, windows[:1], ["blocks.*.mlp.hook_post", "blocks.*.attn.hook_z"]
        )
    for i in range(arch.n_layers):
        assert record["mlp"][i].shape == (1, 12, arch.d_mlp)
        assert record["mlp"][i].sum(-1).eq(arch.d_mlp // 2).all()
        assert record["heads"][i].sum(-1).eq(2).all()
        post = cache[f"blocks.{i}.mlp.hook_post"]
        assert (post[~record["mlp"][i]] == 0).all()  # the removed neurons contribute nothing
        z = cache[f"blocks.{i}.attn.hook_z"]
        assert (z[~record["heads"][i]] == 0).all()
    oracle = sparse_perplexity(model, windows, mlp_sparsity=0.5, head_sparsity=0.5, progress=False)
    sets = static_sets(model, windows, mlp_sparsity=0.5, head_sparsity=0.5, progress=False)
    static = sparse_perplexity(model, windows, mode="static", static=sets, progress=False)
    assert oracle != dense and static != dense
    assert all(torch.isfinite(torch.tensor(x)) for x in (oracle, static))


def test_measurements_run_on_gemma3():
    model, _, arch = gemma()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    sp = contextual_sparsity(model, ids)
    assert set(sp.block) == {"mlp", "heads"} and sp.layer.nunique() == arch.n_layers
    norms = residual_norms(model, ids)
    assert len(norms) == arch.n_layers * 2 * ids.numel()
    cos = layer_cosine(model, ids, gaps=(1,))
    assert cos.cosine.between(-1.0001, 1.0001).all()
    stats = head_stats(model, torch.randint(0, 128, (1, 20)))  # queries 15..19 see 16+ keys
    assert stats["head"].nunique() == arch.n_heads and stats.entropy.between(0, 1.0001).all()


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-llama", "tiny-opt"])
def test_code_that_rebuilds_blocks_refuses_gemma3(preset):
    arch = random_model(preset).arch
    if preset != "tiny-gemma3":
        assert require_plain_blocks(arch, "deferred KV") is None
        return
    with pytest.raises(UnsupportedArchitectureError) as e:
        require_plain_blocks(arch, "deferred KV")
    assert str(e.value) == (
        "deferred KV runs plain pre-LN blocks, but this 'gemma3_text' model has sandwich norms "
        "and per-head q/k norms and sliding-window layers; use dejavu_lab.sparsify (the model's "
        "own forward) for quality runs on it."
    )


# ---------------------------------------------------------------------------------------------
# BOS: windows start with it when the tokenizer asks, and perplexity records it


class BosTokenizer:
    """One token per byte, BOS = 0, and asks for BOS as Gemma's tokenizer does."""

    bos_token_id = 0
    add_bos_token = True

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = ([0] if add_special_tokens else []) + list(text.encode())

        class Out:
            input_ids = torch.tensor([ids]) if return_tensors == "pt" else ids

        return Out()


def test_windows_start_with_bos_when_the_tokenizer_asks():
    tok = BosTokenizer()
    assert wants_bos(tok)
    w = token_windows(tok, "abcdefghij", window=3)  # BOS + 2 text tokens per window
    assert w.add_bos and w.tolist() == [
        [0, 97, 98],
        [0, 99, 100],
        [0, 101, 102],
        [0, 103, 104],
        [0, 105, 106],
    ]
    plain = token_windows(tok, "abcdefghij", window=3, add_bos=False)
    assert not plain.add_bos and plain.tolist()[0] == [97, 98, 99]
    model, _, _ = gemma()
    model.config.bos_token_id = 0
    ppl = perplexity(model, w[1:], progress=False)  # a slice: read from the first column
    assert ppl.add_bos and not perplexity(model, plain, progress=False).add_bos
    assert isinstance(ppl, float) and f"{ppl:.2f}" == f"{float(ppl):.2f}"


def test_deferred_kv_refuses_gemma3_in_one_sentence():
    """Deferred KV recomputes K/V outside the model: sandwich and q/k norms would be skipped."""
    from dejavu_lab.arch import UnsupportedArchitectureError
    from dejavu_lab.deferred_kv import generate

    model, _, _ = gemma()
    with pytest.raises(UnsupportedArchitectureError) as e:
        generate(model, torch.tensor([[1, 2, 3]]), 2, head_sparsity=0.5)
    msg = str(e.value)
    assert msg.startswith("deferred KV runs plain pre-LN blocks") and "\n" not in msg
