"""LaRoSA (rotated top-k) and R-Sparse (sparse + low-rank): exactness, folding, bytes, files."""

import pytest
import torch
from transformers import Qwen2Config

from dejavu_lab.errors import CalibrationError
from dejavu_lab.models import random_model
from dejavu_lab.sparsify import Kept, larosa, rsparse, sparse_eval, sparsified
from dejavu_lab.sparsify.core import site_weights
from dejavu_lab.sparsify.moments import calibrate_moments, load_moments
from dejavu_lab.step_bytes import layer_elements, site_elements
from dejavu_lab.vocab import SITES, site_width


def _ids(b=2, p=24, seed=0):
    return torch.randint(0, 128, (b, p), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen():
    """A tiny random qwen2 (GQA 4/2, q/k/v biases) with non-trivial norm gains and biases."""
    cfg = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=192, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    m = random_model(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + ("norm" in name))
    moments = calibrate_moments(m.model, _ids(2, 32, seed=3), cache=False, progress=False)
    return m, moments


@torch.no_grad()
def _logits(model, ids, **kw):
    with sparsified(model, **kw):
        return model(input_ids=ids).logits


@pytest.mark.parametrize("basis", larosa.BASES)
def test_larosa_all_kept_is_dense(qwen, basis):
    (model, _, arch), mo = qwen
    ids = _ids()
    dense = _logits(model, ids)
    for fold_gain in (True, False) if basis != "global" else (True,):
        p = larosa.plan(model, mo, 1e-6, basis=basis, score="weighted", fold_gain=fold_gain)
        assert all(sp.keep == sp.width for sp in p.sites.values())  # keeps every column
        torch.testing.assert_close(_logits(model, ids, method="larosa", thresholds=p), dense,
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


def test_rsparse_all_kept_and_full_rank_are_dense(qwen):
    (model, _, arch), mo = qwen
    ids = _ids()
    dense = _logits(model, ids)
    p = rsparse.plan(model, mo, 1e-6, lowrank=0.0)
    assert all(sp.keep == sp.width and sp.rank == 0 for sp in p.sites.values())
    assert torch.equal(_logits(model, ids, method="rsparse", thresholds=p), dense)
    # a full-rank term carries every dropped entry: x_S + P x_R = x (P the identity)
    full = {k: min(site_width(arch, k[1]), 64) for k in p.sites}
    p = rsparse.plan(model, mo, 0.9, ranks=full)
    assert all(sp.keep == 0 for (_, s), sp in p.sites.items() if s != "down_in")
    torch.testing.assert_close(_logits(model, ids, method="rsparse", thresholds=p), dense,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("basis", ["global", "layer", "site"])
def test_rotation_is_orthogonal_and_folding_keeps_the_dense_output(qwen, basis):
    (model, _, arch), mo = qwen
    p = larosa.plan(model, mo, 0.5, basis=basis)
    folded = larosa.folded_weights(model, p)
    eye = torch.eye(arch.d_model)
    x = torch.randn(5, arch.d_model)
    for i in range(arch.n_layers):
        for site, ln in (("attn_in", "ln_attn"), ("mlp_in", "ln_mlp")):
            q = folded[f"{i}.{site}.rotation"]
            torch.testing.assert_close(q.T @ q, eye, atol=1e-5, rtol=0)
            norm = arch.part(model, i, ln)
            xn = norm(x)  # what the layers read: g ⊙ u + b
            want = torch.cat([m(xn) for m in site_weights(model, arch, i, site)], -1)
            g = norm.weight.detach()
            u = xn / g  # the bare normalised vector (RMSNorm: no bias)
            got = (u @ q) @ folded[f"{i}.{site}.weight"].T
            torch.testing.assert_close(got + folded[f"{i}.{site}.bias"], want, atol=1e-4, rtol=1e-4)
        # attention's output turned per K/V group: V's rows and O's columns absorb it
        v, o = arch.part(model, i, "v"), arch.part(model, i, "o")
        xs = torch.randn(7, arch.d_model)
        vals = v(xs).reshape(7, arch.n_kv_heads, arch.d_head)  # stand-in for P V: any mix of rows
        z = vals.repeat_interleave(arch.heads_per_kv, 1)  # each query head reads its group's V
        vals2 = xs @ folded[f"{i}.v.weight"].T + folded[f"{i}.v.bias"]
        z2 = vals2.reshape(7, arch.n_kv_heads, arch.d_head).repeat_interleave(arch.heads_per_kv, 1)
        torch.testing.assert_close(z2.flatten(1) @ folded[f"{i}.o.weight"].T, o(z.flatten(1)),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


def _expected_fraction(arch, p) -> float:
    """Columns kept × column elements + extra elements, over the dense layers' elements."""
    e = site_elements(arch)
    read = 0.0
    for i in range(arch.n_layers):
        for site in SITES:
            sp = p.sites.get((i, site))
            col = e[site] / site_width(arch, site)
            read += col * (sp.keep if sp else site_width(arch, site)) + (sp.extra if sp else 0)
        read += p.layer_extra.get(i, 0.0)
    return read / (arch.n_layers * layer_elements(arch))


@pytest.mark.parametrize("method", ["larosa", "rsparse"])
def test_bytes_counted_are_what_a_kernel_reads(qwen, method):
    (model, _, arch), mo = qwen
    mod = {"larosa": larosa, "rsparse": rsparse}[method]
    p = mod.plan(model, mo, [0.6, 0.3], **({"basis": "layer"} if method == "larosa" else {}))
    kept = Kept()
    r = sparse_eval(model, _ids(), method=method, thresholds=p, progress=False, kept=kept)
    assert kept.fractions() == pytest.approx(p.kept_fractions())  # fixed counts: exact
    assert r.bytes_per_token_fraction == pytest.approx(_expected_fraction(arch, p), rel=1e-9)
    if method == "larosa":  # one d × d turn of the residual stream per layer
        assert kept.extra_elements() == 2 * arch.d_model**2
    else:  # r · (d_in + d_out) per site with a rank
        want = sum(sp.rank * (sp.width + sum(m.out_features for m in site_weights(
            model, arch, i, s))) for (i, s), sp in p.sites.items())  # fmt: skip
        assert kept.extra_elements() == want > 0


def test_rsparse_factors_give_the_low_rank_term(qwen):
    (model, _, arch), mo = qwen
    p = rsparse.plan(model, mo, 0.5, lowrank=0.5)
    f = rsparse.factors(model, p)
    sp = p.sites[(1, "mlp_in")]
    w = torch.cat([m.weight.detach() for m in site_weights(model, arch, 1, "mlp_in")])
    x = torch.randn(3, arch.d_model)
    keep = x.abs() >= x.abs().topk(sp.keep, -1).values[:, -1:]
    xs, xr = x * keep, x * ~keep
    want = w @ (xs + ((xr / sp.tensors["s"]) @ sp.tensors["b"]) @ sp.tensors["b"].T
                * sp.tensors["s"]).T  # fmt: skip
    got = w @ xs.T + f["1.mlp_in.u"] @ (f["1.mlp_in.v"] @ xr.T)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert f["1.mlp_in.u"].shape == (w.shape[0], sp.rank)


def test_moments_cached_with_the_fingerprint(tmp_path, monkeypatch, qwen):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    model = random_model("tiny-llama").model
    ids = _ids(1, 16)
    mo = calibrate_moments(model, ids, progress=False)
    assert mo.path is not None and mo.path.exists() and mo.path.parent.parent == tmp_path
    again = calibrate_moments(model, ids, progress=False)  # read back, not recomputed
    assert again.path == mo.path and torch.equal(again.sums["1.o_in"], mo.sums["1.o_in"])
    p = larosa.plan(model, again, 0.5, allocation="search")  # the search is saved beside
    (saved,) = mo.path.parent.glob("*.search-*.safetensors")
    fresh = load_moments(mo.path, model)
    fresh.ids = None  # no text to search on: the path can only come from the saved file
    assert larosa.plan(model, fresh, 0.5, allocation="search").kept_fractions() == (
        p.kept_fractions()
    )  # fmt: skip
    other = random_model("tiny-llama", seed=1).model
    with pytest.raises(CalibrationError, match="another model"):
        load_moments(mo.path, other)
    with pytest.raises(CalibrationError, match="another model"):
        larosa.plan(other, mo, 0.5)
    mo.path.write_bytes(b"broken")  # a damaged cache is recomputed, not trusted
    assert torch.equal(calibrate_moments(model, ids, progress=False).sums["0.mlp_in"],
                       mo.sums["0.mlp_in"])  # fmt: skip


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, mo: larosa.plan(m, mo, 1.0), r"sparsity must be in \[0, 1\)"),
        (lambda m, mo: rsparse.plan(m, mo, -0.1), r"sparsity must be in \[0, 1\)"),
        (lambda m, mo: rsparse.plan(m, mo, 0.5, lowrank=1.0), r"lowrank must be in \[0, 1\)"),
        (lambda m, mo: rsparse.plan(m, mo, 0.5, ranks={(0, "o_in"): -1}), "must be in 0..64"),
        (lambda m, mo: rsparse.plan(m, mo, 0.5, ranks={(0, "o_in"): 2.5}), "must be in 0..64"),
        (lambda m, mo: larosa.plan(m, mo, 0.5, basis="pca"), "basis must be one of"),
        (lambda m, mo: larosa.plan(m, mo, 0.5, allocation="greedy"), "TEAL's greedy shares"),
    ],
)
def test_bad_input_one_sentence(qwen, call, message):
    (model, _, _), mo = qwen
    with pytest.raises((ValueError, CalibrationError), match=message) as e:
        call(model, mo)
    assert str(e.value).count(". ") <= 1 and "\n" not in str(e.value)


def test_sparsified_needs_moments_or_a_plan(qwen):
    (model, _, _), mo = qwen
    with pytest.raises(ValueError, match="calibrate_moments"), sparsified(model, method="larosa",
                                                                          sparsity=0.5):  # fmt: skip
        pass
    p = rsparse.plan(model, mo, 0.5)
    with (
        pytest.raises(ValueError, match="for 'rsparse', not 'larosa'"),
        sparsified(model, method="larosa", thresholds=p),
    ):
        pass


def test_threshold_rule_keeps_the_calibrated_share(qwen):
    (model, _, _), mo = qwen
    for mod, kw in ((larosa, {"basis": "global"}), (rsparse, {"lowrank": 0.0})):
        p = mod.plan(model, mo, 0.5, rule="threshold", **kw)
        assert all(sp.threshold is not None for sp in p.sites.values())
        kept = Kept()
        sparse_eval(model, mo.ids, method=p.method, thresholds=p, progress=False, kept=kept)
        for (i, site), f in kept.fractions().items():  # layer 0 sees the dense inputs
            if i == 0:
                assert f == pytest.approx(0.5, abs=0.03), site


def test_search_allocation_spends_the_layer_budget(qwen):
    (model, _, arch), mo = qwen
    p = larosa.plan(model, mo, 0.4, allocation="search", basis="global")
    shares = {k: 1 - f for k, f in p.kept_fractions().items()}
    assert len(set(round(v, 2) for v in shares.values())) > 1  # not uniform
    r = sparse_eval(model, _ids(), method="larosa", thresholds=p, progress=False)
    assert r.bytes_per_token_fraction == pytest.approx(0.6, abs=0.02)  # a global basis is free


def test_attention_output_rotation_folds_into_teal(qwen):
    import copy

    from dejavu_lab.collect import fingerprint
    from dejavu_lab.sparsify import Thresholds

    (model, _, _), mo = qwen
    p = larosa.plan(model, mo, 0.5, basis="none", rule="threshold")
    ids = _ids()
    want = _logits(model, ids, method="larosa", thresholds=p)
    folded = copy.deepcopy(model)
    thr = larosa.fold_into(folded, p)
    torch.testing.assert_close(_logits(folded, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    teal = Thresholds("teal", thr, {}, fingerprint(folded))
    got = _logits(folded, ids, method="teal", thresholds=teal)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="only plans with basis='none'"):
        larosa.fold_into(folded, larosa.plan(model, mo, 0.5))
