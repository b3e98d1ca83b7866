"""The byte model's 4-bit format against the bytes the format itself holds (Int4Weight)."""

import pytest
import torch

from dejavu_lab.models import random_model
from dejavu_lab.quant import quantize
from dejavu_lab.quant.swap import decoder_linears
from dejavu_lab.step_bytes import groups_touched, step_bytes

# the matrices each threshold site's input feeds (Llama parts)
SITE_PARTS = {"attn_in": ("q", "k", "v"), "o_in": ("o",), "mlp_in": ("gate", "up"),
              "down_in": ("down",)}  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    model, _, arch = random_model("tiny-llama")
    mods = dict(model.named_modules())
    return arch, {
        key: mods[name].weight.detach() for name, key in decoder_linears(model, arch).items()
    }


def _layer_bytes(b):
    return b["attention"] + b["mlp"]


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_dense_int4_is_the_formats_nbytes(tiny, group, scale_dtype):
    arch, weights = tiny
    q = {k: quantize(w.T, group=group, dtype=scale_dtype) for k, w in weights.items()}
    esize = torch.finfo(scale_dtype).bits // 8
    b = step_bytes(arch, vocab=0, context=0, int4_group=group, scale_esize=esize)
    assert _layer_bytes(b) == sum(w.nbytes for w in q.values())


def test_threshold_masks_count_codes_and_touched_groups_exactly(tiny):
    arch, weights = tiny
    group = 32
    q = {k: quantize(w.T, group=group, dtype=torch.float16) for k, w in weights.items()}
    g = torch.Generator().manual_seed(0)
    kept, touched, read = {}, {}, 0.0
    for i in range(arch.n_layers):
        for site, parts in SITE_PARTS.items():
            width = q[(i, parts[0])].shape[0]
            # a skewed mask: some channels nearly always kept, as real activations do
            p = torch.rand(width, generator=g) ** 3
            mask = torch.rand(16, width, generator=g) < p  # 16 tokens
            kept[(i, site)] = float(mask.double().mean())
            touched[(i, site)] = groups_touched(mask, group)
            for part in parts:
                w = q[(i, part)]
                # per token: the kept channels' codes plus the scales of each group with one
                groups = mask.reshape(16, -1, group).any(-1).sum(-1).double()
                per_token = mask.sum(-1).double() * w.row_bytes + groups * w.group_bytes
                read += float(per_token.mean())
    b = step_bytes(arch, kept, vocab=0, context=0, int4_group=group, touched=touched)
    assert _layer_bytes(b) == pytest.approx(read, rel=1e-12)


def test_independence_estimate_matches_random_masks(tiny):
    arch, _ = tiny
    g = torch.Generator().manual_seed(1)
    for f in (0.02, 0.1, 0.5):
        mask = torch.rand(4000, 192, generator=g) < f
        assert groups_touched(mask, 64) == pytest.approx(groups_touched(f, 64), abs=0.01)
    half = dict.fromkeys(SITE_PARTS, 0.5)
    exact = {s: 1.0 for s in SITE_PARTS}  # at 50% kept every group of 32 is touched (1 - 2^-32)
    est = step_bytes(arch, vocab=0, context=0, int4_group=32, site_kept=half)
    given = step_bytes(arch, vocab=0, context=0, int4_group=32, site_kept=half, touched=exact)
    assert _layer_bytes(est) == pytest.approx(_layer_bytes(given), rel=1e-9)


def test_kept_rows_carry_their_scales(tiny):
    """DejaVu's neurons: W_gate/W_up rows (each output owns its scales) + W_down columns."""
    arch, weights = tiny
    q = {k: quantize(w.T, group=64, dtype=torch.float16) for k, w in weights.items()}
    f = 0.25
    b = step_bytes(arch, {"mlp": f}, vocab=0, context=0, int4_group=64)
    read = 0.0
    for i in range(arch.n_layers):
        for part in ("gate", "up"):
            read += f * q[(i, part)].nbytes  # a kept neuron's row: codes and its own scales
        down = q[(i, "down")]
        groups = down.shape[0] // 64  # W_down's input channels are the neurons
        read += (
            f * down.shape[0] * down.row_bytes + groups_touched(f, 64) * groups * down.group_bytes
        )
    assert b["mlp"] == pytest.approx(read, rel=1e-12)


def test_fp16_unchanged_and_bad_input():
    arch = random_model("tiny-llama").arch
    assert step_bytes(arch, vocab=8, context=4) == step_bytes(arch, vocab=8, context=4, touched={})
    with pytest.raises(ValueError, match="fraction in"):
        groups_touched(1.5, 32)
    with pytest.raises(ValueError, match="groups of 32"):
        groups_touched(torch.ones(2, 40, dtype=torch.bool), 32)
