"""dejavu_lab.sparsify.calibration / greedy: histograms, thresholds, cache, files, greedy paths."""

import os

import pytest
import torch
from transformers.activations import ACT2FN

from dejavu_lab.collect import fingerprint
from dejavu_lab.hooks import run_with_cache
from dejavu_lab.models import random_model
from dejavu_lab.sparsify import SITES, Kept, sparsified
from dejavu_lab.sparsify.calibration import (
    KINDS,
    CalibrationConfig,
    CalibrationError,
    Thresholds,
    calibrate,
    default_path,
    load_calibration,
    load_thresholds,
)
from dejavu_lab.sparsify.core import column_norms
from dejavu_lab.sparsify.greedy import _run_layer, greedy_path, layer_inputs
from dejavu_lab.sparsify.histogram import bucket, quantile
from dejavu_lab.step_bytes import site_elements


def _ids(b=2, p=32, seed=0):
    return torch.randint(0, 128, (b, p), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    return tmp_path


def test_histogram_quantiles_match_torch():
    cfg = CalibrationConfig()
    x = torch.randn(200_000).abs() * 3
    hist = torch.bincount(bucket(x, cfg), minlength=cfg.bins + 2).double()
    for s in (0.1, 0.25, 0.5, 0.7, 0.9):
        t = quantile(hist, s, cfg)
        assert abs((x <= t).float().mean().item() - s) < 0.002
        assert abs(t / torch.quantile(x, s).item() - 1) < 0.01
    zeros = torch.cat([torch.zeros(1000), torch.rand(1000) + 1])  # ReLU-like: half exact zeros
    hz = torch.bincount(bucket(zeros, cfg), minlength=cfg.bins + 2).double()
    assert quantile(hz, 0.3, cfg) == 0.0  # inside the zeros: keep every nonzero


def _dense_scores(model, arch, ids, method):
    """Every (layer, site) score of the dense model on ``ids``, the slow way."""
    names = [f"blocks.{i}.{p}" for i in range(arch.n_layers) for p in SITES.values()]
    names += [f"blocks.{i}.mlp.hook_pre" for i in range(arch.n_layers)]
    _, c = run_with_cache(model, ids, names)
    out = {}
    for i in range(arch.n_layers):
        if method == "cats":
            g = c[f"blocks.{i}.mlp.hook_pre"]
            out[(i, "gate")] = ACT2FN[arch.activation](g).abs().flatten()
            continue
        for site, point in SITES.items():
            x = c[f"blocks.{i}.{point}"].abs()
            x = x.reshape(*x.shape[:2], -1)
            if method == "wina":
                x = x * column_norms(model, arch, i, site)
            out[(i, site)] = x.flatten()
    return out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("method", ["teal", "wina", "cats"])
def test_thresholds_meet_their_target_on_the_calibration_text(preset, method):
    model, _, arch = random_model(preset)
    ids = _ids()
    cal = calibrate(model, ids, cache=False, progress=False)
    scores = _dense_scores(model, arch, ids, method)
    for s in (0.3, 0.5, 0.8):
        thr = cal.thresholds(method, s)
        assert set(thr.values) == set(scores)
        for key, t in thr.values.items():
            removed = (scores[key] <= t).float().mean().item()
            zeros = (scores[key] == 0).float().mean().item()
            if zeros >= s:  # ReLU: more exact zeros than the target; t = 0 removes just them
                assert t == 0.0 and removed == zeros
                continue
            assert abs(removed - s) <= 0.01, (key, s, removed)


def test_applied_thresholds_remove_the_target_share():
    """Under the whole method, what each site removes on the calibration text (layer 0 sees
    dense inputs: exact; later layers drift with the sparsity upstream)."""
    model, _, arch = random_model("tiny-llama")
    ids = _ids(b=4)
    cal = calibrate(model, ids, cache=False, progress=False)
    for method in ("teal", "wina", "cats"):
        kept = Kept()
        with (
            torch.no_grad(),
            sparsified(model, method=method, sparsity=0.5, thresholds=cal, kept=kept),
        ):
            model(input_ids=ids)
        fr = kept.fractions()
        first = (0, "gate") if method == "cats" else (0, "attn_in")
        assert abs(fr[first] - 0.5) <= 0.01
        assert all(abs(f - 0.5) <= 0.05 for f in fr.values()), fr


def test_per_layer_budgets_dense_layers_and_sites():
    model, _, _ = random_model("tiny-llama")
    cal = calibrate(model, _ids(), cache=False, progress=False)
    thr = cal.thresholds("teal", [0.2, 0.6], dense_layers=[0])
    assert {k[0] for k in thr.values} == {1} and thr.sparsity[(1, "o_in")] == 0.6
    only = cal.thresholds("wina", 0.5, sites=["mlp_in", "down_in"])
    assert {k[1] for k in only.values} == {"mlp_in", "down_in"}
    with pytest.raises(CalibrationError, match="teal sites are"):
        cal.thresholds("teal", 0.5, sites=["gate"])
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        cal.thresholds("teal", 1.0)
    with pytest.raises(CalibrationError, match="no greedy allocation for teal"):
        cal.thresholds("teal", 0.5, allocation="greedy")


def test_site_thresholds_are_what_the_engine_takes():
    """TEAL and CATS: one float per site, unchanged on its way to the engine; WINA: a tensor
    ``t / ||W[:, i]||`` per input column. The engine's config takes the dict as it is."""
    from dejavu_lab.engine import Decoder, SparseConfig

    model, _, arch = random_model("tiny-llama")
    cal = calibrate(model, _ids(), cache=False, progress=False)
    teal = cal.thresholds("teal", 0.5)
    wina = cal.thresholds("wina", 0.5)
    wv = wina.site_thresholds(model)
    cats = cal.thresholds("cats", 0.5).site_thresholds(model)
    widths = {"attn_in": 64, "o_in": 64, "mlp_in": 64, "down_in": 192}
    assert teal.site_thresholds(model) == teal.values and len(teal.values) == 8
    for (i, site), t in teal.values.items():
        assert isinstance(t, float)
        c = column_norms(model, arch, i, site)
        assert wv[(i, site)].shape == (widths[site],)
        torch.testing.assert_close(wv[(i, site)] * c, torch.full_like(c, wina.values[(i, site)]))
    assert set(cats) == {(0, "gate"), (1, "gate")} and isinstance(cats[(0, "gate")], float)
    for method, thr, site in (("teal", teal.values, "mlp_in"), ("wina", wv, "mlp_in"),
                              ("cats", cats, "gate")):  # fmt: skip
        cfg = SparseConfig(method=method, thresholds=thr)
        assert cfg.thresholds[(0, site)] is thr[(0, site)]  # no copy, no conversion
        Decoder(model.half(), max_seq_len=8, sparse=cfg)  # the engine builds on them as given


def test_cache_is_keyed_by_model_text_and_config(cache):
    model, _, _ = random_model("tiny-llama")
    ids = _ids()
    a = calibrate(model, ids, progress=False)
    assert a.path == default_path(fingerprint(model), a.text_sha, CalibrationConfig())
    assert a.path.exists() and a.path.parent == cache / "calibration"
    b = calibrate(model, ids, progress=False)  # loaded, not recomputed
    assert torch.equal(a.hist["teal"], b.hist["teal"])
    c = calibrate(model, _ids(seed=1), progress=False)
    d = calibrate(model, ids, CalibrationConfig(bins=512), progress=False)
    e = calibrate(random_model("tiny-llama", seed=3).model, ids, progress=False)
    assert len({a.path, c.path, d.path, e.path}) == 4
    assert not [p for p in os.listdir(cache / "calibration") if "partial" in p]
    # a greedy path with other greedy settings lands in the same file, beside the first
    g1 = calibrate(model, ids, CalibrationConfig(greedy_max=0.2), greedy=["teal"], progress=False)
    g2 = calibrate(model, ids, CalibrationConfig(greedy_max=0.3), greedy=["teal"], progress=False)
    assert g1.path == g2.path == a.path
    assert len(load_calibration(a.path).greedy) == 2


def test_files_round_trip_and_refuse_another_model(tmp_path):
    model, _, arch = random_model("tiny-llama")
    cal = calibrate(
        model,
        _ids(),
        CalibrationConfig(greedy_max=0.2),
        greedy=["wina"],
        cache=False,
        progress=False,
    )
    back = load_calibration(cal.save(tmp_path / "c.safetensors"), model)
    assert back.text_sha == cal.text_sha and back.n_tokens == 64
    for k in KINDS:
        assert torch.equal(back.hist[k], cal.hist[k])
    assert torch.equal(back.greedy_table("wina"), cal.greedy_table("wina"))
    thr = cal.thresholds("wina", 0.15, allocation="greedy")
    t2 = load_thresholds(thr.save(tmp_path / "t.safetensors"), model)
    assert t2.method == "wina" and t2.allocation == "greedy" and set(t2.values) == set(thr.values)
    for k in thr.values:
        assert abs(t2.values[k] - thr.values[k]) <= 1e-6 * max(1.0, abs(thr.values[k]))
    other = random_model("tiny-llama", seed=7).model
    for load, path in ((load_calibration, "c"), (load_thresholds, "t")):
        with pytest.raises(CalibrationError, match="for another model") as e:
            load(tmp_path / f"{path}.safetensors", other)
        assert "\n" not in str(e.value) and str(e.value).endswith(".")
    with pytest.raises(CalibrationError, match="for another model"):
        with sparsified(other, method="wina", thresholds=t2):
            pass
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "c.safetensors").read_bytes()[:500])
    with pytest.raises(CalibrationError, match="truncated or damaged"):
        load_calibration(cut)
    with pytest.raises(CalibrationError, match="not a dejavu-lab calibration"):
        load_calibration(tmp_path / "t.safetensors")
    with pytest.raises(CalibrationError, match="No calibration file"):
        load_calibration(tmp_path / "none.safetensors")


