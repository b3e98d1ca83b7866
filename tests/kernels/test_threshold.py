"""The TEAL/WINA threshold GEMV (:mod:`dejavu_lab.kernels.threshold`) against its PyTorch reference, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), thresholds set to keep a
target fraction (one constant: TEAL; per column: WINA), outputs poisoned with NaN so an
unwritten element fails, fp16 and bf16, batch 1 and union batches up to 32, every reduction
and tiling variant. On a GPU box the same tests check the compiled kernel:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_threshold.py
"""

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, on_device, seed

from dejavu_lab.kernels import threshold_gemv, threshold_gemv_ref
from dejavu_lab.kernels.threshold.gemv import default_config, threshold_gemv_kernel

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
D_IN, D_OUT = 200, 80  # neither a multiple of the tiles: masked tails
SMALL = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "programs": 9}  # 3 column tiles x 3 splits


def problem(dtype, batch, kept, *, per_column=False, bias=True):
    """x [B, D_IN], w_t, thr keeping about ``kept`` of each token's entries, bias, NaN out."""
    x = torch.randn(batch, D_IN, dtype=dtype)
    w_t = (torch.randn(D_IN, D_OUT) / D_IN**0.25).to(dtype)
    q = torch.quantile(x.float().abs().flatten(), 1 - kept) if 0 < kept < 1 else None
    thr = torch.full((D_IN,), float("inf") if kept == 0 else -1.0 if kept == 1 else float(q))
    if per_column and 0 < kept < 1:  # WINA: t / ||W[:, i]||, a different threshold per column
        thr = thr * (torch.rand(D_IN) + 0.5)
    b = torch.randn(D_OUT, dtype=dtype) if bias else None
    out = torch.full((batch, D_OUT), float("nan"), dtype=dtype)
    return x, w_t, thr.float(), b, out


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernel_runs_in_the_interpreter():
    assert type(threshold_gemv_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 32])
@pytest.mark.parametrize("kept", [0.0, 0.1, 0.5, 1.0])
def test_threshold_gemv(dtype, batch, kept, seed):
    x, w_t, thr, b, out = problem(dtype, batch, kept, per_column=batch == 5)
    assert threshold_gemv(x, w_t, thr, bias=b, out=out, config=SMALL) is out
    ref = threshold_gemv_ref(x, w_t, thr, bias=b)
    assert_close(out, ref, dtype, seed)
    # the reference is the dense layer fed the masked input
    xm = torch.where(x.float().abs() > thr, x.float(), 0.0).to(dtype)
    assert_close(ref, threshold_gemv_ref(xm, w_t, torch.full_like(thr, -1.0), bias=b), dtype, seed)


