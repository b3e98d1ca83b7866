"""Refit (least-squares weights for thresholded inputs) on CPU: hooks, cache, engine.

The fit is checked against what it promises on a real small model's activations: with every
entry kept it is the identity (so the model is dense), on the calibration text it lowers each
site's reconstruction error ‖x − R x_m‖ below the plain mask's, the bytes a token reads do not
change with it, it refuses thresholds it was not fitted under and a damaged cache file, and the
engine running ``W R`` through its threshold kernels gives the hooks' logits.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from _hf import kv_forward

from dejavu_lab.bench.timing import relerr  # noqa: E402
from dejavu_lab.engine import Decoder, EngineError, SparseConfig, decoder_weights, fold_refit  # noqa: E402
from dejavu_lab.errors import CalibrationError, InputError  # noqa: E402
from dejavu_lab.hooks import run_with_cache  # noqa: E402
from dejavu_lab.models import load_model, random_model  # noqa: E402
from dejavu_lab.sparsify import calibrate, sparse_eval, sparsified  # noqa: E402
from dejavu_lab.sparsify.core import site_weights  # noqa: E402
from dejavu_lab.sparsify.frontier import (  # noqa: E402
    evaluate_point,
    parse_variant,
    prepare,
    study_windows,
)
from dejavu_lab.sparsify.refit import (  # noqa: E402
    Refit,
    apply,
    default_path,
    fit_refit,
    folded_weights,
    load_refit,
)
from dejavu_lab.sparsify.refit_shares import TILTS, choose_tilt, tilt  # noqa: E402
from dejavu_lab.step_bytes import site_elements  # noqa: E402
from dejavu_lab.vocab import SITES  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    """The demo model (SmolLM2-135M), calibration windows and TEAL's thresholds at 50%."""
    model, tok, arch = load_model("demo")
    ids, _ = study_windows(tok, "demo", 64, 1, 192, 192)  # 3 windows of the demo text
    cal = calibrate(model, ids, cache=False, progress=False)
    th = cal.thresholds("teal", 0.5)
    return model, arch, ids, th, th.site_thresholds(model, arch)


@pytest.fixture(scope="module")
def fitted(demo):
    model, arch, ids, _, thr = demo
    return fit_refit(model, ids, thr, cache=False, progress=False)


def test_keeping_everything_fits_the_identity(demo):
    model, arch, ids, _, thr = demo
    keep_all = {k: -1.0 for k in thr}  # |x| > -1: every entry kept
    r = fit_refit(model, ids[:1], keep_all, cache=False, progress=False)
    for (i, site), m in r.maps.items():
        assert torch.allclose(m, torch.eye(m.shape[0]), atol=1e-4), (i, site)


def test_the_fit_lowers_the_error_it_minimises(demo, fitted):
    """At layer 0's attention input — the very vectors it was fitted on, nothing sparse
    upstream — ‖x − R x_m‖² is below the plain mask's ‖x − x_m‖² (R = I is a candidate of the
    ridge fit at no penalty). Deeper sites are fitted on the sparse model's inputs, which the
    dense inputs here are not, so only layer 0 is held to it."""
    model, arch, ids, _, thr = demo
    names = [f"blocks.{i}.{SITES[s]}" for (i, s) in fitted.maps]
    _, cache = run_with_cache(model, ids, names=names)
    for (i, site), r in fitted.maps.items():
        if (i, site) != (0, "attn_in"):
            continue
        x = cache[f"blocks.{i}.{SITES[site]}"].float()
        x = x.reshape(*x.shape[:2], -1)
        xm = x * (x.abs() > torch.as_tensor(thr[(i, site)]))
        plain = float((x - xm).pow(2).sum())
        refit = float((x - apply(r, xm, "mlp_in")).pow(2).sum())
        assert 0 < refit < 0.5 * plain  # 0.25 on the demo model's text