def test_greedy_paths_spend_the_budget_and_allocate_it(tmp_path):
    model, _, arch = random_model("tiny-llama")
    ids = _ids(b=1, p=64)
    cfg = CalibrationConfig(greedy_max=0.6, greedy_tokens=64)
    cal = calibrate(model, ids, cfg, cache=False, progress=False)
    path = greedy_path(model, ids, cal, "teal", progress=False)
    w = torch.tensor([site_elements(arch)[s] for s in SITES], dtype=torch.float32)
    for layer in path:
        eff = layer[:, 0]
        assert eff[0] == 0 and eff[-1] >= 0.6 - 1e-6 and (eff.diff() >= 0).all()
        assert (layer[:, 1:].diff(dim=0) >= 0).all()  # every site only ever gets sparser
        torch.testing.assert_close(layer[:, 1:] @ w / w.sum(), eff)
    cal.greedy[f"teal.{cfg.greedy_key()}"] = path
    thr = cal.thresholds("teal", 0.45, allocation="greedy")
    for i in range(arch.n_layers):
        s = torch.tensor([thr.sparsity.get((i, site), 0.0) for site in SITES])
        assert abs(float(s @ w / w.sum()) - 0.45) < 1e-5  # the same average as uniform
    with pytest.raises(CalibrationError, match="reaches layer sparsity"):
        cal.thresholds("teal", 0.9, allocation="greedy")


