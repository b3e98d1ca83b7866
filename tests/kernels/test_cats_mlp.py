"""The CATS MLP (:mod:`dejavu_lab.kernels.cats.mlp`) against its PyTorch reference and the fused
sparse MLP over the neurons its thresholds keep (TRITON_INTERPRET=1).

Fresh random inputs every run (the seed is in each failure message), per-neuron thresholds,
ReLU/GELU MLPs with biases and SwiGLU/GeGLU gated MLPs, outputs poisoned with NaN, fp16 and
bf16, batch 1 and union batches up to 32. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_cats_mlp.py
"""

import pytest
import torch
from helpers import CASES, DEVICE, DTYPES, D, N, assert_close, mlp, on_device, pick, seed, small

from dejavu_lab.kernels import (
    cats_mlp,
    cats_mlp_ref,
    fused_sparse_mlp,
    fused_sparse_mlp_ref,
)

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


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


# --------------------------------------------------------------------------- bad inputs
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
