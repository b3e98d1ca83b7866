"""The engine's TEAL, WINA and CATS paths and its dense-op choice, on CPU.

Keeping everything (thresholds -1) gives the dense logits; calibrated thresholds give the logits
and greedy tokens of a plain-PyTorch reference: the Hugging Face model decoding with a KV cache,
its linear layers' inputs masked per token by hooks (|x| > thr; CATS: |act(gate)| > thr). The
kernels run through their PyTorch references here (``TRITON_INTERPRET=0``) except in the test
marked ``interpreter``, which runs the Triton kernels themselves under the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _hf import kv_forward

from dejavu_lab.bench.timing import relerr
from dejavu_lab.engine import (  # noqa: E402
    Decoder,
    EngineError,
    SparseConfig,
    calibrate_thresholds,
    decoder_weights,
    keep_all,
)
from dejavu_lab.kernels.threshold.gemv import threshold_gemv_kernel  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402

TINY = ["tiny-opt", "tiny-llama"]
METHODS = ["teal", "wina", "cats"]
ACT = {"relu": torch.relu, "silu": F.silu, "gelu": F.gelu}


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def ids_of(n, seed=0):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def model_of(preset, seed):
    """A tiny fp16 model whose biases (OPT's) are not zero, so the kernels' bias paths count."""
    lm = random_model(preset, dtype=torch.float16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


def decode_logits(dec, ids, n_prompt):
    out = [dec.prefill(ids[:, :n_prompt])]
    out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out)


class MaskedHF:
    """The HF model with each decoded token's site inputs masked by hooks (the reference)."""

    def __init__(self, lm, thresholds, method):
        self.model, self.arch, self.thr, self.method = lm.model, lm.arch, thresholds, method
        self.active, self.handles, self.gate_mask = False, [], {}
        for i in range(self.arch.n_layers):
            part = lambda name, i=i: self.arch.part(self.model, i, name)  # noqa: E731
            gate, *_ = self.arch.mlp_in(self.model, i)
            if method == "cats":
                self._forward(gate, i)
                self._pre(part("mlp_out"), i, None)
                continue
            for m in (part("q"), part("k"), part("v")):
                self._pre(m, i, "attn_in")
            self._pre(part("o"), i, "o_in")
            for m in self.arch.mlp_in(self.model, i):
                self._pre(m, i, "mlp_in")
            self._pre(part("mlp_out"), i, "down_in")

    def _pre(self, module, i, site):
        def hook(mod, args):
            if not self.active:
                return None
            x = args[0]
            if site is None:  # CATS: the neurons whose |act(gate)| passed
                return (x * self.gate_mask[i].to(x.dtype),)
            thr = self.thr.get((i, site))
            return None if thr is None else (torch.where(x.float().abs() > thr, x, 0),)

        self.handles.append(module.register_forward_pre_hook(hook))

    def _forward(self, module, i):
        act = ACT[self.arch.activation if self.arch.activation != "swish" else "silu"]

        def hook(mod, args, out):
            self.gate_mask[i] = act(out.float()).abs() > self.thr[(i, "gate")]

        self.handles.append(module.register_forward_hook(hook))

    @torch.no_grad()
    def decode_logits(self, ids, n_prompt, greedy=0):
        """Prefill densely, then feed ids[n_prompt:] (or ``greedy`` argmax tokens) masked."""
        out, past = kv_forward(self.model, ids[:, :n_prompt])
        logits = [out[0, -1:]]
        feed = list(ids[0, n_prompt:]) if not greedy else []
        tokens = []
        self.active = True
        try:
            for t in range(greedy or len(feed)):
                tok = feed[t] if not greedy else logits[-1].argmax(-1)[0]
                tokens.append(int(tok))
                out, past = kv_forward(self.model, tok.view(1, 1), past)
                logits.append(out[0, -1:])
        finally:
            self.active = False
        return torch.cat(logits), tokens

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("method", METHODS)
def test_keep_all_thresholds_equal_dense(preset, method):
    m = model_of(preset, seed=1).model
    ids = ids_of(10)
    dense = decode_logits(Decoder(m, max_seq_len=16), ids, 6)
    sp = SparseConfig(method=method, thresholds=keep_all(m, method))
    got = decode_logits(Decoder(m, max_seq_len=16, sparse=sp), ids, 6)
    assert relerr(got, dense) < 1e-2


@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("method", METHODS)
def test_thresholds_match_a_masked_reference(preset, method):
    lm = model_of(preset, seed=2)
    ids = ids_of(14, seed=1)
    thr = calibrate_thresholds(lm.model, ids[:, :8], 0.7, method=method)  # ReLU: > its zeros
    dec = Decoder(lm.model, max_seq_len=24, sparse=SparseConfig(method=method, thresholds=thr))
    ref = MaskedHF(lm, thr, method)
    try:
        want, _ = ref.decode_logits(ids, 8)
        dense = decode_logits(Decoder(lm.model, max_seq_len=24), ids, 8)
        got = decode_logits(dec, ids, 8)
        assert relerr(got, want) < 2e-2
        assert relerr(dense, want) > 5 * relerr(got, want)  # the masks change the logits
        _, tokens = ref.decode_logits(ids[:, :8], 8, greedy=6)
        assert dec.generate(ids[:, :8], 6)[0, 8:].tolist() == tokens
    finally:
        ref.remove()


def test_calibrated_thresholds_drop_their_share():
    lm = random_model("tiny-llama", dtype=torch.float16, seed=3)
    ids = ids_of(32, seed=2)
    dec = Decoder(lm.model, max_seq_len=40)
    for method in ("teal", "wina", "cats"):
        thr = calibrate_thresholds(lm.model, ids, 0.4, method=method)
        seen = {}
        dec._taps = lambda i, site, x, seen=seen: seen.setdefault((i, site), x.float().abs())
        dec.prefill(ids)
        dec._taps = None
        for key, t in thr.items():
            score = seen[key][-4:]  # the last eighth of the 32 positions, as calibrated
            if method == "wina":  # WINA's thresholds are per column: |x_i| > t / ||W[:, i]||
                assert t.unique().numel() > 1
            kept = (score > t).float().mean().item()
            assert kept == pytest.approx(0.6, abs=0.02), (method, key)


def test_thresholds_keep_their_share_at_the_positions_that_follow():
    """Decode steps come after the prompt: W_O's input shrinks with the position (attention
    averages more values), so thresholds from the whole prefill keep too little there."""
    lm = random_model("tiny-llama", dtype=torch.float32, seed=0)
    ids = ids_of(320, seed=0)
    thr = calibrate_thresholds(lm.model, ids[:, :256], 0.5)
    seen = {}
    dec = Decoder(lm.model, max_seq_len=321)
    dec._taps = lambda i, site, x: seen.setdefault((i, site), x.float().abs())
    dec.prefill(ids)
    for (i, site), t in thr.items():
        after = seen[(i, site)][256:]  # the 64 positions a decode would run next
        whole = float(torch.quantile(seen[(i, site)][:256].flatten(), 0.5))
        kept = (after > t).float().mean().item()
        assert kept == pytest.approx(0.5, abs=0.08), (i, site)
        if site == "o_in":  # the whole prefill's threshold: well below the asked share
            assert (after > whole).float().mean().item() < kept - 0.05, i


def test_dense_ops_through_our_kernels_equal_torch():
    m = random_model("tiny-llama", dtype=torch.float16, seed=4).model
    ids = ids_of(10, seed=3)
    w = decoder_weights(m, layout="both")
    torch_ = decode_logits(Decoder(w, max_seq_len=16), ids, 6)
    for ops in ("triton", "qkv=triton,mlp=triton", {"attn": "triton", "o": "triton"}):
        got = decode_logits(Decoder(w, max_seq_len=16, dense_ops=ops), ids, 6)
        assert relerr(got, torch_) < 1e-2, ops
    cols = decoder_weights(m, layout="columns")  # our kernels over the transposed layout
    got = decode_logits(Decoder(cols, max_seq_len=16, dense_ops="triton"), ids, 6)
    assert relerr(got, torch_) < 1e-2


def test_one_copy_of_the_weights_serves_every_method():
    m = model_of("tiny-opt", seed=5).model
    w = decoder_weights(m, layout="both")
    ids = ids_of(8, seed=4)
    outs = [Decoder(w, max_seq_len=16).generate(ids, 4)]
    for method in METHODS:
        sp = SparseConfig(method=method, thresholds=keep_all(w, method))
        outs.append(Decoder(w, max_seq_len=16, sparse=sp).generate(ids, 4))
    outs.append(Decoder(w, max_seq_len=16, sparse=SparseConfig()).generate(ids, 4))
    assert all(o.tolist() == outs[0].tolist() for o in outs)
    assert w.nbytes("layers") == decoder_weights(m).nbytes("layers")  # one layout counted


def test_clear_errors_for_methods():
    m = random_model("tiny-llama", dtype=torch.float16).model
    d, n = 64, 192
    bad = [
        ({(0, "attn_in"): torch.zeros(d - 1)}, "has 63 entries but site attn_in"),
        ({(0, "up_in"): torch.zeros(d)}, "site 'up_in', which method 'teal' does not use"),
        ({(5, "mlp_in"): torch.zeros(d)}, "layer 5 but the model has layers 0..1"),
        ({(0, "down_in"): torch.zeros(2, n)}, "1-D tensor"),
        ({"mlp_in": torch.zeros(d)}, r"\(layer: int, site: str\)"),
        (None, "needs thresholds"),
    ]
    for thresholds, match in bad:
        with pytest.raises(EngineError, match=match) as err:
            Decoder(m, max_seq_len=8, sparse=SparseConfig(method="teal", thresholds=thresholds))
        assert "\n" not in str(err.value)
    with pytest.raises(EngineError, match="not one the engine runs"):
        SparseConfig(method="topk")
    with pytest.raises(EngineError, match="leave them at 0"):
        SparseConfig(0.5, method="cats", thresholds={})
    with pytest.raises(EngineError, match="apply to methods teal, wina and cats"):
        SparseConfig(0.5, thresholds={})
    with pytest.raises(EngineError, match="layout='columns'"):  # TEAL reads W_QKV^T
        Decoder(
            decoder_weights(m),
            max_seq_len=8,
            sparse=SparseConfig(method="teal", thresholds=keep_all(m)),
        )
    with pytest.raises(EngineError, match="fp16/bf16"):
        Decoder(
            random_model("tiny-llama").model,
            max_seq_len=8,
            sparse=SparseConfig(method="cats", thresholds={}),
        )
    with pytest.raises(EngineError, match="dense_ops"):
        Decoder(m, max_seq_len=8, dense_ops="mlp=cutlass")
    with pytest.raises(EngineError, match="sparsity"):
        calibrate_thresholds(m, ids_of(8), 1.0)


@pytest.mark.skipif(
    type(threshold_gemv_kernel).__name__ != "InterpretedFunction",
    reason="the kernels were decorated without TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("method", ["teal", "cats", "dejavu"])
def test_triton_kernels_under_the_interpreter(method, monkeypatch):
    """The same step through the Triton kernels (interpreter) as through their references."""
    lm = random_model("tiny-llama", dtype=torch.float16, seed=6)
    ids = ids_of(9, seed=5)
    if method == "dejavu":
        sp = SparseConfig(0.5, 0.5)
    else:
        sp = SparseConfig(
            method=method, thresholds=calibrate_thresholds(lm.model, ids[:, :6], 0.5, method=method)
        )
    ref = decode_logits(Decoder(lm.model, max_seq_len=12, sparse=sp), ids, 6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = decode_logits(Decoder(lm.model, max_seq_len=12, sparse=sp, dense_ops="triton"), ids, 6)
    assert relerr(got, ref) < 2e-2
