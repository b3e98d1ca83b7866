"""CATS's thresholded up kernel (:mod:`dejavu_lab.kernels.cats.up`) against its reference, and
the CATS MLP's fused-gate path (TRITON_INTERPRET=1; tiny shapes, masked tails).

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_cats.py
"""

import pytest
import torch
from helpers import DTYPES, assert_close, on_device, seed

from dejavu_lab.kernels import cats_mlp, cats_mlp_ref, cats_up, cats_up_ref

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
N, D = 40, 48  # neurons, model width (not multiples of the tiles)


def inputs(dtype, batch, gated, biased=False):
    x = torch.randn(batch, D, dtype=dtype)
    w = (torch.randn(2 * N if gated else N, D) / D**0.5).to(dtype)
    b = (torch.randn(w.shape[0]) / 2).to(dtype) if biased else None
    gate = x.float() @ w[:N].float().T + (0 if b is None else b[:N].float())
    thr = gate.abs().quantile(0.5) * (torch.rand(N) * 0.4 + 0.8)  # about half kept
    return x, w, b, gate, thr.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch, gated, cfg",
    [
        (1, True, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "dot": True}),
        (1, True, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "dot": False}),
        (3, True, {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4}),
        (2, False, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4}),
    ],
)
def test_cats_up(dtype, batch, gated, cfg, seed):
    x, w, b, gate, thr = inputs(dtype, batch, gated, biased=True)
    out = torch.full((batch, N), float("nan"), dtype=dtype)
    assert cats_up(x, w, gate, thr, activation="silu", b_in=b, out=out, config=cfg) is out
    ref = cats_up_ref(x, w, gate, thr, activation="silu", b_in=b)
    assert_close(out, ref, dtype, seed)
    assert torch.equal(out == 0, ref == 0), f"a different kept set; seed={seed}"


def test_cats_up_one_token_and_gate_in_input_dtype(seed):
    x, w, _, gate, thr = inputs(torch.float16, 1, True)
    h = cats_up(x[0], w, gate[0].half(), thr, activation="relu")
    assert h.shape == (N,)
    assert_close(
        h, cats_up_ref(x[0], w, gate[0].half(), thr, activation="relu"), torch.float16, seed
    )


def test_cats_mlp_fused_gate_path_still_matches(seed):
    x, w, b, _, thr = inputs(torch.float16, 2, True, biased=True)
    w_down_t = (torch.randn(N, D) / N**0.5).half()
    cfg = {
        "fused_gate": True,
        "BLOCK_N": 16,
        "BLOCK_K": 32,
        "num_warps": 4,
        "down": {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "programs": 4},
    }
    y = cats_mlp(x, w, w_down_t, thr, activation="silu", b_in=b, config=cfg)
    ref = cats_mlp_ref(x, w, w_down_t, thr, activation="silu", b_in=b)
    assert_close(y, ref, torch.float16, seed)


def test_cats_up_rejects_bad_inputs():
    x, w, _, gate, thr = inputs(torch.float16, 2, True)
    with pytest.raises(ValueError, match="pass 2n = 80"):
        cats_up(x, w[:50], gate, thr, activation="silu")
    with pytest.raises(TypeError, match="gate must be a floating-point tensor"):
        cats_up(x, w, gate.int(), thr, activation="silu")
    with pytest.raises(ValueError, match=r"gate has shape \(2, 39\); expected \(2, 40\)"):
        cats_up(x, w, gate[:, :39], thr, activation="silu")
    with pytest.raises(TypeError, match="pass float32 thresholds"):
        cats_up(x, w, gate, thr.half(), activation="silu")
    with pytest.raises(ValueError, match="activation 'swish'"):
        cats_up(x, w, gate, thr, activation="swish")
    with pytest.raises(ValueError, match="BLOCK_N must be >= 16"):
        cats_up(x, w, gate, thr, activation="silu", config={"BLOCK_N": 8})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1},
        {"BLOCK_N": 64, "BLOCK_K": 16, "num_warps": 2},
    ],
)
def test_rows_sums_is_the_dense_gemv(dtype, cfg, seed):
    """Split-K tiles over a row-major weight (tails in both dimensions) sum to ``W x``."""
    from dejavu_lab.kernels.cats.sums import rows_sums

    x, w, _, _, _ = inputs(dtype, 1, True)
    ws = rows_sums(x, w[:N], kind="test_rows", config=cfg)
    torch.testing.assert_close(ws, (x.float() @ w[:N].float().T)[0], atol=1e-4, rtol=1e-4)
    ws.zero_()


@pytest.mark.parametrize("gated,biased", [(True, True), (True, False), (False, True)])
def test_cats_one_token_gate_sums_match_cublas_gate_call_after_call(gated, biased, seed):
    """Batch 1 runs the gate as split-K sums that the up kernel reads, biases and zeroes: the
    same h as the dense gate, and the same again on the next call (nothing left behind)."""
    from dejavu_lab.kernels.cats.mlp import cats_hidden

    x, w, b, gate, thr = inputs(torch.float16, 1, gated, biased=biased)
    ref = cats_up_ref(x, w, gate, thr, activation="silu", b_in=b)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "dot": True}
    for _ in range(2):
        h = cats_hidden(x, w, thr, activation="silu", n=N, b_in=b, config=cfg)
        assert_close(h, ref, torch.float16, seed)
    plain = cats_hidden(
        x, w, thr, activation="silu", n=N, b_in=b, config={**cfg, "cublas_gate": True}
    )
    assert_close(plain, ref, torch.float16, seed)


@pytest.mark.parametrize("gated,biased", [(True, True), (True, False), (False, True)])
def test_cats_sums_finished_by_the_down_gemv(gated, biased, seed):
    """The gate's sums, the kept up rows' sums and a down GEMV that applies CATS's rule to
    them as it loads them (keep_gate) give CATS's MLP; the workspace is zeroed by the caller."""
    from dejavu_lab.kernels.cats.mlp import cats_sums
    from dejavu_lab.kernels.threshold.fused import threshold_sums

    x, w, b, gate, thr = inputs(torch.float16, 1, gated, biased=biased)
    w_down_t = (torch.randn(N, D) / N**0.5).half()
    for _ in range(2):  # the second call finds the workspace at zero again
        gu = cats_sums(x, w, thr, activation="silu", n=N, b_in=b)
        a = torch.nn.functional.silu(gate[0])
        assert_close(gu[:N], gate[0] - (0 if b is None else b[:N].float()), torch.float16, seed)
        if gated:  # only the kept neurons' up rows were read
            assert bool((gu[N:][a.abs() <= thr] == 0).all()), f"seed={seed}"
        y = threshold_sums(gu, w_down_t, thr, x_act="silu", x_gated=gated, x_bias=b, keep_gate=True)
        ref = cats_mlp_ref(x, w, w_down_t, thr, activation="silu", b_in=b)[0]
        assert_close(y.half(), ref, torch.float16, seed)
        y.zero_(), gu.zero_()
