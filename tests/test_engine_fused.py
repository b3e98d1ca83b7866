"""The fused one-token step (each block finished in its residual add + norm) against the plain
step, for every method it runs (dense, TEAL, WINA, CATS), under the Triton interpreter on CPU
(or on the GPU with ``DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from dejavu_lab.bench.timing import relerr
from dejavu_lab.collect import fingerprint  # noqa: E402
from dejavu_lab.engine import BatchDecoder, Decoder, SparseConfig, calibrate_thresholds  # noqa: E402
from dejavu_lab.kernels._common import use_triton  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402
from dejavu_lab.predictors import PredictorConfig, Predictors  # noqa: E402

DEVICE = os.environ.get("DEJAVU_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(
    not use_triton(torch.device(DEVICE)), reason="the fused step runs the Triton kernels"
)


def model_of(preset, seed):
    lm = random_model(preset, dtype=torch.float16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # OPT's biases not zero, so the epilogues' bias paths count
        for name, p in lm.model.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm.model.to(DEVICE)


def steps(dec, ids, n_prompt, fused):
    dec.fuse_epilogues = fused
    with torch.no_grad():
        out = [dec.prefill(ids[:, :n_prompt])]
        out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out).float()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize(
    "method,hidden",
    [
        ("dense", False),
        ("teal", False),
        ("teal", True),
        ("wina", True),
        ("cats", False),
        ("cats", True),
    ],
)
def test_fused_step_gives_the_plain_steps_logits(preset, method, hidden):
    m = model_of(preset, seed=4)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    sp = None
    if method != "dense":
        thr = calibrate_thresholds(m, ids[:, :6], 0.5, method=method)
        sp = SparseConfig(method=method, thresholds=thr)
    dec = Decoder(m, max_seq_len=12, sparse=sp)
    dec.fuse_hidden = hidden  # the down GEMV finishes the gate/up sums
    x = torch.zeros(1, m.config.hidden_size, dtype=torch.float16, device=DEVICE)
    assert dec._fusable(x)
    plain = steps(dec, ids, 6, fused=False)
    fused = steps(dec, ids, 6, fused=True)
    # one rounding fewer per residual add: a threshold may flip an entry at its edge
    assert relerr(fused, plain) < 3e-2
    # and the workspace is clean: the plain step after the fused one agrees again
    assert relerr(steps(dec, ids, 6, fused=False), plain) < 1e-3


@pytest.mark.parametrize(
    "preset,predictors", [("tiny-llama", True), ("tiny-opt", True), ("tiny-opt", False)]
)  # GQA; MHA with deferred K/V
def test_dejavus_fused_step_gives_the_plain_steps_logits(preset, predictors):
    """DejaVu's blocks finish their outputs in the residual add + norm; with its lookahead
    predictors choosing each layer's sets inside the step (random predictors: only the
    plumbing counts), across a deferred-K/V flush (tiny-opt: window 4, 6 decode steps)."""
    m = model_of(preset, seed=7)
    pred = None
    if predictors:
        pred = Predictors(fingerprint(m), PredictorConfig(mode="lookahead")).to(DEVICE).eval()
    sp = SparseConfig(0.5, 0.5, kv_window=4)
    dec = Decoder(m, max_seq_len=16, sparse=sp, predictors=pred)
    if preset == "tiny-opt":
        assert dec.window == 4
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    x = torch.zeros(1, m.config.hidden_size, dtype=torch.float16, device=DEVICE)
    assert dec._fusable(x)
    plain = steps(dec, ids, 6, fused=False)
    fused = steps(dec, ids, 6, fused=True)
    assert relerr(fused, plain) < 1e-2  # one rounding fewer per residual add
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() > 0.8


def test_fused_step_runs_only_where_it_applies():
    m = model_of("tiny-llama", seed=5)
    x1 = torch.zeros(1, m.config.hidden_size, dtype=torch.float16, device=DEVICE)
    dec = Decoder(m, max_seq_len=8)
    assert dec._fusable(x1) and not dec._fusable(x1.expand(2, -1))
    assert Decoder(m, max_seq_len=8, sparse=SparseConfig(0.5, 0.5))._fusable(x1)  # DejaVu too
    assert not BatchDecoder(m, max_seq_len=8, max_batch=2)._fusable(x1)
    dec.fuse_epilogues = False
    assert not dec._fusable(x1)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_the_default_dense_step_reads_columns_through_our_kernels_on_a_gpu(preset):
    """A dense Decoder built from a fp16 model: on a GPU the columns layout with every op through
    our kernels (the fastest batch-1 step), elsewhere rows and torch; the same logits as the
    rows layout through cuBLAS either way, and BatchDecoder keeps cuBLAS."""
    m = model_of(preset, seed=6)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    dec = Decoder(m, max_seq_len=12)
    gpu = DEVICE == "cuda"
    assert dec.w.layout == ("columns" if gpu else "rows")
    assert set(dec.ops.values()) == ({"triton"} if gpu else {"torch"})
    cublas = Decoder(m, max_seq_len=12, dense_ops="torch")
    assert cublas.w.layout == "rows"
    assert relerr(steps(dec, ids, 6, True), steps(cublas, ids, 6, True)) < 1e-2
    batch = BatchDecoder(m, max_seq_len=12, max_batch=2)
    assert batch.w.layout == "rows" and batch.ops["qkv"] == batch.ops["mlp"] == "torch"
