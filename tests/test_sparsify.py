"""dejavu_lab.sparsify: oracle / static / predicted contextual sparsity through hooks."""

import math

import pytest
import torch

from dejavu_lab.corpus import CorpusError
from dejavu_lab.hooks import run_with_cache
from dejavu_lab.models import random_model
from dejavu_lab.sparsify import (
    budgets,
    head_gram,
    head_output_norms,
    n_keep,
    sparse_perplexity,
    sparsified,
    static_sets,
    topk_mask,
)


def _ids(vocab=128, b=2, p=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, p), generator=g)


@torch.no_grad()
def _logits(model, ids, **kw):
    with sparsified(model, **kw):
        return model(input_ids=ids).logits


def test_zero_sparsity_is_exactly_dense(tiny):
    model, _, arch = tiny
    ids = _ids()
    dense = model(input_ids=ids).logits.detach()
    assert torch.equal(_logits(model, ids), dense)
    assert torch.equal(_logits(model, ids, mlp_sparsity=0.0, head_sparsity=0.0), dense)
    assert torch.equal(_logits(model, ids, mlp_sparsity=[0.0] * arch.n_layers), dense)


def test_topk_at_k_all_reproduces_dense(tiny):
    model, _, arch = tiny
    ids = _ids()
    dense = model(input_ids=ids).logits.detach()
    # sparsities that round to removing nothing: the hooks run, every unit is kept
    tiny_s = 0.4 / max(arch.d_mlp, arch.n_heads)
    record = {}
    out = _logits(model, ids, mlp_sparsity=tiny_s, head_sparsity=tiny_s, record=record)
    assert record["mlp"] and record["heads"]  # the maskers really ran
    assert all(m.all() for m in record["mlp"].values())
    assert torch.equal(out, dense)
    assert topk_mask(torch.randn(3, 7), 7).all()


def test_masking_changes_output_and_keeps_the_largest(tiny):
    model, _, arch = tiny
    ids = _ids()
    dense = model(input_ids=ids).logits.detach()
    _, cache = run_with_cache(model, ids, ["blocks.0.mlp.hook_post", "blocks.0.attn.hook_z"])
    record = {}
    out = _logits(model, ids, mlp_sparsity=0.5, record=record)
    assert (out - dense).abs().max() > 1e-6
    # layer 0's MLP sees dense inputs, so its oracle set is the top half of the dense |act|
    keep = record["mlp"][0]
    k = n_keep(0.5, arch.d_mlp)
    assert (keep.sum(-1) == k).all()
    a = cache["blocks.0.mlp.hook_post"].abs()
    kth = a.topk(k, dim=-1).values[..., -1:]
    assert (a[keep] >= kth.expand_as(a)[keep] - 1e-6).all()
    record = {}
    out = _logits(model, ids, head_sparsity=0.5, record=record)
    assert (out - dense).abs().max() > 1e-6
    heads = record["heads"][0]
    assert (heads.sum(-1) == n_keep(0.5, arch.n_heads)).all()
    norms = head_output_norms(cache["blocks.0.attn.hook_z"], head_gram(model, arch, 0))
    assert torch.equal(heads, topk_mask(norms, n_keep(0.5, arch.n_heads)))


def test_head_norms_match_hook_result():
    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    _, cache = run_with_cache(model, ids, ["blocks.1.attn.hook_z", "blocks.1.attn.hook_result"])
    ours = head_output_norms(cache["blocks.1.attn.hook_z"], head_gram(model, arch, 1))
    ref = cache["blocks.1.attn.hook_result"].norm(dim=-1)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_one_masked_neuron_by_hand():
    """Zeroing one neuron of the last layer moves the logits by exactly its W2 column."""
    model, _, arch = random_model("tiny-opt")
    ids = _ids(b=1, p=4)
    _, cache = run_with_cache(model, ids, ["blocks.1.mlp.hook_post"])
    a = cache["blocks.1.mlp.hook_post"][0, -1]  # [n]
    j = int(a.abs().argmin())  # the smallest |activation|: the first to go
    s = 1.0 / arch.d_mlp  # removes exactly one neuron per token
    assert n_keep(s, arch.d_mlp) == arch.d_mlp - 1
    with torch.no_grad(), sparsified(model, mlp_sparsity=[0.0, s]):
        _, sparse_cache = run_with_cache(model, ids, ["blocks.1.hook_mlp_out"])
    _, dense_cache = run_with_cache(model, ids, ["blocks.1.hook_mlp_out"])
    w2 = arch.part(model, 1, "mlp_out").weight  # [d, n]
    delta = (
        dense_cache["blocks.1.hook_mlp_out"][0, -1] - sparse_cache["blocks.1.hook_mlp_out"][0, -1]
    )
    torch.testing.assert_close(delta, a[j] * w2[:, j], rtol=1e-4, atol=1e-6)


