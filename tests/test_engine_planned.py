"""The engine's LaRoSA and R-Sparse paths on CPU, against the hooks that measure their quality.

A plan (``sparsify.larosa.plan`` / ``rsparse.plan`` with ``rule="threshold"``) runs through
the engine's threshold kernels — LaRoSA over weights with its rotation of attention's output
folded in, R-Sparse with a low-rank term per site — and must give the logits of the Hugging Face
model decoding with a KV cache inside ``sparsified(model, method=..., thresholds=plan)`` (dense
prefill, then each fed token through the hooks). The kernels run through their PyTorch
references (``TRITON_INTERPRET=0``) except in the test marked ``interpreter``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from _hf import kv_forward

from dejavu_lab.bench.timing import relerr
from dejavu_lab.engine import (  # noqa: E402
    Decoder,
    EngineError,
    SparseConfig,
    decoder_weights,
    fold_rotations,
    keep_all,
    random_rotations,
)
from dejavu_lab.kernels.threshold.gemv import threshold_gemv_kernel  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402
from dejavu_lab.sparsify import larosa, rsparse, sparsified  # noqa: E402
from dejavu_lab.sparsify.moments import calibrate_moments  # noqa: E402
from dejavu_lab.vocab import SITES  # noqa: E402

N_PROMPT, N = 8, 14


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def ids_of(n, seed=0):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def lm():
    """A tiny fp16 Llama and its calibration moments (the plans' source)."""
    m = random_model("tiny-llama", dtype=torch.float16, seed=11)
    mo = calibrate_moments(m.model, ids_of(64, seed=5).view(2, 32), cache=False, progress=False)
    return m, mo


def decode_logits(dec, ids, n_prompt=N_PROMPT):
    out = [dec.prefill(ids[:, :n_prompt])]
    out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out)


@torch.no_grad()
def hooks_logits(model, ids, method, plan, n_prompt=N_PROMPT):
    """Dense prefill, then each later token fed through the method's hooks (the reference)."""
    out, past = kv_forward(model, ids[:, :n_prompt])
    logits = [out[0, -1:]]
    with sparsified(model, method=method, thresholds=plan):
        for t in ids[0, n_prompt:]:
            out, past = kv_forward(model, t.view(1, 1), past)
            logits.append(out[0, -1:])
    return torch.cat(logits)


def larosa_plan(m, mo, sparsity=0.5, **kw):
    kw = {"basis": "none", **kw}
    return larosa.plan(m.model, mo, sparsity, rule="threshold", **kw)


def rsparse_plan(m, mo, sparsity=0.5, **kw):
    kw = {"lowrank": 0.25, "scaling": "plain", **kw}
    return rsparse.plan(m.model, mo, sparsity, rule="threshold", **kw)


@pytest.mark.parametrize("basis, score", [("none", "magnitude"), ("none", "weighted"),
                                          ("global", "magnitude")])  # fmt: skip
def test_larosa_step_equals_the_hooks(lm, basis, score):
    m, mo = lm
    p = larosa_plan(m, mo, score=score, basis=basis)
    ids = ids_of(N, seed=1)
    dec = Decoder(m.model, max_seq_len=N + 2, sparse=SparseConfig(method="larosa", plan=p))
    got, want = decode_logits(dec, ids), hooks_logits(m.model, ids, "larosa", p)
    dense = decode_logits(Decoder(m.model, max_seq_len=N + 2), ids)
    assert relerr(got, want) < 2e-2
    assert relerr(dense, want) > 5 * relerr(got, want)  # the plan changes the logits
    assert dec.lowrank_bytes == 0


def test_larosa_folding_keeps_dense_and_all_kept_is_dense(lm):
    m, _ = lm
    ids = ids_of(N, seed=2)
    w = decoder_weights(m.model, layout="columns")
    dense = decode_logits(Decoder(w, max_seq_len=N + 2), ids)
    folded = fold_rotations(w, random_rotations(m.arch, seed=3))
    assert not torch.equal(folded.layers[0].w_o_t, w.layers[0].w_o_t)  # turned, w untouched
    assert relerr(decode_logits(Decoder(folded, max_seq_len=N + 2), ids), dense) < 1e-2
    sp = SparseConfig(method="larosa", thresholds=keep_all(w), rotations=random_rotations(m.arch))
    assert relerr(decode_logits(Decoder(w, max_seq_len=N + 2, sparse=sp), ids), dense) < 1e-2


