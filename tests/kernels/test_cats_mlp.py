"""The fused sparse MLP and CATS kernels against their PyTorch references (TRITON_INTERPRET=1).

Fresh random inputs every run (the seed is in each failure message), unsorted distinct kept
neurons, ReLU/GELU MLPs with biases and SwiGLU/GeGLU gated MLPs, outputs poisoned with NaN,
fp16 and bf16, batch 1 and union batches up to 32, every tiling. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/test_kernels_fused.py
"""

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, assert_close, on_device, pick, seed

from dejavu_lab.kernels import (
    cats_mlp,
    cats_mlp_ref,
    fused_sparse_mlp,
    fused_sparse_mlp_ref,
)
from dejavu_lab.kernels.mlp.fused import default_config, fused_mlp_kernel

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
N, D = 96, 80  # neurons, model width (not multiples of the tiles: masked tails)
CASES = {  # (activation, gated, biases)
    "relu-bias": ("relu", False, True),
    "gelu": ("gelu", False, False),
    "swiglu": ("silu", True, False),
    "geglu-tanh-bias": ("gelu_tanh", True, True),
}


def small(batch, **extra):
    cfg = {"BLOCK_N": 4 if batch == 1 else 16, "BLOCK_K": 32, "BLOCK_C": 32, "num_warps": 4}
    cfg["down"] = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "programs": 8}
    return {**cfg, **extra}


def mlp(dtype, batch, case):
    act, gated, biased = CASES[case]
    x = torch.randn(batch, D, dtype=dtype)
    w_in = (torch.randn(2 * N if gated else N, D) / D**0.5).to(dtype)
    w_down_t = (torch.randn(N, D) / N**0.5).to(dtype)
    b_in = (torch.randn(w_in.shape[0]) / 2).to(dtype) if biased else None
    b_down = torch.randn(D, dtype=dtype) if biased else None
    out = torch.full((batch, D), float("nan"), dtype=dtype)
    kw = dict(activation=act, b_in=b_in, b_down=b_down)
    return x, w_in, w_down_t, out, gated, kw


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernel_runs_in_the_interpreter():
    assert type(fused_mlp_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------- fused sparse MLP
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kept", [0.1, 1.0])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_sparse_mlp(dtype, batch, kept, case, seed):
    x, w_in, w_down_t, out, gated, kw = mlp(dtype, batch, case)
    idx = pick(N, kept)
    got = fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, out=out, config=small(batch), **kw)
    assert got is out
    ref = fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw)
    assert_close(out, ref, dtype, seed)
    if kept == 1.0:  # every neuron kept: the dense MLP, in fp32 from the model's own layers
        dense = torch.nn.functional.linear(
            x.float(), w_in.float(), None if kw["b_in"] is None else kw["b_in"].float()
        )
        act = {
            "relu": torch.relu,
            "gelu": torch.nn.functional.gelu,
            "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        }[kw["activation"]]
        h = act(dense[:, :N]) * dense[:, N:] if gated else act(dense)
        y = h @ w_down_t.float() + (0 if kw["b_down"] is None else kw["b_down"].float())
        assert_close(out, y.to(dtype), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("variant", ["deterministic", "wide-tiles", "dot"])
def test_fused_sparse_mlp_variants(dtype, batch, variant, seed):
    x, w_in, w_down_t, out, gated, kw = mlp(dtype, batch, "swiglu")
    idx = pick(N, 0.4)
    cfg = small(batch)
    extra = {}
    if variant == "deterministic":
        extra["deterministic"] = True
    elif variant == "dot":  # tensor-core path at every batch (batch 1 padded to 16)
        cfg.update(BLOCK_N=16, dot=True, num_stages=3)
    else:  # whole rows in one step (BLOCK_K, BLOCK_C >= d), more neurons per program
        cfg.update(BLOCK_N=16 if batch == 1 else 32, BLOCK_K=128, BLOCK_C=128)
    fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, out=out, config=cfg, **extra, **kw)
    assert_close(out, fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw), dtype, seed)


