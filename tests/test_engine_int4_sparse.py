"""DejaVu and CATS on the engine's 4-bit path (:mod:`dejavu_lab.engine.int4_sparse`) on CPU, the
int4 kernels running under TRITON_INTERPRET=1: with everything kept each equals dense 4-bit
decoding to rounding; at real sparsity each equals the fp16 engine's DejaVu / CATS over the
dequantised weights to rounding; generate() runs in fp16 and bf16; bad requests get one
sentence."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from _engine_int4 import GROUP, decode_logits, dequantised, ids_of, model  # noqa: E402

from dejavu_lab.bench.timing import relerr  # noqa: E402
from dejavu_lab.engine import (  # noqa: E402
    BatchDecoder,
    Decoder,
    EngineError,
    SparseConfig,
    calibrate_thresholds,
    decoder_weights,
    keep_all,
)
from dejavu_lab.engine.int4 import quantize_weights  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402
from dejavu_lab.quant import Int4Rows  # noqa: E402

FIXTURES = (model,)  # pytest finds fixtures by name in this module


def random_sets(dec, seed):
    """The same random kept neurons and heads per layer, for any decoder of this shape."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(dec.arch.n_layers):
        mlp = torch.randperm(dec.arch.d_mlp, generator=g)[: dec.k_mlp]
        heads = torch.randperm(dec.H, generator=g)[: dec.k_heads]
        out.append((mlp, heads))
    return out


def with_sets(dec, sets):
    for i, (mlp, heads) in enumerate(sets):
        dec.set_indices(i, mlp=mlp, heads=heads)
    return dec


@pytest.mark.parametrize("method", ["dejavu", "cats"])
def test_everything_kept_equals_dense_int4(model, method):
    ids = ids_of(8, seed=1)
    dense = decode_logits(Decoder(model, max_seq_len=16, weights="int4", group=GROUP), ids, 4)
    sparse = (SparseConfig(mlp_sparsity=0.0, head_sparsity=0.0) if method == "dejavu"
              else SparseConfig(method="cats", thresholds=keep_all(model, "cats")))  # fmt: skip
    dec = Decoder(model, max_seq_len=16, sparse=sparse, weights="int4", group=GROUP)
    assert isinstance(dec.w.layers[0].w_in, Int4Rows)  # the rows layout, the same numbers
    got = decode_logits(dec, ids, 4)
    assert relerr(got, dense) < 3e-3  # the same weights summed in another order


def test_dejavu_int4_equals_the_fp16_engine_on_dequantised_weights(model):
    """Random kept sets (the same for both), half the neurons and heads, the deferred K/V
    window (MHA: tiny-opt) flushed twice in the decoded steps."""
    sp = SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5, kv_window=3)
    w4 = quantize_weights(decoder_weights(model), GROUP, "dejavu")
    ids = ids_of(10, seed=2)
    dec4 = Decoder(w4, max_seq_len=16, sparse=sp)
    ref = Decoder(dequantised(w4), max_seq_len=16, sparse=sp)
    sets = random_sets(dec4, seed=7)
    got = decode_logits(with_sets(dec4, sets), ids, 3)
    want = decode_logits(with_sets(ref, sets), ids, 3)
    dense = decode_logits(Decoder(w4, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.0)),
                          ids, 3)  # fmt: skip
    assert relerr(got, want) < 3e-3
    assert relerr(got[1:], dense[1:]) > 0.05  # the sets did drop neurons and heads


def test_cats_int4_equals_the_fp16_engine_on_dequantised_weights(model):
    w4 = quantize_weights(decoder_weights(model), GROUP, "cats")
    deq = dequantised(w4)
    # 75%: a ReLU MLP (tiny-opt) has half its activations at zero already
    thr = calibrate_thresholds(deq, ids_of(24, seed=5), 0.75, method="cats")
    sparse = SparseConfig(method="cats", thresholds=thr)
    ids = ids_of(8, seed=2)
    got = decode_logits(Decoder(w4, max_seq_len=16, sparse=sparse), ids, 4)
    ref = decode_logits(Decoder(deq, max_seq_len=16, sparse=sparse), ids, 4)
    dense = decode_logits(Decoder(w4, max_seq_len=16), ids, 4)
    errs = [relerr(got[i], ref[i]) for i in range(got.shape[0])]
    dropped = [relerr(got[i], dense[i]) for i in range(1, got.shape[0])]  # decoded steps
    assert min(dropped) > 0.02  # the thresholds did drop neurons
    # to rounding: a neuron within a rounding of its threshold may flip, never as far as the
    # sparsity itself moves the logits (as TEAL's test in test_engine_int4.py)
    assert sorted(errs)[len(errs) // 2] < 3e-3, errs
    assert max(errs) < 0.5 * min(dropped), (errs, dropped)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["dejavu", "cats"])
