"""Every method's sparsify path: all-kept equals dense, what is kept, and the bytes it reads."""

import pytest
import torch
from transformers.activations import ACT2FN

from dejavu_lab.collect import fingerprint
from dejavu_lab.hooks import run_with_cache
from dejavu_lab.models import random_model
from dejavu_lab.predictors import PredictorConfig, Predictors
from dejavu_lab.sparsify import (
    METHODS,
    SITES,
    Kept,
    Thresholds,
    bytes_per_token_fraction,
    calibrate,
    sparse_eval,
    sparse_perplexity,
    sparsified,
    static_sets,
)
from dejavu_lab.sparsify.core import column_norms
from dejavu_lab.step_bytes import layer_elements, site_elements
from dejavu_lab.vocab import method as method_spec


def _ids(b=2, p=16, seed=0):
    return torch.randint(0, 128, (b, p), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids, **kw):
    with sparsified(model, **kw):
        return model(input_ids=ids).logits


def _keep_all(model, method):
    """Thresholds of ``method`` at every site that keep every entry (|x| > -1)."""
    sites = ("gate",) if method == "cats" else tuple(SITES)
    n = model.config.num_hidden_layers
    keys = [(i, s) for i in range(n) for s in sites]
    return Thresholds(
        method, dict.fromkeys(keys, -1.0), dict.fromkeys(keys, 0.0), fingerprint(model)
    )


def test_every_method_is_registered():
    assert set(METHODS) >= {"dense", "oracle", "static", "dejavu", "teal", "cats", "wina"}


@pytest.mark.parametrize("method", ["teal", "wina", "cats"])
def test_all_kept_equals_dense(tiny, method):
    model, _, arch = tiny
    ids = _ids()
    dense = model(input_ids=ids).logits.detach()
    kept = Kept()
    out = _logits(model, ids, method=method, thresholds=_keep_all(model, method), kept=kept)
    assert kept.counts and all(f == 1.0 for f in kept.fractions().values())  # hooks ran
    assert torch.equal(out, dense)
    cal = calibrate(model, ids, cache=False, progress=False)
    assert torch.equal(_logits(model, ids, method=method, thresholds=cal, sparsity=0.0), dense)
    assert torch.equal(_logits(model, ids, method="dense"), dense)  # (a budget is refused)


def test_unit_methods_share_the_sparsity_budget():
    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    pred = Predictors(fingerprint(model), PredictorConfig(mode="same")).eval()
    st = static_sets(model, ids, progress=False)
    for kw in (
        dict(method="oracle"),
        dict(method="dejavu", predictors=pred),
        dict(method="static", static=st),
    ):
        record = {}
        _logits(model, ids, sparsity=0.5, record=record, **kw)
        assert (record["mlp"][1].sum(-1) == 96).all() and (record["heads"][0].sum(-1) == 2).all()
        record = {}
        _logits(model, ids, sparsity=0.5, head_sparsity=0.0, record=record, **kw)
        assert record["heads"] == {} and set(record["mlp"]) == {0, 1}
    with pytest.raises(ValueError, match="pass method= or mode=, not both"):
        _logits(model, ids, method="oracle", mode="static")
    with pytest.raises(ValueError, match="method must be one of"):
        _logits(model, ids, method="magic")


def test_teal_zeroes_exactly_the_small_inputs():
    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    t = 0.8
    thr = Thresholds("teal", {(1, "mlp_in"): t, (0, "down_in"): 0.05}, {}, fingerprint(model))
    with torch.no_grad(), sparsified(model, method="teal", thresholds=thr):
        _, c = run_with_cache(model, ids, ["blocks.0.mlp.hook_post"])
    assert (c["blocks.0.mlp.hook_post"].abs() > 0.05).eq(c["blocks.0.mlp.hook_post"] != 0).all()
    # what gate/up read in layer 1 is its (sparse-model) input with the small entries zeroed
    seen = {}
    h = arch.mlp_in(model, 1)[0].register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    try:
        with torch.no_grad(), sparsified(model, method="teal", thresholds=thr):
            _, c = run_with_cache(model, ids, ["blocks.1.ln2.hook_normalized"])
    finally:
        h.remove()
    x = c["blocks.1.ln2.hook_normalized"]  # the hook's cache sees the value after masking
    assert ((x == 0) | (x.abs() > t)).all() and (x == 0).any()
    assert torch.equal(seen["x"], x)