C = {"mode": "compact"}  # the compacting kernel (a single token runs the tile kernel by default)
VARIANTS = {
    "compact": C,
    "atomic": {**C, "reduce": "atomic"},
    "masked": {**C, "compact": False},
    "masked-atomic": {**C, "compact": False, "reduce": "atomic"},
    "one-split": {**C, "split": 1},
    "no-prefetch-acc1d": {**C, "prefetch": False, "acc2d": False},
    "many-splits-chunked": {**C, "BLOCK_D": 64, "split": 13, "num_warps": 1, "SCAN": 16},
    "prefetch-rows-only": {**C, "prefetch": 1},
    "prefetch-weights": {**C, "prefetch": 2, "compact": True, "BLOCK_R": 16},
    "dot-pipelined": {**C, "dot": True, "num_stages": 3, "programs_per_sm": 2.5},
    "dot-no-prefetch": {**C, "dot": True, "prefetch": False},
    "tile-even-columns": {"mode": "tile", "BLOCK_D": 16, "num_warps": 1},  # 80 = 5 x 16
    "tile-wide": {"mode": "tile", "BLOCK_R": 128, "BLOCK_D": 64, "fin_block": 32},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_threshold_gemv_variants(dtype, batch, variant, seed):
    x, w_t, thr, b, out = problem(dtype, batch, 0.3, per_column=True)
    threshold_gemv(x, w_t, thr, bias=b, out=out, config={**SMALL, **VARIANTS[variant]})
    assert_close(out, threshold_gemv_ref(x, w_t, thr, bias=b), dtype, seed)


@pytest.mark.parametrize("mode", ["compact", "tile"])
def test_union_batch_masks_each_token_by_its_own_rule(mode, seed):
    """A row read for one token must not leak the other tokens' sub-threshold entries."""
    dtype = torch.float16
    x, w_t, thr, _, _ = problem(dtype, 4, 0.2)
    x[1] = 0.01  # token 1 keeps nothing; the others keep their own 20%
    y = threshold_gemv(x, w_t, thr, config={**SMALL, "mode": mode})
    for b in range(4):
        alone = threshold_gemv(x[b], w_t, thr, config=SMALL)
        assert_close(y[b], alone, dtype, seed)
    assert (y[1] == 0).all()


def test_default_config_1d_and_no_bias(seed):
    dtype = torch.bfloat16
    x, w_t, thr, _, _ = problem(dtype, 1, 0.25, bias=False)
    y = threshold_gemv(x[0], w_t, thr)
    assert y.shape == (D_OUT,)
    assert_close(y, threshold_gemv_ref(x[0], w_t, thr), dtype, seed)
    assert default_config(1, D_IN, D_OUT, device=x.device)["mode"] == "tile"
    cfg = default_config(5, D_IN, D_OUT, device=x.device)
    assert cfg["reduce"] == "serial" and cfg["compact"]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("mode", ["tile", "compact"])
def test_one_threshold_as_a_number(batch, mode, seed):
    """TEAL's single threshold given as a float computes what the per-column vector does."""
    dtype = torch.float16
    x, w_t, thr, b, out = problem(dtype, batch, 0.4)
    y = threshold_gemv(x, w_t, float(thr[0]), bias=b, out=out, config={**SMALL, "mode": mode})
    assert y is out
    assert_close(out, threshold_gemv_ref(x, w_t, thr, bias=b), dtype, seed)
    assert_close(out, threshold_gemv_ref(x, w_t, float(thr[0]), bias=b), dtype, seed)
    # keep-all (-1): the tiles' rows past D_IN (200 = 12.5 x 16) must stay unread
    out.fill_(float("nan"))
    threshold_gemv(x, w_t, -1.0, bias=b, out=out, config={**SMALL, "mode": mode})
    assert_close(out, threshold_gemv_ref(x, w_t, -1.0, bias=b), dtype, seed)


def test_tile_kernel_leaves_its_workspace_at_zero(seed):
    """The finalize launch zeroes the fp32 sums, so a second call does not add to the first."""
    from dejavu_lab.kernels import _workspace

    dtype = torch.bfloat16
    x, w_t, thr, b, _ = problem(dtype, 1, 0.3, per_column=True)
    first = threshold_gemv(x, w_t, thr, bias=b)
    assert (_workspace.sums(x.device, D_OUT)[:D_OUT] == 0).all()
    x2 = torch.randn_like(x)
    second = threshold_gemv(x2, w_t, thr, bias=b)
    assert_close(first, threshold_gemv_ref(x, w_t, thr, bias=b), dtype, seed)
    assert_close(second, threshold_gemv_ref(x2, w_t, thr, bias=b), dtype, seed)


@pytest.mark.parametrize("batch", [1, 3])
def test_deterministic_is_bitwise_repeatable(batch, seed):
    """deterministic=True: no atomics, neither the compact kernel's nor the tile kernel's."""
    x, w_t, thr, b, _ = problem(torch.float16, batch, 0.4)
    for cfg in ({**SMALL, "reduce": "atomic"}, {**SMALL, "mode": "tile"}):
        first = threshold_gemv(x, w_t, thr, bias=b, deterministic=True, config=cfg)
        assert_close(first, threshold_gemv_ref(x, w_t, thr, bias=b), torch.float16, seed)
        for _ in range(2):
            again = threshold_gemv(x, w_t, thr, bias=b, deterministic=True, config=cfg)
            assert torch.equal(first, again), f"seed={seed}"


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 2])  # the tile kernel, the compacting kernel
def test_cuda_graph_capture_and_replay(batch, seed):
    x, w_t, thr, b, out = problem(torch.float16, batch, 0.3)
    threshold_gemv(x, w_t, thr, bias=b, out=out)  # allocates the workspaces, compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        threshold_gemv(x, w_t, thr, bias=b, out=out)
    for kept in (0.1, 0.6):  # new inputs, same graph: the mask is computed inside
        x.copy_(torch.randn_like(x))
        thr.fill_(float(torch.quantile(x.float().abs().flatten(), 1 - kept)))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, threshold_gemv_ref(x, w_t, thr, bias=b), torch.float16, seed)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU fallback")
