"""dejavu_lab.collect / predictors / bytes_model: collection, training, evaluation, files."""

import json
from itertools import combinations

import pytest
import torch

from dejavu_lab.arch import get_arch
from dejavu_lab.bytes_model import bytes_per_token, kv_heads_needed, predicted_speedup
from dejavu_lab.collect import (
    CollectConfig,
    CollectionError,
    collect,
    fingerprint,
    open_collection,
    pack_bits,
    unpack_bits,
)
from dejavu_lab.models import PRESETS, random_model
from dejavu_lab.predictors import (
    PredictorConfig,
    PredictorError,
    Predictors,
    cost,
    evaluate,
    load_predictors,
    train_predictors,
)
from dejavu_lab.sparsify import sparse_perplexity

W = 32  # window of the tiny collections


def _windows(n, seed=0):
    return torch.randint(0, 128, (n, W), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def opt_collection(tmp_path_factory):
    model, _, arch = random_model("tiny-opt", seed=3)
    out = tmp_path_factory.mktemp("col") / "opt"
    cfg = CollectConfig(window=W, max_tokens=40 * W, chunk_windows=8)
    col = collect(model, None, cfg, out, windows=_windows(44), progress=False)
    return model, arch, col


def test_pack_bits_roundtrip():
    m = torch.rand(5, 13) > 0.5
    packed = pack_bits(m)
    assert packed.shape == (5, 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 13), m)


def test_collection_layout_and_labels(opt_collection):
    model, arch, col = opt_collection
    assert col.n_tokens == 40 * W and len(col.chunks) == 5
    data = col.layer(1)
    assert data["pre"].shape == (40 * W, arch.d_model) and data["pre"].dtype == torch.float16
    assert data["mlp"].shape == (40 * W, arch.d_mlp) and data["mlp"].dtype == torch.bool
    assert data["head"].shape == (40 * W, arch.n_heads)
    # ReLU labels are exactly "activation > 0" (compare with a fresh forward of window 0)
    from dejavu_lab.hooks import run_with_cache

    _, cache = run_with_cache(model, _windows(44)[:1], "blocks.1.mlp.hook_post")
    assert torch.equal(data["mlp"][:W], cache["blocks.1.mlp.hook_post"][0] > 0)


def test_collection_resumes_and_refuses_mismatch(opt_collection, tmp_path):
    model, arch, col = opt_collection
    stamps = {p: p.stat().st_mtime_ns for p in col.chunks}
    col.chunks[2].unlink()
    with pytest.raises(CollectionError, match="incomplete .*rerun the same collect"):
        open_collection(col.path)
    cfg = CollectConfig(**col.manifest["config"])
    again = collect(model, None, cfg, col.path, windows=_windows(44), progress=False)
    assert all(p.exists() for p in again.chunks)
    assert all(p.stat().st_mtime_ns == stamps[p] for p in col.chunks if p != col.chunks[2])
    other = CollectConfig(window=W, max_tokens=8 * W)
    with pytest.raises(CollectionError, match="another model or config"):
        collect(model, None, other, col.path, windows=_windows(44), progress=False)
    with pytest.raises(CollectionError, match="not a collection"):
        open_collection(tmp_path)