def test_rsparse_step_equals_the_hooks(lm):
    m, mo = lm
    p = rsparse_plan(m, mo)
    assert all(sp.rank > 0 for sp in p.sites.values())
    ids = ids_of(N, seed=4)
    dec = Decoder(m.model, max_seq_len=N + 2, sparse=SparseConfig(method="rsparse", plan=p))
    got, want = decode_logits(dec, ids), hooks_logits(m.model, ids, "rsparse", p)
    assert relerr(got, want) < 2e-2
    no_term = Decoder(
        m.model, max_seq_len=N + 2, sparse=SparseConfig(method="teal", thresholds=dec.thresholds)
    )
    assert relerr(decode_logits(no_term, ids), want) > 3 * relerr(got, want)  # the term counts
    # its bytes: r (d_in + d_out) fp16 values per site with a rank
    want_bytes = sum(sp.extra for sp in p.sites.values()) * 2
    assert dec.lowrank_bytes == want_bytes


def test_rsparse_rank_zero_is_teal(lm):
    m, mo = lm
    p = rsparse_plan(m, mo, ranks={(i, s): 0 for i in range(2) for s in SITES})
    ids = ids_of(N, seed=5)
    dec = Decoder(m.model, max_seq_len=N + 2, sparse=SparseConfig(method="rsparse", plan=p))
    teal = Decoder(
        m.model, max_seq_len=N + 2, sparse=SparseConfig(method="teal", thresholds=dec.thresholds)
    )
    assert {type(b).__name__ for b in dec.attn + dec.mlp} == {"ThresholdAttention", "ThresholdMLP"}
    assert torch.equal(decode_logits(dec, ids), decode_logits(teal, ids))
    assert relerr(decode_logits(dec, ids), hooks_logits(m.model, ids, "rsparse", p)) < 2e-2


def test_bad_plans_are_one_sentence(lm):
    m, mo = lm
    other = random_model("tiny-llama", dtype=torch.float16, seed=12).model
    cases = [
        (other, SparseConfig(method="larosa", plan=larosa_plan(m, mo)), "another model"),
        (m.model, SparseConfig(method="larosa", plan=larosa.plan(m.model, mo, 0.5, basis="none")),
         "top-k kernel"),
        (m.model, SparseConfig(method="larosa", plan=larosa_plan(m, mo, basis="layer")),
         "basis per layer or site"),
    ]  # fmt: skip
    for model, sp, match in cases:
        with pytest.raises(EngineError, match=match) as err:
            Decoder(model, max_seq_len=8, sparse=sp)
        assert "\n" not in str(err.value)
    for kw, match in [
        (dict(method="rsparse", plan=larosa_plan(m, mo)), "takes a rsparse plan"),
        (dict(method="larosa"), "needs plan="),
        (dict(method="teal", thresholds={}, factors={}), "applies to method 'rsparse'"),
        (dict(method="larosa", plan=larosa_plan(m, mo), thresholds={}), "pass plan= alone"),
    ]:
        with pytest.raises(EngineError, match=match):
            SparseConfig(**kw)
    bad = {(0, "o_in"): (torch.zeros(64, 2), torch.zeros(3, 64))}
    with pytest.raises(EngineError, match="must be \\(U \\[64, r\\]"):
        Decoder(
            m.model,
            max_seq_len=8,
            sparse=SparseConfig(method="rsparse", thresholds=keep_all(m.model), factors=bad),
        )


@pytest.mark.skipif(
    type(threshold_gemv_kernel).__name__ != "InterpretedFunction",
    reason="the kernels were decorated without TRITON_INTERPRET=1",
)
def test_the_fused_step_under_the_interpreter(lm, monkeypatch):
    """Both methods through the Triton kernels and the fused step (the term added to the
    sums) as through the references."""
    m, mo = lm
    ids = ids_of(N_PROMPT + 3, seed=6)
    for method, p in (("larosa", larosa_plan(m, mo)), ("rsparse", rsparse_plan(m, mo))):
        sp = SparseConfig(method=method, plan=p)
        ref = decode_logits(Decoder(m.model, max_seq_len=N + 2, sparse=sp), ids)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        dec = Decoder(m.model, max_seq_len=N + 2, sparse=sp)
        assert dec._fusable(torch.zeros(1, 64))
        assert relerr(decode_logits(dec, ids), ref) < 2e-2, method
        monkeypatch.setenv("TRITON_INTERPRET", "0")