def test_cpu_without_interpreter_runs_the_reference(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w_t, thr, b, _ = problem(torch.float16, 2, 0.5)
    assert torch.equal(threshold_gemv(x, w_t, thr, bias=b), threshold_gemv_ref(x, w_t, thr, bias=b))


def _ok():
    x = torch.randn(2, 32, dtype=torch.float16)
    return x, torch.randn(32, 24, dtype=torch.float16), torch.zeros(32)


@pytest.mark.parametrize(
    "mutate, exc, message",
    [
        (lambda x, w, t: (x.float(), w, t), TypeError, "float16 or bfloat16"),
        (lambda x, w, t: (x, w.bfloat16(), t), TypeError, "cast it to match"),
        (lambda x, w, t: (x, w, t.half()), TypeError, "pass float32 thresholds"),
        (lambda x, w, t: (x, w, t[:31]), ValueError, r"thr has shape \(31,\); expected \(32,\)"),
        (lambda x, w, t: (x, w, t.view(1, 32)), ValueError, "thr has shape"),
        (lambda x, w, t: (x[:, :31], w, t), ValueError, r"expected \[32\] or \[B, 32\]"),
        (lambda x, w, t: (x[:1].expand(33, 32), w, t), ValueError, "1 to 32 tokens"),
        (lambda x, w, t: (x, w.T.contiguous().T, t), ValueError, "row-major"),
        (lambda x, w, t: (x.to("meta"), w, t), ValueError, "on meta"),
        (lambda x, w, t: (x, w, t.to("meta")), ValueError, "thr is on meta"),
        (lambda x, w, t: (x, w, [0.0] * 32), TypeError, "thr must be a float or a torch.Tensor"),
        (lambda x, w, t: (x, w, float("nan")), ValueError, "thr is NaN"),
    ],
    ids=[
        "dtype",
        "mixed-dtype",
        "thr-dtype",
        "thr-length",
        "thr-dim",
        "shape",
        "batch",
        "layout",
        "device",
        "thr-device",
        "thr-type",
        "thr-nan",
    ],
)
def test_rejects_bad_inputs(mutate, exc, message):
    x, w, t = mutate(*_ok())
    with pytest.raises(exc, match=message):
        threshold_gemv(x, w, t)


def test_rejects_bad_options():
    x, w, t = _ok()
    with pytest.raises(ValueError, match=r"bias has shape \(23,\); expected \(24,\)"):
        threshold_gemv(x, w, t, bias=torch.zeros(23, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        threshold_gemv(x, w, t, out=torch.empty(2, 23, dtype=torch.float16))
    with pytest.raises(ValueError, match="reduce='tree'"):
        threshold_gemv(x, w, t, config={**SMALL, "reduce": "tree"})
    with pytest.raises(ValueError, match="BLOCK_R must be >= 16"):
        threshold_gemv(x, w, t, config={**SMALL, "BLOCK_R": 8})
    with pytest.raises(ValueError, match="mode='fast' is not 'tile' or 'compact'"):
        threshold_gemv(x[0], w, t, config={"mode": "fast"})
    with pytest.raises(ValueError, match="BLOCK_R and BLOCK_D must be >= 16 for a union batch"):
        threshold_gemv(x, w, t, config={"mode": "tile", "BLOCK_R": 8, "BLOCK_D": 16})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "activation, gated",
    [("silu", True), ("gelu", True), ("relu", False), ("gelu", False), ("none", False)],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_threshold_gemv_act(dtype, activation, gated, batch, seed):
    """The activation fused into the tile kernel's finalize equals the GEMV then torch."""
    import torch.nn.functional as F

    from dejavu_lab.kernels import threshold_gemv_act

    x, w_t, thr, b, _ = problem(dtype, batch, 0.4, per_column=activation == "gelu")
    act = {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu, "none": lambda t: t}[activation]
    a = threshold_gemv_ref(x, w_t, thr, bias=b).float()
    n = D_OUT // 2
    want = act(a[:, :n]) * a[:, n:] if gated else act(a)
    thr_arg = thr if activation == "gelu" else float(thr[0])
    h = threshold_gemv_act(x, w_t, thr_arg, activation=activation, gated=gated, bias=b)
    assert h.shape == want.shape and h.dtype == dtype
    assert_close(h, want.to(dtype), dtype, seed)
    if batch == 1:  # a 1-d token gives a 1-d result
        h1 = threshold_gemv_act(x[0], w_t, thr_arg, activation=activation, gated=gated, bias=b)
        assert h1.shape == want[0].shape
        assert_close(h1, want[0].to(dtype), dtype, seed)


def test_threshold_gemv_act_rejects_bad_options():
    from dejavu_lab.kernels import threshold_gemv_act

    x, w, t = _ok()
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        threshold_gemv_act(x[:1], w, t, activation="tanh", gated=True)
    with pytest.raises(ValueError, match="even number of columns"):
        threshold_gemv_act(x[:1], w[:, :23], t, activation="silu", gated=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="a race shows at GPU sizes only")
@pytest.mark.parametrize("mode", ["tile", "compact-atomic"])
def test_atomic_sums_are_right_call_after_call(mode, seed):
    """Twenty fresh tokens through one shared fp32 workspace at a Llama-sized shape: each sum
    must be read and re-zeroed whole (a load then a store of zeros raced on the H200)."""
    torch.manual_seed(seed)
    d_in, d_out = 2048, 4096
    w_t = (torch.randn(d_in, d_out) / d_in**0.5).half()
    cfg = {"mode": "tile"} if mode == "tile" else {"mode": "compact", "reduce": "atomic"}
    for _ in range(20):
        x = torch.randn(1, d_in, dtype=torch.float16)
        y = threshold_gemv(x, w_t, 0.7, config=cfg)
        assert_close(y, threshold_gemv_ref(x, w_t, 0.7), torch.float16, seed)