def test_dense_layers_and_per_layer_budgets():
    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    record = {}
    _logits(
        model, ids, mlp_sparsity=[0.5, 0.75], head_sparsity=0.5, dense_layers=[0], record=record
    )
    assert set(record["mlp"]) == {1} and set(record["heads"]) == {1}
    assert (record["mlp"][1].sum(-1) == n_keep(0.75, arch.d_mlp)).all()
    # every layer dense == dense model
    dense = model(input_ids=ids).logits.detach()
    out = _logits(model, ids, mlp_sparsity=0.9, head_sparsity=0.5, dense_layers=[0, -1])
    assert torch.equal(out, dense)


def test_static_mode_keeps_one_set_for_every_token():
    model, _, arch = random_model("tiny-opt")
    windows = _ids(b=3, p=16, seed=1)
    st = static_sets(model, windows, mlp_sparsity=0.5, head_sparsity=0.25, progress=False)
    assert st.n_tokens == 48 and st.mlp_score.shape == (arch.n_layers, arch.d_mlp)
    assert (st.mlp_keep().sum(-1) == n_keep(0.5, arch.d_mlp)).all()
    assert (st.head_keep(0.5).sum(-1) == n_keep(0.5, arch.n_heads)).all()
    record = {}
    _logits(model, _ids(), mode="static", static=st, record=record)  # the set's own budget
    m = record["mlp"][1]
    assert (m == m[0, 0]).all() and torch.equal(m[0, 0], st.mlp_keep()[1])
    h = record["heads"][0]
    assert (h.sum(-1) == n_keep(0.25, arch.n_heads)).all() and (h == h[0, 0]).all()


def test_sparse_perplexity_orders_dense_oracle():
    model, _, _ = random_model("tiny-llama")
    windows = _ids(b=2, p=16)
    dense = sparse_perplexity(model, windows, progress=False)
    same = sparse_perplexity(model, windows, mlp_sparsity=0.0, progress=False)
    sparse = sparse_perplexity(model, windows, mlp_sparsity=0.9, head_sparsity=0.5, progress=False)
    assert dense == same and math.isfinite(sparse) and sparse != dense


@pytest.mark.parametrize(
    "bad, msg",
    [
        (-0.1, r"in \[0, 1\)"),
        (1.0, r"in \[0, 1\)"),
        (float("nan"), r"in \[0, 1\)"),
        (float("inf"), r"in \[0, 1\)"),
        (True, r"in \[0, 1\)"),
        ("0.5", "must be a number"),
        ([0.5], "has 1 entries but the model has 2 layers"),
        ([0.5, 1.5], "at layer 1"),
        (None, "must be a number"),
    ],
)
def test_bad_budgets(bad, msg):
    with pytest.raises(ValueError, match=msg):
        budgets(bad, 2, "mlp_sparsity")


def test_bad_arguments_are_one_clear_sentence():
    model, _, _ = random_model("tiny-opt")
    with pytest.raises(ValueError, match=r"mlp_sparsity must be in \[0, 1\)"):
        with sparsified(model, mlp_sparsity=1.0):
            pass
    with pytest.raises(ValueError, match="head_sparsity has 3 entries"):
        with sparsified(model, head_sparsity=[0.1, 0.2, 0.3]):
            pass
    with pytest.raises(ValueError, match="mode must be one of"):
        with sparsified(model, mode="magic"):
            pass
    with pytest.raises(ValueError, match="needs static="):
        with sparsified(model, mode="static"):
            pass
    with pytest.raises(ValueError, match="needs predictors="):
        with sparsified(model, mode="predicted"):
            pass
    with pytest.raises(ValueError, match="dense_layers must hold layer indices"):
        with sparsified(model, dense_layers=[5]):
            pass
    with pytest.raises(CorpusError, match="non-empty LongTensor"):
        sparse_perplexity(model, torch.zeros(0, 8, dtype=torch.long))