def test_refit_keeps_the_bytes_and_helps_the_model(demo, fitted):
    model, arch, ids, th, _ = demo
    base = sparse_eval(model, ids, method="teal", thresholds=th, progress=False)
    ref = sparse_eval(model, ids, method="teal", thresholds=th, refit=fitted, progress=False)
    assert ref.perplexity < base.perplexity  # on its calibration text
    assert abs(ref.bytes_per_token_fraction - base.bytes_per_token_fraction) < 0.03


def test_a_refit_is_refused_where_it_does_not_belong(demo, fitted):
    model, arch, ids, th, _ = demo
    cal = calibrate(model, ids, cache=False, progress=False)
    with pytest.raises(CalibrationError, match="other thresholds"):
        with sparsified(model, method="teal", thresholds=cal.thresholds("teal", 0.4),
                        refit=fitted):  # fmt: skip
            pass
    with pytest.raises(InputError, match="does not use refit"):
        with sparsified(model, method="oracle", sparsity=0.5, refit=fitted):
            pass
    with pytest.raises(TypeError, match="must be a Refit"):
        with sparsified(model, method="teal", thresholds=th, refit={"maps": {}}):
            pass
    other = random_model("tiny-llama").model
    with pytest.raises(CalibrationError, match="another model"):
        fitted.check(other, {})


def test_the_cache_round_trips_and_a_damaged_file_is_refitted(demo, tmp_path, monkeypatch):
    model, arch, ids, _, thr = demo
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    a = fit_refit(model, ids[:1], thr, progress=False)
    assert a.path is not None and a.path.exists() and a.path.parent.parent == tmp_path
    assert load_refit(a.path, model).maps.keys() == a.maps.keys()
    b = fit_refit(model, ids[:1], thr, progress=False)  # read back from the cache
    assert all(torch.equal(a.maps[k], b.maps[k]) for k in a.maps)
    a.path.write_bytes(b"not a safetensors file")
    with pytest.raises(CalibrationError, match="truncated or damaged"):
        load_refit(a.path, model)
    c = fit_refit(model, ids[:1], thr, progress=False)  # recomputed and rewritten
    assert all(torch.equal(a.maps[k], c.maps[k]) for k in a.maps)
    assert default_path(a.fingerprint, a.text_sha, a.thresholds_sha, 1.0) == a.path


def test_folded_weights_are_the_hooks_product(demo, fitted):
    model, arch, *_ = demo
    folded = folded_weights(model, fitted, arch)
    (i, site), r = next(iter(sorted(fitted.maps.items())))
    x = torch.randn(5, r.shape[0])
    for lin, w2 in zip(site_weights(model, arch, i, site), folded[(i, site)], strict=True):
        want = apply(r, x[None], site)[0].float() @ lin.weight.float().T
        assert relerr(x @ w2.float().T, want) < 1e-2


def test_refit_variants_parse():
    name, spec = parse_variant("wina+layers+refit")
    assert name == "wina (greedy, layers, refit)" and spec["refit"] is True
    with pytest.raises(ValueError, match="applies to teal and wina"):
        parse_variant("cats+refit")


def test_tilted_variants_parse_and_need_a_refit():
    name, spec = parse_variant("wina+layers+refit+tilt")
    assert name == "wina (greedy, layers, refit, tilted)" and spec["tilt"] and spec["refit"]
    with pytest.raises(ValueError, match="moves sparsity for a refit"):
        parse_variant("teal+layers+tilt")


def test_the_tilt_moves_sparsity_to_down_in_at_equal_bytes(demo):
    model, arch, ids, th, _ = demo
    cal = calibrate(model, ids, cache=False, progress=False)
    four = ("attn_in", "o_in", "mlp_in", "down_in")  # a layer's input sites
    w = {s: site_elements(arch)[s] for s in four}
    for t in (0.05, 0.1):
        tt = tilt(th, cal, arch, t)
        assert tt.info["tilt"] == t
        for i in range(arch.n_layers):
            before = sum(w[s] * th.sparsity.get((i, s), 0.0) for s in w)
            after = sum(w[s] * tt.sparsity.get((i, s), 0.0) for s in w)
            assert after == pytest.approx(before, abs=1e-6 * sum(w.values()))
            assert tt.sparsity[(i, "down_in")] > th.sparsity[(i, "down_in")]
        # measured on the text, the model reads the same bytes within a few thousandths
        a = sparse_eval(model, ids[:1], method="teal", thresholds=th, progress=False)
        b = sparse_eval(model, ids[:1], method="teal", thresholds=tt, progress=False)
        assert abs(a.bytes_per_token_fraction - b.bytes_per_token_fraction) < 0.02
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        tilt(th, cal, arch, 1.0)