def test_fused_batch_32_default_config_1d_and_empty(seed):
    dtype = torch.float16
    x, w_in, w_down_t, _, gated, kw = mlp(dtype, 32, "geglu-tanh-bias")
    idx = pick(N, 0.5)
    y = fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, config=small(32), **kw)
    assert_close(y, fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw), dtype, seed)
    y1 = fused_sparse_mlp(x[0], w_in, w_down_t, idx, gated=gated, **kw)  # default config
    assert y1.shape == (D,)
    assert_close(
        y1, fused_sparse_mlp_ref(x[0], w_in, w_down_t, idx, gated=gated, **kw), dtype, seed
    )
    none = fused_sparse_mlp(x, w_in, w_down_t, pick(N, 0.0), gated=gated, **kw)
    assert torch.equal(none, kw["b_down"].expand(32, D))
    assert default_config("fused", 1, D, 40, N, device=x.device)["mode"] == "two"


def test_the_removed_one_launch_mode_is_refused():
    x, w_in, w_down_t, _, gated, kw = mlp(torch.float16, 1, "swiglu")
    with pytest.raises(ValueError, match="mode='atomic' was removed"):
        fused_sparse_mlp(
            x, w_in, w_down_t, pick(N, 0.5), gated=gated, config=small(1, mode="atomic"), **kw
        )
    with pytest.raises(ValueError, match="mode='atomic' was removed"):
        cats_mlp(x, w_in, w_down_t, torch.zeros(N), config={"mode": "atomic"}, **kw)


def test_fused_deterministic_is_bitwise_repeatable(seed):
    x, w_in, w_down_t, _, gated, kw = mlp(torch.float16, 3, "swiglu")
    idx = pick(N, 0.5)
    args = (x, w_in, w_down_t, idx)
    first = fused_sparse_mlp(*args, gated=gated, deterministic=True, config=small(3), **kw)
    again = fused_sparse_mlp(*args, gated=gated, deterministic=True, config=small(3), **kw)
    assert torch.equal(first, again), f"seed={seed}"


# ------------------------------------------------------------------------------------ CATS
def cats_thr(x, w_in, kw, kept):
    """A CATS threshold keeping about ``kept`` of the |act(gate)| entries."""
    gate = (x.float() @ w_in[:N].float().T) + (0 if kw["b_in"] is None else kw["b_in"][:N].float())
    act = {
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    }[kw["activation"]]
    if kept >= 1:
        return torch.full((N,), -1.0)
    q = torch.quantile(act(gate).abs().flatten(), 1 - kept)
    return (q * (torch.rand(N) * 0.4 + 0.8)).float()  # per-neuron thresholds around it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_cats_mlp(dtype, batch, case, seed):
    x, w_in, w_down_t, out, _, kw = mlp(dtype, batch, case)
    thr = cats_thr(x, w_in, kw, 0.3)
    cfg = small(batch, BLOCK_N=16)
    assert cats_mlp(x, w_in, w_down_t, thr, out=out, config=cfg, **kw) is out
    assert_close(out, cats_mlp_ref(x, w_in, w_down_t, thr, **kw), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 4])
def test_cats_deterministic_and_extremes(dtype, batch, seed):
    x, w_in, w_down_t, out, gated, kw = mlp(dtype, batch, "geglu-tanh-bias")
    thr = cats_thr(x, w_in, kw, 0.5)
    cfg = small(batch, BLOCK_N=16)
    cats_mlp(x, w_in, w_down_t, thr, out=out, deterministic=True, config=cfg, **kw)
    assert_close(out, cats_mlp_ref(x, w_in, w_down_t, thr, **kw), dtype, seed)
    # thr = -inf keeps every neuron: the dense MLP, which is the fused MLP over all neurons
    every = cats_mlp(x, w_in, w_down_t, torch.full((N,), -float("inf")), config=cfg, **kw)
    dense = fused_sparse_mlp_ref(x, w_in, w_down_t, torch.arange(N), gated=gated, **kw)
    assert_close(every, dense, dtype, seed)
    # thr = inf drops every neuron: only the down bias is left
    none = cats_mlp(x, w_in, w_down_t, torch.full((N,), float("inf")), config=cfg, **kw)
    assert torch.equal(none, kw["b_down"].expand(batch, D))