def test_hooks_are_removed_after_the_block():
    model, _, _ = random_model("tiny-opt")
    ids = _ids()
    dense = model(input_ids=ids).logits.detach()
    with pytest.raises(RuntimeError, match="boom"):
        with sparsified(model, mlp_sparsity=0.9):
            raise RuntimeError("boom")
    assert torch.equal(model(input_ids=ids).logits.detach(), dense)


# deferred KV (§4.2) ----------------------------------------------------------------------


def _random_predictors(model, arch, mode):
    from dejavu_lab.collect import fingerprint
    from dejavu_lab.predictors import PredictorConfig, Predictors

    torch.manual_seed(1)  # untrained predictors: arbitrary but deterministic head choices
    return Predictors(fingerprint(model, arch), PredictorConfig(mode=mode, head_rank=8)).eval()


@pytest.mark.parametrize("mode", ["same", "lookahead"])
def test_deferred_kv_equals_recomputing_the_same_masks(tiny, mode):
    from dejavu_lab.deferred_kv import generate

    model, _, arch = tiny
    pred = _random_predictors(model, arch, mode)
    prompt = _ids(b=1, p=5, seed=3)
    kw = dict(predictors=pred, mlp_sparsity=0.5, head_sparsity=0.5)
    gen = generate(model, prompt, 8, **kw)
    assert gen.skipped > 0 and gen.recomputed > 0  # heads really were deferred, then filled
    assert torch.isfinite(gen.logits).all()  # a missing (NaN) entry was never read
    # from scratch: one full forward over the final tokens with the same predicted masks
    with torch.no_grad(), sparsified(model, mode="predicted", **kw):
        full = model(input_ids=gen.tokens).logits[:, prompt.shape[1] - 1 : -1]
    torch.testing.assert_close(gen.logits, full, rtol=1e-4, atol=1e-5)
    dense_kv = generate(model, prompt, 8, deferred=False, **kw)
    assert torch.equal(dense_kv.tokens, gen.tokens) and dense_kv.skipped == 0


def test_deferred_kv_with_every_head_selected_is_dense():
    from dejavu_lab.deferred_kv import generate

    model, _, arch = random_model("tiny-llama")
    pred = _random_predictors(model, arch, "lookahead")
    prompt = _ids(b=1, p=4, seed=5)
    gen = generate(model, prompt, 6, predictors=pred, head_sparsity=0.0)
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(gen.tokens, ref) and gen.skipped == 0


def test_generate_needs_a_selector():
    from dejavu_lab.deferred_kv import generate

    model, _, _ = random_model("tiny-opt")
    with pytest.raises(ValueError, match="exactly one of predictors= or static="):
        generate(model, _ids(b=1, p=3), 2, head_sparsity=0.5)


def test_lm_eval_missing_is_a_clear_error(monkeypatch):
    import sys

    from dejavu_lab.lm_eval_tasks import LmEvalError, lm_eval_tasks

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    model, _, _ = random_model("tiny-opt")
    with pytest.raises(LmEvalError, match="pip install"):
        lm_eval_tasks(model, None, mlp_sparsity=0.5)


def test_static_sets_of_another_model_are_refused():
    from dejavu_lab.sparsify import sparsified, static_sets

    small = random_model("tiny-llama").model
    sets = static_sets(small, torch.randint(0, 128, (2, 16)), progress=False)
    sets.mlp_score, sets.head_score = sets.mlp_score[:1], sets.head_score[:1]  # a 1-layer model's
    with pytest.raises(ValueError, match="static sets have 1 layers but the model has 2"):
        with sparsified(small, method="static", static=sets):
            pass