def test_wina_keeps_by_weighted_score():
    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    _, dense = run_with_cache(model, ids, ["blocks.0.ln1.hook_normalized"])
    x = dense["blocks.0.ln1.hook_normalized"]
    c = column_norms(model, arch, 0, "attn_in")
    t = (x.abs() * c).median().item()
    thr = Thresholds("wina", {(0, "attn_in"): t}, {}, fingerprint(model))
    want = torch.where(x.abs() * c > t, x, torch.zeros(()))
    seen = {}
    h = arch.part(model, 0, "q").register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    try:
        with torch.no_grad(), sparsified(model, method="wina", thresholds=thr):
            model(input_ids=ids)
    finally:
        h.remove()
    torch.testing.assert_close(seen["x"], want)
    assert 0 < (want == 0).float().mean() < 1


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_cats_keeps_neurons_by_gate_activation(preset):
    model, _, arch = random_model(preset)
    ids = _ids()
    t = 0.05
    thr = Thresholds("cats", {(1, "gate"): t}, {}, fingerprint(model))
    names = ["blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post"]
    _, dense = run_with_cache(model, ids, names)
    record = {}
    with torch.no_grad(), sparsified(model, method="cats", thresholds=thr, record=record):
        _, c = run_with_cache(model, ids, names)
    keep = ACT2FN[arch.activation](dense["blocks.1.mlp.hook_pre"]).abs() > t
    assert torch.equal(record["mlp"][1], keep)
    post = c["blocks.1.mlp.hook_post"]  # layer 0 is dense, so layer 1's inputs are too
    assert torch.equal(post, torch.where(keep, dense["blocks.1.mlp.hook_post"], torch.zeros(())))


def test_dense_layers_and_per_layer_sparsity_for_threshold_methods():
    model, _, _ = random_model("tiny-llama")
    ids = _ids()
    cal = calibrate(model, ids, cache=False, progress=False)
    for method in ("teal", "wina", "cats"):
        kept = Kept()
        _logits(
            model, ids, method=method, thresholds=cal, sparsity=0.5, dense_layers=[1], kept=kept
        )
        assert {k[0] for k in kept.counts} == {0}
        kept = Kept()
        _logits(model, ids, method=method, thresholds=cal, sparsity=[0.0, 0.6], kept=kept)
        assert {k[0] for k in kept.counts} == {1}


def test_bytes_per_token_by_method():
    model, _, arch = random_model("tiny-llama")
    ids = _ids(b=1)
    e, dense = site_elements(arch), layer_elements(arch)
    assert dense == e["attn_in"] + e["o_in"] + e["mlp_in"] + e["down_in"]
    assert (
        e["mlp"] == e["mlp_in"] + e["down_in"] and e["heads"] + e["kv"] == e["attn_in"] + e["o_in"]
    )
    r = sparse_eval(model, ids, method="dense", progress=False)
    assert r.bytes_per_token_fraction == 1.0 and r.kept == {}
    r = sparse_eval(
        model, ids, method="oracle", mlp_sparsity=0.5, head_sparsity=0.5, progress=False
    )
    want = 1 - (0.5 * e["mlp"] + 0.5 * e["heads"] + (1 - r.kept["kv"]) * e["kv"]) / dense
    assert r.bytes_per_token_fraction == pytest.approx(want)
    cal = calibrate(model, ids, cache=False, progress=False)
    r = sparse_eval(model, ids, method="cats", sparsity=0.5, thresholds=cal, progress=False)
    gate = r.kept["gate"]
    assert r.bytes_per_token_fraction == pytest.approx(1 - (1 - gate) * e["gate"] / dense)
    kept = Kept()
    with torch.no_grad(), sparsified(model, method="teal", sparsity=0.5, thresholds=cal, kept=kept):
        ppl = sparse_perplexity(model, ids, progress=False)  # adds no hooks of its own
    r = sparse_eval(model, ids, method="teal", sparsity=0.5, thresholds=cal, progress=False)
    saved = sum(e[site] * (1 - f) for (_, site), f in kept.fractions().items())
    assert r.bytes_per_token_fraction == pytest.approx(1 - saved / (arch.n_layers * dense))
    assert ppl > 0
    pred = Predictors(fingerprint(model), PredictorConfig(mlp_rank=8, head_rank=4)).eval()
    r = sparse_eval(model, ids, method="dejavu", predictors=pred, mlp_sparsity=0.5, progress=False)
    extra = arch.n_layers * (64 * 8 + 8 * 192)  # the MLP predictors' weights, every layer
    base = bytes_per_token_fraction(arch, {(i, "mlp"): 0.5 for i in range(arch.n_layers)})
    assert r.bytes_per_token_fraction == pytest.approx(base + extra / (arch.n_layers * dense))


def test_per_token_kept_fractions_vary_under_a_threshold():
    model, _, _ = random_model("tiny-llama")
    ids = _ids(b=2, p=16)
    cal = calibrate(model, ids, cache=False, progress=False)
    kept = Kept(per_token=True)
    r = sparse_eval(
        model, ids, method="teal", sparsity=0.5, thresholds=cal, kept=kept, progress=False
    )
    table = kept.per_token()
    assert len(table) == 2 * 4 * 32  # layers x sites x tokens
    one = table[(table.layer == 1) & (table.site == "mlp_in")]["kept"]
    assert one.std() > 0 and abs(one.mean() - r.kept["mlp_in"]) < 0.1