def test_gated_labels_are_top_fraction(tmp_path):
    model, _, arch = random_model("tiny-llama")
    cfg = CollectConfig(window=W, max_tokens=2 * W, mlp_label_sparsity=0.75)
    col = collect(model, None, cfg, tmp_path, windows=_windows(2), progress=False)
    labels = col.layer(0)["mlp"]
    assert (labels.sum(-1) == arch.d_mlp // 4).all()


def test_training_learns_relu_signs(opt_collection):
    """A ReLU neuron is active iff a linear function of the normed input is > 0: learnable."""
    _, _, col = opt_collection
    cfg = PredictorConfig(mode="same", mlp_rank=64, head_rank=8, epochs=30, patience=30, lr=1e-2)
    pred = train_predictors(col, cfg, progress=False)
    mlp = [h for h in pred.history if h["kind"] == "mlp"]
    assert len(mlp) == 2 and all(h["val_recall"] > 0.8 for h in mlp)


def test_evaluate_and_cost(opt_collection):
    model, arch, _ = opt_collection
    preds = [
        Predictors(fingerprint(model, arch), PredictorConfig(mode=m, mlp_rank=8, head_rank=4))
        for m in ("same", "lookahead")
    ]
    df = evaluate(model, _windows(2, seed=9), preds, mlp_sparsity=0.5, progress=False)
    assert set(df["mode"]) == {"same", "lookahead"} and len(df) == 2 * 2 * arch.n_layers
    assert df[["recall", "precision", "mass_kept"]].stack().between(0, 1).all()
    assert (df["oracle_mass"] >= df["mass_kept"] - 1e-6).all()  # nothing beats the oracle
    c = cost(preds[0], arch)
    mlp = c[c.kind == "mlp"].iloc[0]
    assert mlp.predictor_params == 64 * 8 + 8 * 256 + 256
    assert mlp.block_params == 2 * 64 * 256 and 0 < mlp.flop_ratio < 1


def test_save_load_roundtrip_and_errors(tmp_path):
    model, _, arch = random_model("tiny-llama", seed=1)
    pred = Predictors(fingerprint(model, arch), PredictorConfig(mlp_rank=8, head_rank=4)).eval()
    path = pred.save(tmp_path / "p.safetensors")
    back = load_predictors(path, model)
    x = torch.randn(3, arch.d_model)
    assert torch.equal(back.mlp_scores(1, x), pred.mlp_scores(1, x))
    assert back.config == pred.config and back.mode == "lookahead"
    other, _, _ = random_model("tiny-llama", seed=2)
    with pytest.raises(PredictorError, match="trained for another model.*weights_sha256"):
        load_predictors(path, other)
    opt, _, _ = random_model("tiny-opt")
    with pytest.raises(PredictorError, match="another model.*model_type"):
        with torch.no_grad():
            sparse_perplexity(opt, _windows(1), mode="predicted", predictors=back)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PredictorError, match="truncated or damaged"):
        load_predictors(truncated)
    with pytest.raises(PredictorError, match="No predictor file"):
        load_predictors(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(PredictorError, match="not dejavu-lab predictors"):
        load_predictors(tmp_path / "other.safetensors")


def test_predicted_mode_uses_the_predictor_sets():
    model, _, arch = random_model("tiny-llama")
    pred = Predictors(fingerprint(model, arch), PredictorConfig(mode="same")).eval()
    ids = _windows(1)
    record = {}
    from dejavu_lab.sparsify import n_keep, sparsified, topk_mask

    with (
        torch.no_grad(),
        sparsified(
            model,
            mode="predicted",
            predictors=pred,
            mlp_sparsity=0.5,
            head_sparsity=0.5,
            record=record,
        ),
    ):
        model(input_ids=ids)
    from dejavu_lab.hooks import run_with_cache

    with (
        torch.no_grad(),
        sparsified(model, mode="predicted", predictors=pred, mlp_sparsity=0.5, head_sparsity=0.5),
    ):
        _, cache = run_with_cache(model, ids, "blocks.1.hook_resid_pre")
    want = topk_mask(pred.head_scores(1, cache["blocks.1.hook_resid_pre"]), n_keep(0.5, 4))
    assert torch.equal(record["heads"][1], want)


def test_bad_configs():
    with pytest.raises(PredictorError, match="mode must be 'same' or 'lookahead'"):
        PredictorConfig(mode="ahead")
    with pytest.raises(ValueError, match=r"mlp_sparsity must be in \[0, 1\)"):
        PredictorConfig(mlp_sparsity=1.2)
    with pytest.raises(CollectionError, match="max_tokens >= window"):
        CollectConfig(window=512, max_tokens=100)


def test_manifest_is_json(opt_collection):
    _, _, col = opt_collection
    m = json.loads((col.path / "manifest.json").read_text())
    assert m["fingerprint"]["model_type"] == "opt" and m["n_chunks"] == 5


# bytes model -----------------------------------------------------------------------------


def test_kv_heads_needed_matches_enumeration():
    h, kv = 6, 3
    for k in range(1, h + 1):
        groups = [
            len({i // (h // kv) for i in c}) for c in combinations(range(h), k)
        ]  # KV heads touched by each choice of k query heads
        assert kv_heads_needed(h, kv, k) == pytest.approx(sum(groups) / len(groups))


def test_bytes_model():
    arch = get_arch(PRESETS["opt-175b"].config())
    vocab = PRESETS["opt-175b"].vocab
    dense = bytes_per_token(arch, vocab)
    # fp16 weights of the 96 blocks (≈ 12 d² each) plus the unembedding ≈ 175B params
    params = (dense.attn_weights + dense.mlp_weights + dense.unembed) / 2
    assert 170e9 < params < 180e9
    assert predicted_speedup(arch, vocab) == pytest.approx(1.0)
    s1 = predicted_speedup(arch, vocab, mlp_sparsity=0.5)
    s2 = predicted_speedup(arch, vocab, mlp_sparsity=0.85, head_sparsity=0.5)
    s3 = predicted_speedup(arch, vocab, mlp_sparsity=0.85, head_sparsity=0.5, dense_layers=[0, 1])
    assert 1 < s1 < s2 and s3 < s2 and s2 < 1 / 0.15
    with pytest.raises(ValueError, match=r"head_sparsity must be in \[0, 1\)"):
        bytes_per_token(arch, vocab, head_sparsity=-0.5)


def test_grid_figure_slider_switches_traces():
    import pandas as pd

    from dejavu_lab.report.explorer import grid_figure

    grid = pd.DataFrame(
        [
            {
                "sets": s,
                "mlp_sparsity": m,
                "head_sparsity": h,
                "dense_first": d,
                "perplexity": 10 + m + h,
                "speedup": 1 + m,
            }
            for s in ("oracle", "predicted")
            for m in (0.0, 0.5)
            for h in (0.0, 0.3, 0.5)
            for d in (0, 2)
        ]
    )
    fig = grid_figure(grid, 10.0, "t", "caption")
    steps = fig.layout.sliders[0].steps
    assert len(steps) == 3 * 2 and steps[0].label == "0%"
    assert steps[-1].label == "50% + 2 dense"
    n = len(fig.data)
    assert n == 6 * 3  # per step: oracle and predicted perplexity, and the speedup
    shown = [s.args[0]["visible"] for s in steps]
    assert all(sum(v) == 3 for v in shown)  # each step shows its own three traces
    assert all(not (a and b) for a, b in zip(shown[0], shown[1], strict=True))
