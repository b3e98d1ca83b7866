"""Each engine block alone, against the Hugging Face layer or the dense block (CPU).

A block is built by hand from one layer's weights, a cache of its own and a
:class:`~dejavu_lab.engine.attention.StepState` filled per position as the decoder fills it;
tokens are fed one at a time from position 0. The Triton kernels run under the interpreter
(``TRITON_INTERPRET=1``); fp32 blocks run PyTorch only and are compared with HF's layer.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dejavu_lab.bench.timing import relerr
from dejavu_lab.engine import KeptSets, SparseConfig, decoder_weights, dense_ops  # noqa: E402
from dejavu_lab.engine.attention import DenseAttention, StepState, ThresholdAttention  # noqa: E402
from dejavu_lab.engine.batch_blocks import BatchAttention  # noqa: E402
from dejavu_lab.engine.kept_heads import KeptHeads  # noqa: E402
from dejavu_lab.engine.mlp import CatsMLP, DenseMLP, KeptMLP, ThresholdMLP  # noqa: E402
from dejavu_lab.engine.site_thresholds import Threshold, layer_thresholds  # noqa: E402
from dejavu_lab.kernels._common import use_triton  # noqa: E402
from dejavu_lab.models import random_model  # noqa: E402

TINY = ["tiny-opt", "tiny-llama"]
S, T = 6, 16  # tokens fed; cache positions
kernels = pytest.mark.skipif(not use_triton(torch.device("cpu")),
                             reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")  # fmt: skip


def model(preset, dtype=torch.float32, seed=0):
    lm = random_model(preset, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # biases not zero (OPT), so the bias paths count
        for name, p in lm.model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


def hf_io(lm, ids, i=0):
    """Layer i's normed attention input, attention output (o_proj's), normed MLP input and MLP
    output (down's), each [S, d], from the HF model's forward over ids."""
    seen, handles = {}, []
    for name in ("ln_attn", "o", "ln_mlp", "mlp_out"):
        mod = lm.arch.part(lm.model, i, name)
        # [1, S, d], or [S, d] where OPT flattens the batch before its MLP
        hook = lambda m, a, out, name=name: seen.__setitem__(  # noqa: E731
            name, out.detach().reshape(-1, out.shape[-1])
        )
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            lm.model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen["ln_attn"], seen["o"], seen["ln_mlp"], seen["mlp_out"]


def state(w, ops="torch", window=0):
    """The StepState a decoder of max T positions over weights w makes."""
    cos = sin = None
    if w.rotary is not None:
        cos, sin = w.rotary(torch.zeros(1), torch.arange(T)[None])
        cos, sin = cos[0].to(w.dtype), sin[0].to(w.dtype)
    st = StepState(w.arch, w.device, cos=cos, sin=sin, ops=dense_ops(ops), window=window)
    st.base_t = torch.zeros(1, dtype=torch.long)
    if window:
        st.hwin = torch.zeros(w.arch.n_layers, window, w.arch.d_model, dtype=w.dtype)
    return st


def cache(w):
    a = w.arch
    return torch.zeros(2, a.n_kv_heads, T, a.d_head, dtype=w.dtype)


def feed(block, st, xs):
    """The block on each row of xs [S, d] in turn, at positions 0..S-1 (what _per_step sets)."""
    out = []
    for t in range(xs.shape[0]):
        st.pos_t = torch.tensor([t])
        st.seqlen = st.pos_t + 1
        st.mask = torch.where(torch.arange(T) <= t, 0.0, float("-inf")).to(xs.dtype)
        if st.window:
            st.slot = st.pos_t - st.base_t
            st.positions = st.base_t + torch.arange(st.window)
        else:
            st.positions = st.pos_t
        out.append(block(xs[t : t + 1]))
    return torch.cat(out)


def ids_of(seed=0):
    return torch.randint(0, 128, (1, S), generator=torch.Generator().manual_seed(seed))


def masked(x, thr):
    return torch.where(x.float().abs() > thr, x, torch.zeros_like(x))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("preset", TINY)
def test_dense_attention_is_hf_attention(preset):
    lm = model(preset)
    a_in, a_out, _, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    st = state(w)
    got = feed(DenseAttention(w.layers[0], cache(w), st), st, a_in)
    assert relerr(got, a_out) < 1e-5


@kernels
@pytest.mark.parametrize("preset", TINY)
def test_our_attention_core_is_torchs(preset):
    lm = model(preset, torch.float16)
    a_in, _, _, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    st, st_k = state(w), state(w, "attn=triton,qkv=triton")
    want = feed(DenseAttention(w.layers[0], cache(w), st), st, a_in)
    got = feed(DenseAttention(w.layers[0], cache(w), st_k), st_k, a_in)
    assert relerr(got, want) < 1e-2


@kernels
@pytest.mark.parametrize("preset", TINY)
def test_threshold_attention_masks_its_inputs(preset):
    lm = model(preset, torch.float16)
    a_in, _, _, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model, layout="columns")
    lw, st = w.layers[0], state(w)
    keep = layer_thresholds({(0, "attn_in"): -1.0, (0, "o_in"): -1.0}, w.arch, "cpu")[0]
    dense = feed(DenseAttention(lw, cache(w), st), st, a_in)
    every = ThresholdAttention(lw, cache(w), st, keep["attn_in"], keep["o_in"])
    assert relerr(feed(every, st, a_in), dense) < 1e-2  # -1 keeps every column
    thr = float(a_in.float().abs().median())  # about half the entries of attn_in dropped
    t = layer_thresholds({(0, "attn_in"): thr}, w.arch, "cpu")[0]
    got = feed(ThresholdAttention(lw, cache(w), st, t["attn_in"], None), st, a_in)
    want = feed(DenseAttention(lw, cache(w), st), st, masked(a_in, thr))
    assert relerr(got, want) < 1e-2


@kernels
@pytest.mark.parametrize("preset,window", [("tiny-opt", 0), ("tiny-opt", 8), ("tiny-llama", 0)])
def test_kept_heads_are_the_dense_block_over_those_heads(preset, window):
    lm = model(preset, torch.float16)
    a_in, _, _, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    a, lw = w.arch, w.layers[0]
    st, st_k = state(w), state(w, window=window)
    sets = KeptSets(a, SparseConfig(0.5, 0.5), "cpu", window=window)
    sets.set_indices(0, heads=[0, 3])
    block = KeptHeads(lw, cache(w), st_k, 0, sets, fused=False)
    got = feed(block, st_k, a_in)
    # the dense block's attention output with the skipped heads' outputs zeroed, then W_O
    dense = DenseAttention(lw, cache(w), st)
    o = feed(lambda x: dense.core(dense.qkv_rot(x)), st, a_in).view(S, a.n_heads, a.d_head)
    o[:, [1, 2]] = 0
    want = dense.out(o.reshape(S, -1))
    assert relerr(got, want) < 1e-2


@kernels
def test_batch_attention_is_each_rows_dense_attention():
    lm = model("tiny-llama", torch.float16)
    a_in, _, _, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    lw, a = w.layers[0], w.arch
    st = state(w)
    want = feed(DenseAttention(lw, cache(w), st), st, a_in)
    two = torch.zeros(2, 2, a.n_kv_heads, T, a.d_head, dtype=w.dtype)  # [2, B_max, Hkv, T, dh]
    bst = state(w, "attn=triton")
    block = BatchAttention(DenseAttention(lw, two, bst), two, bst)
    bst.B, bst.ar_b, bst.live_heads = 2, torch.arange(2), torch.ones(2, a.n_heads, dtype=torch.int8)
    got = []
    for t in range(S):  # both sequences fed the same tokens
        bst.pos_t = torch.tensor([t, t])
        bst.seqlen, bst.positions = bst.pos_t + 1, bst.pos_t
        got.append(block(a_in[t : t + 1].expand(2, -1).contiguous()))
    got = torch.stack(got)  # [S, 2, d]
    assert relerr(got[:, 0], want) < 1e-2 and relerr(got[:, 1], want) < 1e-2


# ----------------------------------------------------------------------------- MLP


@pytest.mark.parametrize("preset", TINY)
def test_dense_mlp_is_hf_mlp(preset):
    lm = model(preset)
    _, _, m_in, m_out = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    assert relerr(DenseMLP(w.layers[0], w)(m_in), m_out) < 1e-5


@kernels
@pytest.mark.parametrize("preset", TINY)
def test_dense_mlp_through_our_kernel_and_kept_neurons(preset):
    lm = model(preset, torch.float16)
    _, _, m_in, m_out = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    lw, n = w.layers[0], w.arch.d_mlp
    every = torch.arange(n, dtype=torch.int32)
    x = m_in[-1:]
    assert relerr(DenseMLP(lw, w, triton=True, every=every)(x), m_out[-1:]) < 1e-2
    sets = KeptSets(w.arch, SparseConfig(0.5, 0.0), "cpu", window=0)
    kept = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: sets.k_mlp]
    sets.set_indices(0, mlp=kept)
    dense = DenseMLP(lw, w)
    h = dense.hidden(x)
    h[:, ~torch.isin(torch.arange(n), kept)] = 0  # skipped neurons
    want = F.linear(h, lw.w_down_t.T, lw.b_down)
    for fused in (False, True):
        assert relerr(KeptMLP(lw, w, 0, sets, fused=fused)(x), want) < 1e-2, fused


@kernels
@pytest.mark.parametrize("preset", TINY)
def test_threshold_mlp_masks_its_inputs(preset):
    lm = model(preset, torch.float16)
    _, _, m_in, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model, layout="columns")
    lw, x = w.layers[0], m_in[-1:]
    dense = DenseMLP(lw, w)
    t_in = float(x.float().abs().median())
    h = dense.hidden(masked(x, t_in))
    t_down = float(h.float().abs().median())
    thr = layer_thresholds({(0, "mlp_in"): t_in, (0, "down_in"): t_down}, w.arch, "cpu")[0]
    block = ThresholdMLP(lw, w, thr["mlp_in"], thr["down_in"])
    assert isinstance(block.t_in.at(x), float)  # one number reaches the kernel as a float
    want = F.linear(masked(h, t_down), lw.w_down_t.T, lw.b_down)
    assert relerr(block(x), want) < 2e-2
    per_column = Threshold(None, torch.full((w.arch.d_model,), t_in))  # WINA's form
    got = ThresholdMLP(lw, w, per_column, None)(x)
    assert relerr(got, dense(masked(x, t_in))) < 1e-2


@kernels
@pytest.mark.parametrize("preset", TINY)
def test_cats_mlp_keeps_the_neurons_whose_gate_passes(preset):
    lm = model(preset, torch.float16)
    _, _, m_in, _ = hf_io(lm, ids_of())
    w = decoder_weights(lm.model)
    a, lw, x = w.arch, w.layers[0], m_in[-1:]
    g = lw.mlp_in(x).float()
    act = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}[w.activation]
    gate = act(g[:, : a.d_mlp])
    thr = float(gate.abs().median())
    block = CatsMLP(lw, w, layer_thresholds({(0, "gate"): thr}, a, "cpu")[0]["gate"])
    h = DenseMLP(lw, w).hidden(x)
    h[gate.abs() <= thr] = 0
    want = F.linear(h, lw.w_down_t.T, lw.b_down)
    assert relerr(block(x), want) < 2e-2


def test_thresholds_stay_numbers_and_tensors_stay_per_column():
    a = random_model("tiny-llama").arch
    thr = layer_thresholds({(0, "mlp_in"): 0.5, (1, "mlp_in"): torch.full((a.d_model,), 0.5)},
                           a, "cpu", keep_sites=("o_in",))  # fmt: skip
    one, two = torch.zeros(1, a.d_model), torch.zeros(2, a.d_model)
    assert thr[0]["mlp_in"].at(one) == 0.5 and thr[0]["mlp_in"].at(two).shape == (a.d_model,)
    assert thr[1]["mlp_in"].at(one).shape == (a.d_model,)  # per column: always the vector
    assert thr[0]["o_in"].value == -1.0 and thr[0]["attn_in"] is None