def test_at_bytes_reads_a_curve_by_interpolation_or_a_local_fit():
    import numpy as np
    import pandas as pd

    from dejavu_lab.report.gated import crossings
    from dejavu_lab.sparsify.frontier import at_bytes

    x = np.array([0.7, 0.62, 0.6, 0.58, 0.5])
    ppl = 10 * np.exp(2 * (1 - x))  # exactly log-linear: both readings agree
    df = pd.DataFrame(
        {
            "variant": ["dense"] + ["a"] * 5,
            "method": ["dense"] + ["teal"] * 5,
            "sparsity": [0.0, 0.3, 0.38, 0.4, 0.42, 0.5],
            "bytes_per_token_fraction": [1.0, *x],
            "perplexity": [10.0, *ppl],
        }
    )
    for window in (0.0, 0.05):
        assert at_bytes(df, [0.61], window).loc["a", 0.61] == pytest.approx(np.exp(0.78))
    bumped = df.copy()
    bumped.loc[3, "perplexity"] *= 1.1  # one noisy point at 0.6 moves the interpolation ...
    chord = at_bytes(bumped, [0.6]).loc["a", 0.6]
    fit = at_bytes(bumped, [0.6], window=0.03).loc["a", 0.6]
    assert chord == pytest.approx(1.1 * np.exp(0.8)) and np.exp(0.8) < fit < chord  # ... less
    # fewer than three points near, or none on one side: the interpolation
    assert at_bytes(bumped, [0.55], window=0.03).equals(at_bytes(bumped, [0.55]))
    assert np.isnan(at_bytes(df, [0.4], window=0.05).loc["a", 0.4])  # the curve stops at 0.5
    assert crossings(bumped, [0.6], window=0.03).loc["a", 0.6] == pytest.approx(fit)
    with pytest.raises(ValueError, match="window must be in"):
        at_bytes(df, [0.6], window=1.5)


def test_the_registry_and_the_table_name_the_same_methods():
    from dejavu_lab import vocab
    from dejavu_lab.sparsify import register

    assert set(METHODS) == set(vocab.METHODS)  # a builder for every row, a row for every builder
    with pytest.raises(ValueError, match="has no row in dejavu_lab.vocab.METHODS"):
        register("magic")


@pytest.fixture
def first_k(monkeypatch):
    """A throwaway method: the first k neurons and heads of every layer. One table row and one
    builder, both gone after the test; no other file knows it."""
    from dejavu_lab import vocab
    from dejavu_lab.sparsify import core, register

    row = vocab.Method("first-k", "unit", ("mlp", "heads"), "nothing", engine=False)
    monkeypatch.setitem(vocab.METHODS, row.name, row)
    monkeypatch.setitem(core.METHODS, row.name, None)  # the builder below; removed after

    @register(row.name)
    def first_k_hooks(ctx):
        def first(i, t, k, dim):
            return torch.arange(t.shape[dim], device=t.device) < k

        return core.unit_mask_hooks(
            ctx, lambda i, a, k: first(i, a, k, -1), lambda i, z, k: first(i, z, k, -2)
        )

    return row


def test_a_new_method_is_one_builder_and_one_row(first_k):
    from dejavu_lab.cli import perplexity, tasks
    from dejavu_lab.cli.main import parser
    from dejavu_lab.lm_eval_tasks import _sparse

    model, _, arch = random_model("tiny-llama")
    ids = _ids()
    record = {}
    _logits(model, ids, method=first_k.name, sparsity=0.5, record=record)
    assert record["mlp"][0][0, 0].tolist() == [True] * 96 + [False] * 96
    assert record["heads"][1][0, 0].tolist() == [True, True, False, False]
    # the CLI offers it and prepares what its row says it needs (nothing), for both commands
    argv = ["--method", first_k.name, "--sparsity", "0.5", "--head-sparsity", "0.25"]
    args = parser().parse_args(["perplexity", *argv])
    kw, info = perplexity.prepare(args, method_spec(first_k.name), model, None, arch)
    assert (kw["mlp_sparsity"], kw["head_sparsity"], info) == (0.5, 0.25, {})
    r = sparse_eval(model, ids, progress=False, **kw)
    assert r.method == first_k.name and r.kept == {"mlp": 0.5, "heads": 0.75, "kv": 1.0}
    kw = tasks.prepare(parser().parse_args(["eval-tasks", *argv]), model, None, arch)
    assert kw["method"] == first_k.name and kw["head_sparsity"] == 0.25
    want = _logits(model, ids, **kw)
    kw.pop("method")
    with torch.no_grad(), _sparse(model, first_k.name, kw):  # the lm-eval bridge
        assert torch.equal(model(input_ids=ids).logits, want)
    assert not torch.equal(want, _logits(model, ids, method=first_k.name, sparsity=0.5))
