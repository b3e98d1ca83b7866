"""The hook points input-sparsity methods act at: ln1/ln2.hook_normalized and mlp.hook_pre."""

import pytest
import torch
from transformers.activations import ACT2FN

from dejavu_lab.hooks import hooks, run_with_cache
from dejavu_lab.models import random_model

POINTS = ["ln1.hook_normalized", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post"]


def _outputs(model, arch, i, ids):
    """Each linear layer's real output in layer ``i``, from plain torch forward hooks."""
    mods = {p: arch.part(model, i, p) for p in ("q", "k", "v")}
    mods.update({f"in{j}": w for j, w in enumerate(arch.mlp_in(model, i))})
    outs, handles = {}, []
    for key, mod in mods.items():
        handles.append(mod.register_forward_hook(lambda m, a, o, key=key: outs.update({key: o})))
    try:
        _, cache = run_with_cache(model, ids, [f"blocks.{i}.{p}" for p in POINTS])
    finally:
        for h in handles:
            h.remove()
    return outs, {p: cache[f"blocks.{i}.{p}"] for p in POINTS}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt", "tiny-opt-postln"])
def test_the_points_are_the_inputs_of_the_linear_layers(preset):
    model, _, arch = random_model(preset)
    ids = torch.randint(0, 128, (2, 7))
    for i in range(arch.n_layers):
        outs, c = _outputs(model, arch, i, ids)
        x1, x2, pre, post = (c[p] for p in POINTS)
        assert x1.shape == x2.shape == (2, 7, arch.d_model) and pre.shape == post.shape
        with torch.no_grad():
            for p in ("q", "k", "v"):  # ln1 fed to q/k/v gives their outputs
                torch.testing.assert_close(arch.part(model, i, p)(x1), outs[p].view(2, 7, -1))
            w_in = arch.mlp_in(model, i)
            torch.testing.assert_close(w_in[0](x2), outs["in0"].view_as(pre))
            torch.testing.assert_close(pre, outs["in0"].view_as(pre))  # hook_pre = gate / fc1
            act = ACT2FN[arch.activation](pre)
            want = act * w_in[1](x2) if arch.gated else act
            torch.testing.assert_close(want, post)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_writing_a_point_changes_only_what_reads_it(preset):
    model, _, arch = random_model(preset)
    ids = torch.randint(0, 128, (1, 6))
    names = ["blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out", "blocks.0.mlp.hook_post"]
    _, dense = run_with_cache(model, ids, names)

    def zero(t, name):
        return torch.zeros_like(t)

    with hooks(model, {"blocks.0.ln2.hook_normalized": zero}):  # the MLP reads zeros
        _, c = run_with_cache(model, ids, names)
    torch.testing.assert_close(c["blocks.0.hook_resid_mid"], dense["blocks.0.hook_resid_mid"])
    with torch.no_grad():
        mlp_of_zero = arch.part(model, 0, "mlp_out")(c["blocks.0.mlp.hook_post"])
        if arch.gated:  # SwiGLU of a zero input is exactly zero
            assert c["blocks.0.mlp.hook_post"].abs().max() == 0
    torch.testing.assert_close(c["blocks.0.hook_mlp_out"], mlp_of_zero)
    with hooks(model, {"blocks.0.mlp.hook_pre": zero}):  # act(0) = 0 for SiLU and ReLU
        _, c = run_with_cache(model, ids, names)
    assert c["blocks.0.mlp.hook_post"].abs().max() == 0
    with hooks(model, {"blocks.*.ln1.hook_normalized": zero}):  # attention reads zeros
        _, c = run_with_cache(model, ids, ["blocks.0.hook_attn_out", "blocks.0.attn.hook_z"])
    bias = arch.part(model, 0, "v").bias
    want = 0.0 if bias is None else bias.detach().view(-1, arch.d_head)[0]  # z = mean of v = bias
    torch.testing.assert_close(
        c["blocks.0.attn.hook_z"][0, :, 0], torch.zeros(6, arch.d_head) + want
    )


def test_a_bad_replacement_is_refused():
    model, _, _ = random_model("tiny-llama")
    with pytest.raises(ValueError, match="it must keep"):
        with hooks(model, {"blocks.0.ln1.hook_normalized": lambda t, n: t[..., :3]}):
            model(input_ids=torch.tensor([[1, 2]]))
