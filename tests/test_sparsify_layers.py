"""Per-layer budgets by measured sensitivity: the measurement, the allocation, the cache and
the frontier's layered variants."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config

from dejavu_lab.models import random_model
from dejavu_lab.sparsify import calibrate, sparse_eval, sparsified
from dejavu_lab.sparsify.frontier import evaluate_point, parse_variant, prepare
from dejavu_lab.sparsify.layers import GRID, allocate, cached_sensitivity, sensitivity


def _ids(b=1, p=32, seed=0):
    return torch.randint(0, 128, (b, p), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen():
    """A tiny random qwen2 (4 layers, GQA, q/k/v biases) and a TEAL calibration with its path."""
    cfg = Qwen2Config(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=192, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    m = random_model(cfg, seed=0)
    cal = calibrate(m.model, _ids(2, 48, seed=1), greedy=["teal"], cache=False, progress=False)
    return m, cal


def _teal(cal):
    return lambda b: {
        "method": "teal",
        "thresholds": cal.thresholds("teal", b, allocation="greedy"),
    }


@torch.no_grad()
def _full_kl(model, ids, kw) -> float:
    """KL(dense ‖ sparse) of a whole-model forward, for the same tokens."""
    dense = F.log_softmax(model(input_ids=ids).logits.float(), -1)
    with sparsified(model, **kw):
        sparse = F.log_softmax(model(input_ids=ids).logits.float(), -1)
    return (dense.exp() * (dense - sparse)).sum(-1).mean().item()


def test_sensitivity_from_a_layer_equals_the_whole_model(qwen):
    m, cal = qwen
    ids, grid = _ids(seed=2), (0.3, 0.6)
    kl = sensitivity(m.model, ids, _teal(cal), grid)
    assert kl.shape == (4, 2)
    for layer in (0, 2, 3):  # the forward that starts at the layer's captured dense input
        b = [0.0] * 4
        b[layer] = grid[1]
        assert kl[layer, 1].item() == pytest.approx(_full_kl(m.model, ids, _teal(cal)(b)), rel=1e-3)
    assert (kl[:, 1] >= kl[:, 0]).all() and (kl > 0).all()


def test_allocation_keeps_the_mean_and_spends_where_it_is_cheapest():
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(6, 1, generator=g) + 0.1
    kl = slopes * torch.tensor(GRID) ** 2  # convex, layer i costs slopes[i] times as much
    for s in (0.0, 0.25, 0.5, 0.7, 0.8):
        b = allocate(kl, s)
        assert sum(b) / len(b) == pytest.approx(s, abs=1e-9)
        assert all(0.0 <= x <= GRID[-1] + 1e-12 for x in b)
    b = allocate(kl, 0.5)
    order = slopes.flatten().argsort()  # the cheapest layer removes the most
    assert b[order[0]] >= b[order[-1]]
    flat = torch.ones(6, len(GRID)) * torch.tensor(GRID)  # equal costs: one grid step apart at most
    assert max(allocate(flat, 0.5)) - min(allocate(flat, 0.5)) <= 0.15 + 1e-9


def test_allocation_refuses_a_budget_beyond_the_grid_in_one_sentence():
    with pytest.raises(ValueError, match=r"^a model budget of 0.9 needs layer budgets above 0.8"):
        allocate(torch.ones(3, len(GRID)), 0.9)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        allocate(torch.ones(3, len(GRID)), 1.5)


def test_cache_is_read_back_and_a_corrupt_file_is_measured_again(qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    m, cal = qwen
    ids, calls = _ids(seed=3), []

    def kw(b):
        calls.append(b)
        return _teal(cal)(b)

    first = cached_sensitivity(m.model, ids, kw, {"spec": "teal"}, grid=(0.5,))
    n = len(calls)
    again = cached_sensitivity(m.model, ids, kw, {"spec": "teal"}, grid=(0.5,))
    assert len(calls) == n and torch.equal(first, again)  # read, not measured
    (path,) = (tmp_path / "layers").glob("*.json")
    assert json.loads(path.read_text())["kl"] == first.tolist()
    path.write_text('{"kl": [[0.1')  # a killed writer's leftovers
    third = cached_sensitivity(m.model, ids, kw, {"spec": "teal"}, grid=(0.5,))
    assert len(calls) == 2 * n and torch.allclose(third, first)
    assert json.loads(path.read_text())["kl"] == third.tolist()  # replaced by a whole file


def test_layered_variant_reads_the_bytes_of_the_uniform_one(qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("DEJAVU_LAB_CACHE", str(tmp_path))
    m, _ = qwen
    calib, held = _ids(2, 48, seed=1), _ids(2, 32, seed=4)
    rows, ready = {}, {}
    for text in ("teal", "teal+layers"):
        name, spec = parse_variant(text)
        ready[name] = prepare(m.model, None, spec, calib)
        rows[name] = evaluate_point(m.model, held, name, spec, 0.5, ready[name])
    assert set(rows) == {"teal (greedy)", "teal (greedy, layers)"}
    a, b = rows["teal (greedy)"], rows["teal (greedy, layers)"]
    assert b["bytes_per_token_fraction"] == pytest.approx(a["bytes_per_token_fraction"], abs=0.05)
    budgets = allocate(ready["teal (greedy, layers)"]["layers"], 0.5)
    thr = ready["teal (greedy)"]["cal"]
    direct = sparse_eval(m.model, held, method="teal", progress=False,
                         thresholds=thr.thresholds("teal", budgets, allocation="greedy"))  # fmt: skip
    assert b["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)  # the row runs them


def test_parse_variant_names_the_layered_variants():
    assert parse_variant("teal+layers")[0] == "teal (greedy, layers)"
    assert parse_variant("wina:greedy+layers")[1]["layers"] == "sensitivity"
    assert parse_variant("larosa+layers")[0] == "larosa (layers)"
    assert parse_variant("larosa (layers)")[1]["method"] == "larosa"
