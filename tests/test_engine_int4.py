"""The engine's 4-bit path (:mod:`dejavu_lab.engine.int4`) on CPU, the int4 kernels running under
TRITON_INTERPRET=1: dense 4-bit decoding equals the fp16 engine over the dequantised weights to
rounding; TEAL with every column kept equals dense 4-bit; TEAL and WINA at real thresholds
equal the fp16 TEAL/WINA engine over the dequantised weights; bad requests get one sentence."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from _engine_int4 import GROUP, decode_logits, dequantised, ids_of, model  # noqa: E402

from dejavu_lab.bench.timing import relerr  # noqa: E402
from dejavu_lab.engine import (  # noqa: E402
    Decoder,
    EngineError,
    SparseConfig,
    calibrate_thresholds,
    decoder_weights,
    keep_all,
)
from dejavu_lab.engine.int4 import quantize_weights, random_int4_weights  # noqa: E402
from dejavu_lab.kernels.int4.kernel import int4_gemv_kernel  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402

FIXTURES = (model,)  # pytest finds fixtures by name in this module


@pytest.fixture(scope="module")
def case(model):
    w4 = quantize_weights(decoder_weights(model, layout="columns"), GROUP)
    return model, w4, dequantised(w4)


def test_the_int4_kernel_runs_in_the_interpreter():
    assert type(int4_gemv_kernel).__name__ == "InterpretedFunction"


def test_dense_int4_equals_the_dequantised_fp16_engine(case):
    m, w4, deq = case
    ids = ids_of(9)
    got = decode_logits(Decoder(w4, max_seq_len=16), ids, 5)
    ref = decode_logits(Decoder(deq, max_seq_len=16), ids, 5)
    assert relerr(got, ref) < 1e-2
    # the model argument with weights="int4" builds the same weights
    again = decode_logits(Decoder(m, max_seq_len=16, weights="int4", group=GROUP), ids, 5)
    assert torch.equal(again, got)


def test_teal_with_every_column_kept_equals_dense_int4(case):
    m, w4, _ = case
    ids = ids_of(8, seed=1)
    teal = SparseConfig(method="teal", thresholds=keep_all(m))
    got = decode_logits(Decoder(w4, max_seq_len=16, sparse=teal), ids, 4)
    dense = decode_logits(Decoder(w4, max_seq_len=16), ids, 4)
    # -1 keeps every entry; one token's threshold GEMV walks 32 rows per program where the dense
    # one walks 64 (each the faster on an H100), so the fp32 sums round differently
    assert relerr(got, dense) < 3e-3


@pytest.mark.parametrize("method", ["teal", "wina"])
def test_thresholded_int4_equals_the_fp16_engine_on_dequantised_weights(case, method):
    m, w4, deq = case
    ids = ids_of(8, seed=2)
    thr = calibrate_thresholds(deq, ids_of(64, seed=5), 0.5, method=method)
    sparse = SparseConfig(method=method, thresholds=thr)
    got = decode_logits(Decoder(w4, max_seq_len=16, sparse=sparse), ids, 4)
    ref = decode_logits(Decoder(deq, max_seq_len=16, sparse=sparse), ids, 4)
    dense = decode_logits(Decoder(w4, max_seq_len=16), ids, 4)
    errs = [relerr(got[i], ref[i]) for i in range(got.shape[0])]
    dropped = [relerr(got[i], dense[i]) for i in range(1, got.shape[0])]  # decoded steps
    assert min(dropped) > 0.05  # the thresholds did drop entries
    # to rounding: an entry within a rounding of its threshold may flip (seen once in ten
    # steps, 0.05 off; thresholds from the prompt's last positions sit where the decode's
    # entries are dense, so a few flips per step, 3-5e-3), never as far as the sparsity
    # itself moves the logits
    assert sorted(errs)[len(errs) // 2] < 6e-3, errs
    assert max(errs) < 0.5 * min(dropped), (errs, dropped)


def test_int4_requests_it_cannot_run_are_refused():
    m = random_model("tiny-llama", dtype=torch.float16).model
    bad = [
        (dict(weights="int8"), "must be None"),
        (dict(weights="int4", group=128), "not a multiple of group=128"),
        (dict(weights="int4", group=48), "group=48 is not supported"),
        (dict(weights="int4", group=128, sparse=SparseConfig(mlp_sparsity=0.5)),
         "not a multiple of group=128"),
    ]  # fmt: skip
    for kw, match in bad:
        with pytest.raises(EngineError, match=match):
            Decoder(m, max_seq_len=8, **kw)
    with pytest.raises(EngineError, match="fp16/bf16 activations"):
        Decoder(random_model("tiny-llama").model, max_seq_len=8, weights="int4", group=GROUP)


def test_int4_weights_read_about_a_quarter_of_the_bytes(case):
    _, w4, deq = case
    ratio = w4.nbytes("layers") / deq.nbytes("layers")
    assert 0.25 < ratio < 0.36  # codes at 4 bits + fp16 scale and min per 64 weights


def test_random_int4_weights_decode_dense_and_teal():
    """Weights built in int4 without the fp16 model (the 70B speed runs): TEAL calibrated on
    them keeps everything at threshold -1 and drops entries at 50%."""
    w4 = random_int4_weights("tiny-llama", group=GROUP)
    ids = ids_of(8, seed=4)
    dense = decode_logits(Decoder(w4, max_seq_len=16), ids, 4)
    assert dense.isfinite().all()
    thr = calibrate_thresholds(w4, ids_of(24, seed=6), 0.5, method="teal")
    teal = decode_logits(Decoder(w4, max_seq_len=16, sparse=SparseConfig(method="teal", thresholds=thr)),
                         ids, 4)  # fmt: skip
    assert torch.equal(teal[0], dense[0]) and relerr(teal[1:], dense[1:]) > 1e-3


def test_int4_head_matches_the_dequantised_head_and_is_refused_without_int4_layers():
    from dejavu_lab.engine import Decoder
    from dejavu_lab.engine.config import EngineError
    from dejavu_lab.models import random_model

    m = random_model("tiny-llama", dtype=torch.float16).model
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    dec = Decoder(m, max_seq_len=16, weights="int4", group=64, head="int4")
    assert type(dec.w.lm_head).__name__ == "Int4Weight"
    assert dec.w.embed.shape == m.get_input_embeddings().weight.shape  # the input side as loaded
    plain = Decoder(m, max_seq_len=16, weights="int4", group=64)
    # the same layers, the head's dequantised values in fp16: the same logits to rounding
    plain.w = dataclasses.replace(plain.w, lm_head=dec.w.lm_head.dequantize(torch.float16).T)
    a, b = dec.prefill(ids).float(), plain.prefill(ids).float()
    assert torch.allclose(a, b, atol=2e-2), float((a - b).abs().max())
    assert torch.equal(dec.generate(ids, 4)[:, :5], ids)
    with pytest.raises(EngineError, match="weights='int4' too"):
        Decoder(m, max_seq_len=16, head="int4")
    with pytest.raises(EngineError, match="head="):
        Decoder(m, max_seq_len=16, weights="int4", head="int8")


@pytest.mark.parametrize("method,hidden", [("dense", True), ("teal", False), ("teal", True)])
def test_fused_int4_step_takes_the_sums_and_gives_the_plain_steps_logits(case, method, hidden):
    """One token's int4 products leave fp32 sums that the rotation and the residual add + norm
    take, and (``fuse_hidden``) the down GEMV finishes the gate/up sums in its loads (no
    finishing launch): the same logits as the plain step, and a clean workspace."""
    m, w4, _ = case
    ids = ids_of(9, seed=7)
    sparse = None
    if method == "teal":
        sparse = SparseConfig(method="teal", thresholds=calibrate_thresholds(
            w4, ids_of(32, seed=8), 0.5, method="teal"))  # fmt: skip
    dec = Decoder(w4, max_seq_len=16, sparse=sparse)
    dec.fuse_hidden = hidden
    x = torch.randn(1, m.config.hidden_size, generator=torch.Generator().manual_seed(0)).half()
    assert dec._fusable(x)
    with torch.no_grad():
        src, bias, sums = dec.attn[0].o_src(x[:, : dec.attn[0].lw.w_o_t.shape[0]])
        assert sums and src.dtype == torch.float32
        src.zero_()  # what the residual epilogue does
        src, bias, sums, gu = dec.mlp[0].src(x, hidden)
        assert sums and (gu is not None) == hidden
        src.zero_()
        if gu is not None:
            gu.zero_()
        fused = decode_logits(dec, ids, 7).float()
        dec.fuse_epilogues = False
        plain = decode_logits(dec, ids, 7).float()
        dec.fuse_epilogues = True
        again = decode_logits(dec, ids, 7).float()
    # one rounding fewer per block output: a threshold may flip an entry at its edge
    assert relerr(fused, plain) < 3e-2
    assert relerr(again, fused) < 1e-3  # the epilogues left the workspace at zero


def test_norms_listing_the_kept_rows_give_the_same_logits(case, monkeypatch):
    """With ``DEJAVU_INT4_LISTS`` the norm before each int4 TEAL product lists its kept rows
    (:mod:`dejavu_lab.kernels.int4.lists`) and the product walks them: the same logits as the
    products that list their own rows, and the lists were made (every block but layer 0's
    attention, whose input comes from the first norm, and attention without a rotation to
    finish its sums in: OPT's)."""
    import dejavu_lab.engine.int4 as engine_int4

    m, w4, _ = case
    ids = ids_of(9, seed=11)
    sparse = SparseConfig(method="teal", thresholds=calibrate_thresholds(
        w4, ids_of(32, seed=12), 0.5, method="teal"))  # fmt: skip
    with torch.no_grad():
        own = decode_logits(Decoder(w4, max_seq_len=16, sparse=sparse), ids, 7).float()
        monkeypatch.setattr(engine_int4, "LISTS", True)
        dec = Decoder(w4, max_seq_len=16, sparse=sparse)
        listed = decode_logits(dec, ids, 7).float()
    assert relerr(listed, own) < 1e-3
    made = [b.listed.buf is not None for b in dec.attn] + [
        b.listed.buf is not None for b in dec.mlp
    ]
    rotary = dec.attn[0].st.cos is not None
    assert made == [False] + [rotary] * (len(dec.attn) - 1) + [True] * len(dec.mlp)