def test_generate_runs(dtype, method):
    m = random_model("tiny-opt" if method == "dejavu" else "tiny-llama", dtype=dtype).model
    sparse = (SparseConfig(mlp_sparsity=0.5, head_sparsity=0.5, kv_window=2) if method == "dejavu"
              else SparseConfig(method="cats", thresholds={(0, "gate"): 0.05, (1, "gate"): 0.05}))  # fmt: skip
    dec = Decoder(m, max_seq_len=12, sparse=sparse, weights="int4", group=32)
    out = dec.generate(ids_of(3, seed=3), 3)
    assert out.shape == (1, 6) and dec.w.dtype == dtype


def test_int4_layouts_that_do_not_fit_the_method_are_refused():
    m = random_model("tiny-llama", dtype=torch.float16).model
    dense4 = quantize_weights(decoder_weights(m, layout="columns"), GROUP)
    cats = SparseConfig(method="cats", thresholds=keep_all(m, "cats"))
    bad = [
        (lambda: Decoder(dense4, max_seq_len=8, sparse=SparseConfig()),
         "reads the rows layout of w_qkv"),
        (lambda: Decoder(dense4, max_seq_len=8, sparse=cats), "reads the rows layout of w_in"),
        (lambda: quantize_weights(decoder_weights(m), GROUP, "oracle"), "must be one of"),
        (lambda: BatchDecoder(quantize_weights(decoder_weights(m), GROUP, "dejavu"), max_seq_len=8,
                              sparse=SparseConfig()), "runs batch 1 only"),
        (lambda: Decoder(m, max_seq_len=8, sparse=cats, weights="int4", group=128),
         "not a multiple of group=128"),
    ]  # fmt: skip
    for call, match in bad:
        with pytest.raises(EngineError, match=match) as info:
            call()
        msg = str(info.value)
        assert msg.endswith(".") and msg.count(". ") == 0, msg
    # int4 weights laid out anew for a method hold the same numbers as quantising for it
    again = quantize_weights(dense4, GROUP, "dejavu").layers[0]
    direct = quantize_weights(decoder_weights(m), GROUP, "dejavu").layers[0]
    for name in ("w_qkv", "w_in"):
        a, b = getattr(again, name), getattr(direct, name)
        assert all(torch.equal(getattr(a, t), getattr(b, t)) for t in ("packed", "scales", "mins"))
    back = quantize_weights(quantize_weights(dense4, GROUP, "dejavu"), GROUP, "dense").layers[0]
    assert torch.equal(back.w_in_t.packed, dense4.layers[0].w_in_t.packed)
    # the rows layout built for DejaVu serves a dense decoder's prefill and step as well
    w4 = quantize_weights(decoder_weights(m), GROUP, "dejavu")
    assert Decoder(w4, max_seq_len=8, sparse=SparseConfig(mlp_sparsity=0.0)).generate(
        ids_of(3), 2).shape == (1, 5)  # fmt: skip


def test_sparse_int4_weights_read_about_a_quarter_of_the_bytes(model):
    for method in ("dejavu", "cats"):
        w4 = quantize_weights(decoder_weights(model), GROUP, method)
        ratio = w4.nbytes("layers") / dequantised(w4).nbytes("layers")
        assert 0.25 < ratio < 0.36, method  # codes at 4 bits + fp16 scale and min per 64


def test_engine_bench_times_dejavu_and_cats_on_int4(tmp_path, monkeypatch):
    """kernels/bench_engine_int4.py's plumbing (``--quick``, int4 built without fp16): DejaVu and
    CATS get their rows beside TEAL, their keep-all checks, and bytes below int4 dense."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    monkeypatch.setenv("DEJAVU_LAB_RESULTS", str(tmp_path))
    script = Path(__file__).resolve().parents[1] / "kernels" / "bench_engine_int4.py"
    spec = importlib.util.spec_from_file_location("bench_engine_int4", script)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engine_int4", bench)
    spec.loader.exec_module(bench)
    args = ["--quick", "--models", "", "--int4-only", "tiny-llama", "--methods",
            "teal,dejavu,cats", "--sparsity", "0.5", "--name", "e2e_int4_quick"]  # fmt: skip
    bench.main(args)
    rows = json.loads((tmp_path / "e2e_int4_quick.json").read_text())["rows"]
    (check,) = [r for r in rows if r["kind"] == "check"]
    assert check["keep_all_dejavu_vs_dense"] < 3e-3 and check["keep_all_cats_vs_dense"] < 3e-3
    timed = {r["engine"]: r for r in rows if r["kind"] == "e2e"}
    assert set(timed) == {"dense", "teal", "dejavu", "cats"}
    assert all("error" not in r and r["ms_per_token"] > 0 for r in timed.values())
    for m in ("teal", "dejavu", "cats"):
        assert timed[m]["bytes_per_token"] < timed["dense"]["bytes_per_token"], m
