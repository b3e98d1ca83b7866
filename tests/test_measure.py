"""dejavu_lab.measure: each observation on tiny random models, with properties that can fail."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from dejavu_lab.corpus import perplexity
from dejavu_lab.hooks import run_with_cache
from dejavu_lab.measure import (
    activation_frequency,
    activation_sparsity,
    active_mask,
    active_sets,
    classify_heads,
    contextual_sparsity,
    fit_union_growth,
    head_stats,
    layer_cosine,
    mean_shift_step,
    needed_count,
    perplexity_sweep,
    random_head_perplexity,
    residual_norms,
    sparsity_at_rise,
    token_scores,
    token_trajectories,
    union_of,
    union_sparsity,
)
from dejavu_lab.models import random_model


def windows(n=3, p=24, vocab=128, seed=0):
    return torch.randint(0, vocab, (n, p), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# sparsity of one activation


def test_sparsity_of_all_zero_activation_is_one():
    z = torch.zeros(3, 5, 64)
    for crit in ("zeros", "mass"):
        assert torch.equal(activation_sparsity(z, crit), torch.ones(3, 5))
    assert not active_mask(z, "mass").any()


def test_needed_count_and_mask_agree_with_a_sort():
    a = torch.randn(50, 40)
    for mass in (0.3, 0.8, 1.0):
        k = needed_count(a.abs(), mass)
        s = a.abs().sort(-1, descending=True).values
        # k entries reach the mass, k - 1 do not
        assert (s.gather(-1, (k - 1)[:, None]).squeeze() > 0).all()
        top = s.cumsum(-1)
        assert (top.gather(-1, (k - 1)[:, None]).squeeze() >= mass * s.sum(-1) * (1 - 1e-5)).all()
        short = torch.where(k > 1, top.gather(-1, (k - 2).clamp(min=0)[:, None]).squeeze(), 0)
        assert (short < mass * s.sum(-1)).all()
        m = active_mask(a, "mass", mass=mass)
        assert torch.equal(m.sum(-1), k)
        # the kept entries are the largest ones: the smallest kept >= the largest dropped
        kept_min = torch.where(m, a.abs(), math.inf).amin(-1)
        dropped_max = torch.where(m, -math.inf, a.abs()).amax(-1)
        assert (kept_min >= dropped_max).all()


def test_zeros_and_topk_criteria():
    a = torch.tensor([[0.0, 2.0, 0.0, -1.0]])
    assert torch.equal(active_mask(a, "zeros"), torch.tensor([[False, True, False, True]]))
    assert activation_sparsity(a, "zeros").item() == 0.5
    assert activation_sparsity(a, "topk", keep=0.25).item() == 0.75
    assert active_mask(a, "topk", keep=1.0).all()
    with pytest.raises(ValueError, match="mass must be in"):
        needed_count(a.abs(), 1.5)
    with pytest.raises(ValueError, match="criterion must be one of"):
        active_mask(a, "largest")


# ---------------------------------------------------------------------------------------------
# per-layer sparsity on models


def test_contextual_sparsity_matches_a_cached_forward(tiny):
    model, _, arch = tiny
    w = windows(2, 16)
    df = contextual_sparsity(model, w, batch_size=2)
    assert len(df) == 2 * arch.n_layers * w.numel()
    relu = arch.family == "opt"  # tiny OPT models use ReLU: exact zeros
    assert df["criterion"].str.contains("exact zeros" if relu else "mass").any()
    _, cache = run_with_cache(model, w[1:], ["blocks.1.mlp.hook_post", "blocks.1.attn.hook_result"])
    got = df.query("block == 'mlp' and layer == 1 and window == 1").sort_values("pos")
    a = cache["blocks.1.mlp.hook_post"][0]
    want = (a == 0).float().mean(-1) if relu else 1 - needed_count(a.abs(), 0.9) / a.shape[-1]
    np.testing.assert_allclose(got["sparsity"], want.numpy(), atol=1e-6)
    heads = df.query("block == 'heads'")["sparsity"]
    assert heads.between(0, 1 - 1 / arch.n_heads + 1e-6).all()  # at least one head is needed


# ---------------------------------------------------------------------------------------------
# slowly changing embeddings


def test_layer_cosine_with_itself_is_one_and_matches_cache(tiny):
    model, _, arch = tiny
    w = windows(2, 12)
    df = layer_cosine(model, w, gaps=(0, 1, 2))
    self_cos = df.query("gap == 0")["cosine"]
    np.testing.assert_allclose(self_cos, 1.0, atol=1e-5)
    assert sorted(df.query("gap == 2")["layer"].unique()) == list(range(arch.n_layers + 1 - 2))
    _, cache = run_with_cache(model, w[:1], ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"])
    want = torch.cosine_similarity(
        cache["blocks.0.hook_resid_pre"][0], cache["blocks.1.hook_resid_pre"][0], dim=-1
    )
    got = df.query("gap == 1 and layer == 0 and window == 0").sort_values("pos")["cosine"]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="non-negative"):
        layer_cosine(model, w, gaps=(-1,))


def test_residual_norms_match_the_residual_identity():
    model, _, arch = random_model("tiny-llama")
    w = windows(2, 10)
    df = residual_norms(model, w)
    assert set(df["block"]) == {"attn", "mlp"} and len(df) == 2 * arch.n_layers * w.numel()
    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_attn_out", "blocks.1.hook_mlp_out"]
    _, c = run_with_cache(model, w[1:], names)
    mid = c["blocks.1.hook_resid_pre"] + c["blocks.1.hook_attn_out"]  # pre-LN residual identity
    got = df.query("block == 'mlp' and layer == 1 and window == 1").sort_values("pos")
    np.testing.assert_allclose(got["norm_x"], mid[0].norm(dim=-1).numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        got["norm_fx"], c["blocks.1.hook_mlp_out"][0].norm(dim=-1), rtol=1e-5
    )
    np.testing.assert_allclose(df["ratio"], df["norm_x"] / df["norm_fx"], rtol=1e-6)


def test_residual_norms_run_post_ln():
    model, _, _ = random_model("tiny-opt-postln")
    df = residual_norms(model, windows(1, 8))
    assert np.isfinite(df["ratio"]).all() and (df["norm_fx"] > 0).all()


# ---------------------------------------------------------------------------------------------
# heads and the mean-shift view


def test_head_stats_are_probabilities_and_norms(tiny):
    model, _, arch = tiny
    w = windows(2, 20)
    df = head_stats(model, w, min_keys=4)
    assert len(df) == arch.n_layers * arch.n_heads * 2 * (20 - 3)
    assert df["pos"].min() == 3
    assert df["entropy"].between(0, 1 + 1e-5).all()
    assert (df["peak"] >= df["sink"] - 1e-6).all() and (
        df["peak"] >= 1 / (df["pos"] + 1) - 1e-6
    ).all()
    np.testing.assert_allclose(
        df.groupby(["layer", "window", "pos"])["rel_norm"].mean(), 1, atol=1e-4
    )
    _, c = run_with_cache(model, w[:1], "blocks.0.attn.hook_result")
    want = c["blocks.0.attn.hook_result"][0, 5].norm(dim=-1)  # position 5, every head
    got = df.query("layer == 0 and window == 0 and pos == 5").sort_values("head")["norm"]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5)


def test_classify_heads_thresholds():
    stats = pd.DataFrame(
        {
            "layer": [0, 0, 0],
            "head": [0, 1, 2],
            "entropy": [0.9, 0.2, 0.9],
            "sink": [0.1, 0.1, 0.8],
            "peak": [0.1, 0.7, 0.8],
            "norm": [1.0, 5.0, 0.5],
            "rel_norm": [0.5, 2.2, 0.3],
        }
    )
    kinds = classify_heads(stats).set_index("head")["kind"]
    assert list(kinds) == ["uniform-mixing", "heavy-hitter", "sink"]


def test_mean_shift_first_token_is_its_own_mean():
    model, _, arch = random_model("tiny-llama")
    ids = windows(1, 12)
    df = mean_shift_step(model, ids, layer=1, head=2, query=7)
    # a causal head's first query sees only itself: m(x_0) = x_0
    mean = df[["mean_pc1", "mean_pc2"]].to_numpy(float)
    point = df[["pc1", "pc2"]].to_numpy(float)
    np.testing.assert_allclose(mean[0], point[0], atol=1e-4)
    assert not np.allclose(mean[11], point[11])
    assert df["weight"].iloc[:8].sum() == pytest.approx(1, abs=1e-5)
    assert df["weight"].iloc[8:].isna().all()
    traj = token_trajectories(model, ids, [0, 1, arch.n_layers])
    assert len(traj) == 3 * 12 and (traj["spread"] >= 0).all()


def test_random_head_dropping():
    model, _, arch = random_model("tiny-llama")
    w = windows(2, 16)
    dense = perplexity(model, w, progress=False)
    assert random_head_perplexity(model, w, 0.0) == pytest.approx(dense, rel=1e-6)
    assert random_head_perplexity(model, w, 0.5, seed=1) != pytest.approx(dense, rel=1e-4)
    with pytest.raises(ValueError, match="head_sparsity"):
        random_head_perplexity(model, w, 1.0)


# ---------------------------------------------------------------------------------------------
# quality sweeps


def test_sweep_at_zero_is_dense_and_thresholds_interpolate():
    model, _, _ = random_model("tiny-llama")
    w = windows(2, 16)
    sweep = perplexity_sweep(model, w, mlp=(0.0, 0.5), heads=(0.0,), modes=("oracle", "static"))
    zero = sweep.query("sparsity == 0")
    np.testing.assert_allclose(zero["rise"], 0, atol=1e-6)
    assert (sweep.query("sparsity == 0.5")["rise"].abs() > 0).all()
    curve = pd.DataFrame(
        {"target": "mlp", "mode": "oracle", "sparsity": [0.2, 0.4, 0.6], "rise": [0.0, 0.02, 0.3]}
    )
    at = sparsity_at_rise(curve, (0.01, 0.1, 0.5)).set_index("rise")
    assert at.loc[0.01, "sparsity"] == pytest.approx(0.3) and at.loc[0.01, "bracketed"]
    assert at.loc[0.1, "sparsity"] == pytest.approx(0.4 + 0.2 * 0.08 / 0.28)
    assert at.loc[0.5, "sparsity"] == 0.6 and not at.loc[0.5, "bracketed"]


# ---------------------------------------------------------------------------------------------
# union sparsity


def test_union_over_one_sequence_is_its_own_set():
    mask = torch.rand(6, 2, 50) < 0.3
    sp = union_of(mask, torch.tensor([[3], [3]]))
    np.testing.assert_allclose(sp, (1 - mask[3].float().mean(-1)).expand(2, 2))
    both = union_of(mask, torch.tensor([[3, 4]]))
    assert (both <= union_of(mask, torch.tensor([[3]]))).all()  # a union never shrinks
    want = 1 - (mask[3] | mask[4]).float().mean(-1)
    np.testing.assert_allclose(both[0], want)


def test_union_sparsity_on_a_model(tiny):
    model, _, arch = tiny
    sets = active_sets(model, windows(6, 20), positions=3, min_pos=4, mass=0.5)
    assert sets.mlp.shape == (18, arch.n_layers, arch.d_mlp)
    assert (sets.pos >= 4).all() and sets.heads.any(-1).all()
    df = union_sparsity(sets, (1, 2, 6), n_draws=8)
    singles = 1 - sets.mlp.float().mean(-1)  # [tokens, layers]
    one = df.query("block == 'mlp' and batch_size == 1 and layer == 0")["union_sparsity"]
    assert set(np.round(one, 6)) <= set(np.round(singles[:, 0].numpy(), 6))
    six = df.query("block == 'mlp' and batch_size == 6 and layer == 0")["union_sparsity"]
    assert (six <= singles[:, 0].max().item() + 1e-6).all()  # a union holds each member
    with pytest.raises(ValueError, match="at least 7 windows"):
        union_sparsity(sets, (7,))
    freq = activation_frequency(sets)
    top = freq.query("block == 'heads' and layer == 0").sort_values("rank")["frequency"]
    assert top.is_monotonic_decreasing


def test_one_pass_of_scores_serves_every_criterion():
    model, _, arch = random_model("tiny-opt")
    w = windows(4, 16)
    scores = token_scores(model, w, positions=2, min_pos=8, seed=3)
    direct = active_sets(model, w, positions=2, min_pos=8, seed=3)  # "auto": ReLU zeros
    assert torch.equal(scores.active().mlp, direct.mlp)
    assert torch.equal(scores.active().heads, direct.heads)
    assert "exact zeros" in direct.criterion["mlp"]
    top = scores.active("topk", keep=0.25)
    assert (top.mlp.sum(-1) == arch.d_mlp // 4).all()


def test_power_law_fit_recovers_the_exponent():
    b = np.array([1, 2, 4, 8, 16, 32])
    df = pd.DataFrame(
        {
            "block": "mlp",
            "layer": 0,
            "batch_size": b,
            "union_sparsity": 1 - 0.01 * b**0.5,
            "uniform": (1 - 0.01) ** b,
        }
    )
    fit = fit_union_growth(df).iloc[0]
    assert fit["alpha"] == pytest.approx(0.5) and fit["c"] == pytest.approx(0.01)
    assert fit["r2"] == pytest.approx(1.0) and 0.9 < fit["alpha_uniform"] <= 1.0