def test_batched_candidates_equal_separate_runs():
    model, _, arch = random_model("tiny-llama")
    inputs = layer_inputs(model, _ids(b=1, p=16), arch)
    args, kwargs = inputs[1]
    with torch.no_grad():
        one = _run_layer(arch.layer(model, 1), args, kwargs, 1)
        three = _run_layer(arch.layer(model, 1), args, kwargs, 3)
    assert three.shape[0] == 3
    for k in range(3):
        torch.testing.assert_close(three[k], one[0], rtol=1e-5, atol=1e-6)


def test_thresholds_object_checks():
    model, _, _ = random_model("tiny-opt")
    thr = Thresholds("teal", {(0, "o_in"): 0.1}, {(0, "o_in"): 0.3}, fingerprint(model))
    with pytest.raises(ValueError, match="are for 'teal', not 'wina'"):
        with sparsified(model, method="wina", thresholds=thr):
            pass
    with pytest.raises(ValueError, match="carry their own sparsity"):
        with sparsified(model, method="teal", thresholds=thr, sparsity=0.5):
            pass
    with pytest.raises(ValueError, match="needs thresholds="):
        with sparsified(model, method="cats", sparsity=0.5):
            pass
    with pytest.raises(CalibrationError, match="greedy allocations exist for teal and wina"):
        calibrate(model, _ids(), greedy=["cats"], cache=False)
