"""The decoding engine on CPU: dense = HF, sparse with everything kept = dense, deferred KV exact.

Kernels run through their PyTorch reference here (``TRITON_INTERPRET=0``): the Triton kernels
have their own interpreter tests, and the engine's job is the plumbing around them.
"""

import pytest
import torch
from transformers import Qwen3Config

from dejavu_lab.arch import get_arch
from dejavu_lab.bench.timing import relerr
from dejavu_lab.collect import fingerprint
from dejavu_lab.engine import Decoder, EngineError, SparseConfig, predictor_bytes, step_bytes
from dejavu_lab.engine.sets import topk_into
from dejavu_lab.models import PRESETS, random_model
from dejavu_lab.predictors import PredictorConfig, Predictors

TINY = ["tiny-opt", "tiny-opt-postln", "tiny-llama"]


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def decode_logits(dec, ids, n_prompt):
    """Logits of the last prompt position and of each following token fed one by one."""
    out = [dec.prefill(ids[:, :n_prompt])]
    out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out)


@pytest.mark.parametrize("preset", TINY)
def test_dense_matches_hf(preset):
    m = random_model(preset, seed=1).model
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    got = decode_logits(Decoder(m, max_seq_len=16), ids, 8)
    with torch.no_grad():
        ref = m(ids).logits[0, 7:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", TINY)
def test_weights_taken_over_layer_by_layer_decode_the_same(preset):
    """decoder_weights(release=True): the model's copied projections are freed as the engine
    takes them (what lets OPT-30B's fp16 weights run on an 80 GB card), the tokens unchanged."""
    from dejavu_lab.engine import decoder_weights

    m = random_model(preset, seed=1).model
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    want = decode_logits(Decoder(m, max_seq_len=16), ids, 8)
    arch = get_arch(m)
    parts = [arch.part(m, i, p).weight for i in range(arch.n_layers) for p in ("q", "o", "mlp_out")]
    w = decoder_weights(m, release=True)
    assert all(p.numel() == 0 for p in parts)  # the copied projections are gone
    torch.testing.assert_close(decode_logits(Decoder(w, max_seq_len=16), ids, 8), want)


def test_out_of_memory_while_copying_says_what_to_do(monkeypatch):
    import dejavu_lab.engine.decoder as decoder_module

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(decoder_module, "decoder_weights", full)
    with pytest.raises(EngineError, match=r"release=True") as err:
        Decoder(random_model("tiny-opt").model, max_seq_len=8)
    assert str(err.value).count(". ") == 0  # one sentence


@pytest.mark.slow
def test_demo_dense_logits_and_greedy_generation(demo):
    model, tok, _ = demo
    ids = tok("The history of the city begins", return_tensors="pt").input_ids
    dec = Decoder(model, max_seq_len=ids.shape[1] + 40)
    with torch.no_grad():
        ref = model(ids).logits[0, -3:]
    got = decode_logits(dec, ids, ids.shape[1] - 2)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    hf = model.generate(ids, max_new_tokens=32, do_sample=False)
    ours = dec.generate(ids, max_new_tokens=32)
    assert ours.tolist() == hf.tolist()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("preset", [*TINY, "tiny-llama-mha"])
def test_sparse_with_everything_kept_matches_dense(preset, fused):
    kw = {"num_key_value_heads": 4} if preset == "tiny-llama-mha" else {}
    m = random_model(preset.removesuffix("-mha"), dtype=torch.bfloat16, seed=2, **kw).model
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    dense = decode_logits(Decoder(m, max_seq_len=16), ids, 6)
    sparse = decode_logits(Decoder(m, max_seq_len=16, sparse=SparseConfig(fused=fused)), ids, 6)
    assert relerr(sparse, dense) < 2e-2


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("preset", ["tiny-opt", "tiny-llama-mha"])
def test_deferred_kv_is_exact(preset, fused):
    """Skipped heads' K/V, recomputed from the stored window, equal K/V computed every step."""
    kw = {"num_key_value_heads": 4} if preset == "tiny-llama-mha" else {}
    m = random_model(preset.removesuffix("-mha"), dtype=torch.bfloat16, seed=3, **kw).model
    deferred = Decoder(m, max_seq_len=32, sparse=SparseConfig(0.5, 0.5, kv_window=3, fused=fused))
    eager = Decoder(m, max_seq_len=32, sparse=SparseConfig(0.5, 0.5, kv_window=0, fused=fused))
    assert deferred.window == 3 and eager.window == 0
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    deferred.prefill(ids)
    eager.prefill(ids)
    g = torch.Generator().manual_seed(3)
    arch = deferred.arch
    for step in range(10):  # crosses three window flushes; the kept heads change every step
        for i in range(arch.n_layers):
            heads = torch.randperm(arch.n_heads, generator=g)[: deferred.k_heads]
            mlp = torch.randperm(arch.d_mlp, generator=g)[: deferred.k_mlp]
            for dec in (deferred, eager):
                dec.set_indices(i, mlp=mlp, heads=heads)
        tok = int(torch.randint(0, 128, (1,), generator=g))
        assert relerr(deferred.step(tok), eager.step(tok)) < 1e-3, step
    assert deferred.base > 6  # the window was flushed


def test_lookahead_predictors_in_the_loop():
    lm = random_model("tiny-opt", dtype=torch.bfloat16, seed=4)
    pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    dec = Decoder(lm.model, max_seq_len=24, sparse=SparseConfig(0.75, 0.5), predictors=pred)
    x = torch.randn(1, lm.arch.d_model, dtype=torch.bfloat16)
    for i in range(lm.arch.n_layers):  # the fused evaluation equals the predictors' own
        ms, hs = dec.sets.scores(i, x)
        torch.testing.assert_close(ms, pred.mlp_scores(i, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hs, pred.head_scores(i, x), atol=1e-5, rtol=1e-5)
    out = dec.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6)
    assert out.shape == (1, 10)
    assert dec.sets.mlp_idx.shape == (lm.arch.n_layers, 64)  # 25% of 256 neurons kept
    assert all(row.unique().numel() == 64 for row in dec.sets.mlp_idx)


def test_kernel_choices_each_decode_the_same_tokens():
    """The settings the first capture times on a GPU (DecodeLoop._time_choices): with predictors
    the kept sets by torch.topk or our select kernel times the two down kernels, with sets given
    only the down kernels, none when told not to; each choice decodes the same greedy tokens."""
    lm = random_model("tiny-opt", dtype=torch.bfloat16, seed=4)
    pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead"))
    dec = Decoder(lm.model, max_seq_len=24, sparse=SparseConfig(0.75, 0.5), predictors=pred)
    choices = dec._kernel_choices()
    assert {(c["topk_kernel"], c["down_mode"]) for c in choices} == {
        (t, d) for t in (False, True) for d in ("split", "tile")
    }
    prompt, outs = torch.tensor([[1, 2, 3, 4]]), []
    for c in choices:
        dec._apply_choice(c)
        assert dec.sets.down_config == {"mode": c["down_mode"]}
        outs.append(dec.generate(prompt, max_new_tokens=5, graph=False))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    fixed = Decoder(lm.model, max_seq_len=24, sparse=SparseConfig(0.75, 0.5))
    assert [c["down_mode"] for c in fixed._kernel_choices()] == ["split", "tile"]
    off = Decoder(lm.model, max_seq_len=24, sparse=SparseConfig(0.75, 0.5, tune_kernels=False))
    assert off._kernel_choices() == [] and Decoder(lm.model, max_seq_len=8)._kernel_choices() == []
    int4 = Decoder(
        lm.model, max_seq_len=24, sparse=SparseConfig(0.75, 0.5), weights="int4", group=32
    )
    assert int4._kernel_choices() == [{"topk_kernel": False, "down_mode": None}]  # its own GEMVs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_first_capture_times_the_kernel_choices_and_decodes_as_eager(monkeypatch):
    """On a GPU: capture() times each choice (replays set back to this position: the window's
    row stays in range), keeps the fastest, and the graph then decodes past the window as the
    eager step does (the first token, before any rounding can flip a later choice)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lm = random_model("tiny-opt", dtype=torch.float16, seed=4, device="cuda")
    pred = Predictors(fingerprint(lm.model, lm.arch), PredictorConfig(mode="lookahead")).cuda()
    prompt = torch.tensor([[1, 2, 3, 4]], device="cuda")
    dec = Decoder(lm.model, max_seq_len=48, sparse=SparseConfig(0.75, 0.5), predictors=pred)
    graph = dec.generate(prompt, max_new_tokens=30)  # past the 16-token window: a flush
    assert dec.kernel_choice["chosen"] in dec.kernel_choice["choices"]
    assert len(dec.kernel_choice["ms"]) == 4 and min(dec.kernel_choice["ms"]) > 0
    eager = Decoder(lm.model, max_seq_len=48, sparse=SparseConfig(0.75, 0.5), predictors=pred)
    eager._apply_choice(dec.kernel_choice["chosen"])
    ref = eager.generate(prompt, max_new_tokens=30, graph=False)
    assert graph.shape == ref.shape == (1, 34) and torch.equal(graph[:, :6], ref[:, :6])


def test_topk_into_by_rows():
    """A batch of rows (32 x Llama-3-8B's 14,336) keeps each row's top-k, into views of larger
    buffers as the batched engine passes them; our select and torch.topk keep the same sets."""
    s = torch.randn(32, 14336, generator=torch.Generator().manual_seed(0))
    vals, idx = torch.zeros(2, 40, 2000), torch.zeros(2, 40, 2000, dtype=torch.long)
    ref = torch.topk(s, 2000, dim=-1)
    for kernel in (True, False):
        topk_into(s, 2000, vals[1, :32], idx[1, :32], kernel=kernel)
        for r in range(32):
            assert set(idx[1, r].tolist()) == set(ref.indices[r].tolist())
        assert torch.equal(s.gather(1, idx[1, :32]), vals[1, :32]) and not idx[0].any()


def test_clear_errors():
    m32 = random_model("tiny-opt").model
    with pytest.raises(EngineError, match="fp16/bf16"):
        Decoder(m32, max_seq_len=8, sparse=SparseConfig(0.5, 0.5))
    with pytest.raises(EngineError, match="side_priority='high' must be an int"):
        SparseConfig(0.5, 0.5, side_priority="high")
    dec = Decoder(m32, max_seq_len=8)
    with pytest.raises(EngineError, match="larger max_seq_len"):
        dec.prefill(torch.arange(8)[None])
    with pytest.raises(EngineError, match="prefill"):
        dec.step(1)
    dec.prefill(torch.arange(4)[None])
    with pytest.raises(EngineError, match="GPU"):
        dec.capture()
    with pytest.raises(EngineError, match="exceed"):
        dec.generate(torch.arange(4)[None], max_new_tokens=6)
    with pytest.raises(EngineError, match="kv_window"):
        SparseConfig(kv_window=64)
    qwen3 = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=64,
        head_dim=16,
    )
    with pytest.raises(EngineError, match="q/k norms|not one"):
        Decoder(random_model(qwen3).model, max_seq_len=8)


def test_bytes_model():
    arch = get_arch(PRESETS["opt-30b"].config())
    dense = step_bytes(arch, vocab=50272, context=0)
    # 59.9 GB: the blocks plus lm_head, as the H200 dense-decode probe of 2026-11-30 counted
    assert dense["total"] == pytest.approx(59.91e9, rel=0.005)
    sparse = step_bytes(
        arch,
        vocab=50272,
        context=0,
        mlp_kept=0.15,
        head_kept=0.5,
        predictors=predictor_bytes(arch, 64, 32),
    )
    assert sparse["mlp"] == pytest.approx(0.15 * dense["mlp"])
    assert sparse["attention"] == pytest.approx(0.5 * dense["attention"])  # deferred KV (MHA)
    assert 3.0 < dense["total"] / sparse["total"] < 3.6
