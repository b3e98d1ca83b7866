"""dejavu_lab.hooks: canonical names, the residual identities per adapter, clean-up, writes."""

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from dejavu_lab.hooks import HOOK_POINTS, hook_names, hooks, run_with_cache, run_with_hooks
from dejavu_lab.models import random_model


def n_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def check_identities(model, arch, cache, atol):
    for i in range(arch.n_layers):
        c = {p: cache[f"blocks.{i}.{p}"] for p in HOOK_POINTS}
        pre, attn, mid, mlp, post = (
            c["hook_resid_pre"],
            c["hook_attn_out"],
            c["hook_resid_mid"],
            c["hook_mlp_out"],
            c["hook_resid_post"],
        )
        if arch.pre_ln:
            torch.testing.assert_close(pre + attn, mid, atol=atol, rtol=0)
            torch.testing.assert_close(mid + mlp, post, atol=atol, rtol=0)
            torch.testing.assert_close(pre + attn + mlp, post, atol=atol, rtol=0)
        else:  # post-LN OPT: the block's own norms sit after each residual add
            ln_attn, ln_mlp = arch.part(model, i, "ln_attn"), arch.part(model, i, "ln_mlp")
            torch.testing.assert_close(ln_attn(pre + attn), mid, atol=atol, rtol=0)
            torch.testing.assert_close(ln_mlp(mid + mlp), post, atol=atol, rtol=0)
        bias = arch.part(model, i, "o").bias
        heads = c["attn.hook_result"].sum(-2) + (0 if bias is None else bias)
        torch.testing.assert_close(heads, attn, atol=atol, rtol=0)
        p = c["attn.hook_pattern"]
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))
        assert p.triu(1).abs().max() == 0  # causal
        z = c["attn.hook_z"]
        assert z.shape == (*pre.shape[:2], arch.n_heads, arch.d_head)
        assert c["mlp.hook_post"].shape == (*pre.shape[:2], arch.d_mlp)
        if i + 1 < arch.n_layers:
            torch.testing.assert_close(post, cache[f"blocks.{i + 1}.hook_resid_pre"])


def test_residual_identities_on_every_tiny_adapter(tiny):
    model, _, arch = tiny
    ids = torch.randint(0, 128, (2, 9))
    logits, cache = run_with_cache(model, ids)
    assert set(cache) == set(hook_names(arch))
    check_identities(model, arch, cache, atol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [
        MistralConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=128,
        ),
        Qwen2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=128,
            vocab_size=128,
        ),
    ],
    ids=["mistral", "qwen2"],
)
def test_llama_family_members_share_the_table(cfg):
    model, _, arch = random_model(cfg)
    _, cache = run_with_cache(model, torch.randint(0, 128, (1, 6)))
    check_identities(model, arch, cache, atol=1e-5)


@pytest.mark.slow
def test_residual_identities_on_the_demo_model(demo):
    model, tokenizer, arch = demo
    ids = tokenizer(
        "The fire crossed the highway near Hill Top on Sunday.", return_tensors="pt"
    ).input_ids
    _, cache = run_with_cache(model, ids)
    check_identities(model, arch, cache, atol=1e-3)


def test_selected_names_match_the_full_cache():
    model, _, arch = random_model("tiny-opt")
    ids = torch.randint(0, 128, (1, 5))
    _, full = run_with_cache(model, ids)
    for name in [
        "blocks.1.mlp.hook_post",
        "blocks.0.hook_resid_mid",
        "blocks.1.hook_mlp_out",
        "blocks.0.attn.hook_result",
        "blocks.1.hook_resid_post",
    ]:
        _, one = run_with_cache(model, ids, names=name)
        assert list(one) == [name]
        torch.testing.assert_close(one[name], full[name])
    _, some = run_with_cache(model, ids, names=lambda n: n.endswith("hook_z"))
    assert list(some) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]


def test_hooks_are_removed_on_exit_and_on_error():
    model, _, _ = random_model("tiny-llama")
    before = n_hooks(model)
    run_with_cache(model, torch.tensor([[1, 2, 3]]))
    assert n_hooks(model) == before

    def boom(t, name):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        run_with_hooks(model, torch.tensor([[1, 2, 3]]), {"blocks.1.mlp.hook_post": boom})
    assert n_hooks(model) == before


def test_streaming_reduction_sees_every_token_without_caching():
    model, _, arch = random_model("tiny-llama")
    ids = torch.randint(0, 128, (3, 8))
    sums = {}

    def reduce(t, name):
        sums[name] = sums.get(name, 0) + t.abs().sum().item()

    run_with_hooks(model, ids, {"blocks.*.mlp.hook_post": reduce})
    _, cache = run_with_cache(model, ids, names="blocks.*.mlp.hook_post")
    assert sums == pytest.approx({k: v.abs().sum().item() for k, v in cache.items()})


def test_writable_hooks_replace_activations():
    model, _, arch = random_model("tiny-opt")
    ids = torch.randint(0, 128, (1, 6))
    dense = model(ids).logits
    same = run_with_hooks(model, ids, {"blocks.*.mlp.hook_post": lambda t, n: t.clone()})
    torch.testing.assert_close(same, dense, atol=0, rtol=0)
    seen = {}
    with hooks(
        model,
        {
            "blocks.0.mlp.hook_post": lambda t, n: torch.zeros_like(t),
            "blocks.0.hook_mlp_out": lambda t, n: seen.setdefault("out", t),
        },
    ):
        zeroed = model(ids).logits
    fc2_bias = arch.part(model, 0, "mlp_out").bias
    torch.testing.assert_close(seen["out"], fc2_bias.expand_as(seen["out"]))
    assert not torch.allclose(zeroed, dense)
    with pytest.raises(ValueError, match="read-only"):
        run_with_hooks(model, ids, {"blocks.0.attn.hook_result": lambda t, n: t * 2})
    with pytest.raises(ValueError, match="must keep"):
        run_with_hooks(model, ids, {"blocks.0.attn.hook_z": lambda t, n: t[..., :1]})


def test_unknown_name_says_what_names_look_like():
    model, _, _ = random_model("tiny-llama")
    with pytest.raises(KeyError, match="blocks.0.mlp.hook_post"):
        run_with_cache(model, torch.tensor([[1]]), names="blocks.7.mlp.hook_post")


def test_pattern_switches_sdpa_to_eager_and_back():
    model, _, _ = random_model("tiny-llama")
    model.set_attn_implementation("sdpa")
    _, cache = run_with_cache(model, torch.tensor([[1, 2, 3, 4]]), names="*.attn.hook_pattern")
    assert cache["blocks.0.attn.hook_pattern"].shape == (1, 4, 4, 4)
    assert model.config._attn_implementation == "sdpa"


def test_hooks_follow_kv_cached_generation():
    model, _, arch = random_model("tiny-llama")
    shapes = []
    with hooks(model, {"blocks.0.mlp.hook_post": lambda t, n: shapes.append(tuple(t.shape))}):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert shapes == [(1, 3, arch.d_mlp), (1, 1, arch.d_mlp), (1, 1, arch.d_mlp)]