def test_cats_matches_fused_on_its_kept_set(seed):
    """One token: CATS equals the fused MLP over the neurons its threshold keeps."""
    dtype = torch.float16
    x, w_in, w_down_t, _, gated, kw = mlp(dtype, 1, "swiglu")
    thr = cats_thr(x, w_in, kw, 0.25)
    a = torch.nn.functional.silu(x.float() @ w_in[:N].float().T)[0]
    idx = torch.nonzero(a.abs() > thr).flatten().to(torch.int32)
    y = cats_mlp(x, w_in, w_down_t, thr, config=small(1, BLOCK_N=16), **kw)
    ref = fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw)
    assert_close(y, ref, dtype, seed)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay(seed):
    x, w_in, w_down_t, out, gated, kw = mlp(torch.float16, 1, "swiglu")
    thr = cats_thr(x, w_in, kw, 0.3).cuda()
    idx = pick(N, 0.3)
    out2 = out.clone()
    cats_mlp(x, w_in, w_down_t, thr, out=out, **kw)
    fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, out=out2, validate=False, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cats_mlp(x, w_in, w_down_t, thr, out=out, **kw)
        fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, out=out2, validate=False, **kw)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, cats_mlp_ref(x, w_in, w_down_t, thr, **kw), torch.float16, seed)
        ref2 = fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw)
        assert_close(out2, ref2, torch.float16, seed)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU fallback")
def test_cpu_without_interpreter_runs_the_references(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w_in, w_down_t, _, gated, kw = mlp(torch.float16, 2, "relu-bias")
    idx = pick(N, 0.5)
    got = fused_sparse_mlp(x, w_in, w_down_t, idx, gated=gated, **kw)
    assert torch.equal(got, fused_sparse_mlp_ref(x, w_in, w_down_t, idx, gated=gated, **kw))
    thr = torch.zeros(N)
    assert torch.equal(
        cats_mlp(x, w_in, w_down_t, thr, **kw), cats_mlp_ref(x, w_in, w_down_t, thr, **kw)
    )


# ------------------------------------------------------------------------------ bad inputs
def test_fused_rejects_bad_inputs():
    x, w_in, w_down_t, _, _, _ = mlp(torch.float16, 2, "swiglu")
    idx = pick(N, 0.5)
    with pytest.raises(ValueError, match=r"w_in has shape \(192, 80\); expected \(96, 80\)"):
        fused_sparse_mlp(x, w_in, w_down_t, idx, activation="silu", gated=False)
    with pytest.raises(ValueError, match="activation 'swish'"):
        fused_sparse_mlp(x, w_in, w_down_t, idx, activation="swish", gated=True)
    with pytest.raises(ValueError, match="duplicate"):
        fused_sparse_mlp(x, w_in, w_down_t, torch.tensor([1, 1]), activation="silu", gated=True)
    with pytest.raises(ValueError, match=r"must lie in \[0, 95\]"):
        fused_sparse_mlp(x, w_in, w_down_t, torch.tensor([96]), activation="silu", gated=True)
    with pytest.raises(TypeError, match="cast it to match"):
        fused_sparse_mlp(x, w_in.bfloat16(), w_down_t, idx, activation="silu", gated=True)
    with pytest.raises(ValueError, match="both hold rows of length d = 80"):
        fused_sparse_mlp(x, w_in[:, :40], w_down_t, idx, activation="silu", gated=True)
    with pytest.raises(ValueError, match="1 to 32 tokens"):
        fused_sparse_mlp(x[:1].expand(33, D), w_in, w_down_t, idx, activation="silu", gated=True)
    with pytest.raises(ValueError, match=r"b_down has shape \(79,\); expected \(80,\)"):
        fused_sparse_mlp(
            x,
            w_in,
            w_down_t,
            idx,
            activation="silu",
            gated=True,
            b_down=torch.zeros(79, dtype=torch.float16),
        )
    with pytest.raises(ValueError, match="BLOCK_N must be >= 16"):
        fused_sparse_mlp(
            x, w_in, w_down_t, idx, activation="silu", gated=True, config={**small(2), "BLOCK_N": 4}
        )


def test_cats_rejects_bad_inputs():
    x, w_in, w_down_t, _, _, _ = mlp(torch.float16, 2, "swiglu")
    thr = torch.zeros(N)
    with pytest.raises(ValueError, match="expected 2n = 192"):
        cats_mlp(x, w_in[:100], w_down_t, thr, activation="silu")
    with pytest.raises(TypeError, match="pass float32 thresholds"):
        cats_mlp(x, w_in, w_down_t, thr.half(), activation="silu")
    with pytest.raises(ValueError, match=r"thr has shape \(95,\); expected \(96,\)"):
        cats_mlp(x, w_in, w_down_t, thr[:95], activation="silu")
    with pytest.raises(ValueError, match="thr is on meta"):
        cats_mlp(x, w_in, w_down_t, thr.to("meta"), activation="silu")
    with pytest.raises(ValueError, match="row-major"):
        cats_mlp(x, w_in, w_down_t.T.contiguous().T, thr, activation="silu")