def test_the_tilt_is_chosen_on_calibration_text_and_recorded(demo):
    model, arch, ids, th, _ = demo
    cal = calibrate(model, ids, cache=False, progress=False)
    t, ppl = choose_tilt(model, ids, th, cal, tilts=(0.0, 0.1))
    assert set(ppl) == {0.0, 0.1} and ppl[t] == min(ppl.values())
    with pytest.raises(ValueError, match="at least 2 windows"):
        choose_tilt(model, ids[:1], th, cal)
    name, spec = parse_variant("teal+refit+tilt")
    ready = prepare(model, None, spec, ids, arch=arch)
    row = evaluate_point(model, ids[:1], name, spec, 0.5, ready)
    assert row["variant"] == "teal (greedy, refit, tilted)" and row["tilt"] in TILTS


# --- the engine -------------------------------------------------------------------------------

N_PROMPT, N = 8, 14


@pytest.fixture(scope="module")
def tiny():
    m = random_model("tiny-llama", dtype=torch.float16, seed=11)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (4, 32), generator=g)
    cal = calibrate(m.model, ids, cache=False, progress=False)
    th = cal.thresholds("wina", 0.5, sites=("attn_in", "o_in", "mlp_in"))  # the refitted sites
    thr = th.site_thresholds(m.model, m.arch)
    return m, th, thr, fit_refit(m.model, ids, thr, cache=False, progress=False)


def _decode(dec, ids):
    out = [dec.prefill(ids[:, :N_PROMPT])]
    out += [dec.step(int(t)) for t in ids[0, N_PROMPT:]]
    return torch.cat(out)


@torch.no_grad()
def _hooks(model, ids, th, refit):
    """The prompt and each later token through the hooks (the engine masks a refit's prefill)."""
    with sparsified(model, method="wina", thresholds=th, refit=refit):
        out, past = kv_forward(model, ids[:, :N_PROMPT])
        logits = [out[0, -1:]]
        for t in ids[0, N_PROMPT:]:
            out, past = kv_forward(model, t.view(1, 1), past)
            logits.append(out[0, -1:])
    return torch.cat(logits)


@pytest.mark.parametrize("layout", ["columns", "both"])  # WINA reads columns
def test_the_engine_runs_a_refit_as_the_hooks_do(tiny, monkeypatch, layout):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' PyTorch references
    m, th, thr, refit = tiny
    ids = torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(1))
    w = fold_refit(decoder_weights(m.model, layout=layout), refit, thr)
    dec = Decoder(w, max_seq_len=N + 2, sparse=SparseConfig(method="wina", thresholds=thr))
    got, want = _decode(dec, ids), _hooks(m.model, ids, th, refit)
    plain = _hooks(m.model, ids, th, None)
    assert set(w.prefill_masks) == set(refit.maps) == set(thr)
    assert relerr(got, want) < 2e-2
    assert relerr(plain, want) > 3 * relerr(got, want)  # the refit changes the logits


def test_the_engine_refuses_a_refit_it_cannot_fold(tiny):
    m, *_ = tiny
    w = decoder_weights(m.model)
    with pytest.raises(EngineError, match="fitted for another model"):
        fold_refit(w, Refit({}, "", "", 1.0, {(0, "attn_in"): torch.eye(8)}), {(0, "attn_in"): 0})
    with pytest.raises(EngineError, match="must be a Refit"):
        fold_refit(w, {(0, "attn_in"): torch.eye(64)}, {})
    with pytest.raises(EngineError, match="thresholds lack"):
        fold_refit(w, Refit({}, "", "", 1.0, {(0, "attn_in"): torch.eye(64)}), {})
