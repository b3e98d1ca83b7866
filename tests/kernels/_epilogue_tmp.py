"""The fused epilogues of a threshold GEMV's sums (RoPE; residual add + norm) against PyTorch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from dejavu_lab.kernels import row_norm_ref, threshold_gemv_ref  # noqa: E402
from dejavu_lab.kernels.rope.epilogue import residual_norm, rope_sums  # noqa: E402
from dejavu_lab.kernels.rope.rotate import rope_ref  # noqa: E402
from dejavu_lab.kernels.threshold.fused import threshold_sums  # noqa: E402

DEVICE = os.environ.get("DEJAVU_TEST_DEVICE", "cpu")
DTYPES = [torch.float16, torch.bfloat16]


def tol(dtype):
    return 2e-2 if dtype == torch.float16 else 6e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rope_sums_rotates_the_finished_sums_and_zeroes_them(dtype, bias):
    g = torch.Generator().manual_seed(1)
    H, Hkv, dh, T = 4, 2, 16, 10
    n = (H + 2 * Hkv) * dh
    ws = torch.randn(n, generator=g).to(DEVICE)
    b = (torch.randn(n, generator=g) / 4).to(DEVICE, dtype) if bias else None
    cos = torch.randn(T, dh, generator=g).to(DEVICE, dtype)
    sin = torch.randn(T, dh, generator=g).to(DEVICE, dtype)
    pos = torch.tensor([7], device=DEVICE)
    want_in = (ws + (b.float() if bias else 0)).to(dtype)[None]
    want = rope_ref(want_in, cos, sin, pos, n_rot=H + Hkv)
    out = torch.empty(1, n, dtype=dtype, device=DEVICE)
    got = rope_sums(ws, b, out, cos, sin, pos, n_rot=H + Hkv)
    assert got is out
    torch.testing.assert_close(got.float(), want.float(), atol=tol(dtype), rtol=tol(dtype))
    assert bool((ws == 0).all()), "the workspace must be left at zero for the next GEMV"
    # the value blocks are copied, not turned
    torch.testing.assert_close(got[0, (H + Hkv) * dh :], want_in[0, (H + Hkv) * dh :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("from_sums", [True, False])
def test_residual_norm_adds_the_block_output_and_norms(dtype, kind, from_sums):
    g = torch.Generator().manual_seed(2)
    n = 300  # not a power of two: the row mask counts
    x = torch.randn(1, n, generator=g).to(DEVICE, dtype)
    block = torch.randn(n, generator=g)
    src = block.to(DEVICE) if from_sums else block.to(DEVICE, dtype)[None]
    bias = (torch.randn(n, generator=g) / 4).to(DEVICE, dtype)
    w = torch.rand(n, generator=g).to(DEVICE, dtype) + 0.5
    shift = torch.randn(n, generator=g).to(DEVICE, dtype) if kind == "layer" else None
    want_h = x.float() + src.float().view(1, n) + bias.float()
    h, y = residual_norm(src, bias, x, (w, shift, 1e-5), kind=kind, from_sums=from_sums)
    torch.testing.assert_close(h.float(), want_h, atol=tol(dtype), rtol=tol(dtype))
    want_y = row_norm_ref(
        h.float(), w.float(), None if shift is None else shift.float(), eps=1e-5, kind=kind
    )
    torch.testing.assert_close(y.float(), want_y, atol=tol(dtype), rtol=tol(dtype))
    if from_sums:
        assert bool((src == 0).all())
    else:  # a tensor source is read, never zeroed
        torch.testing.assert_close(src.float(), block.to(DEVICE, dtype).float()[None])


def test_residual_norm_without_a_norm_returns_the_residual_only():
    x = torch.ones(1, 8, dtype=torch.float16, device=DEVICE)
    ws = torch.arange(8, dtype=torch.float32, device=DEVICE)
    h, y = residual_norm(ws, None, x, None, from_sums=True)
    assert y is None
    assert h.tolist() == [[1.0 + i for i in range(8)]]


def test_residual_norm_rejects_an_unknown_kind():
    x = torch.ones(1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="kind"):
        residual_norm(x, None, x, None, kind="batch")


@pytest.mark.parametrize("thr", [0.5, "vector"])
def test_threshold_sums_then_epilogue_equals_the_threshold_gemv(thr):
    """The sums a threshold GEMV leaves, finished by the residual epilogue, are the GEMV's
    output added to the residual — call after call through the one shared workspace."""
    g = torch.Generator().manual_seed(3)
    d_in, d_out = 96, 80
    w_t = (torch.randn(d_in, d_out, generator=g) / 8).to(DEVICE, torch.float16)
    t = 0.5 if thr == 0.5 else torch.rand(d_in, generator=g).to(DEVICE)
    for step in range(3):
        x = torch.randn(1, d_in, generator=g).to(DEVICE, torch.float16)
        res = torch.randn(1, d_out, generator=g).to(DEVICE, torch.float16)
        ws = threshold_sums(x, w_t, t)
        if ws is None:
            pytest.skip("the tile kernel runs on a GPU or under the interpreter only")
        h, _ = residual_norm(ws, None, res, None, from_sums=True)
        want = res.float() + threshold_gemv_ref(x, w_t, t).float()
        torch.testing.assert_close(h.float(), want, atol=2e-2, rtol=2e-2, msg=f"step {step}")


def test_threshold_sums_leaves_union_batches_to_the_gemv():
    x = torch.randn(2, 32, dtype=torch.float16, device=DEVICE)
    assert threshold_sums(x, torch.randn(32, 16, dtype=torch.float16, device=DEVICE), 0.5) is None


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu", False), ("gelu", False)])
def test_threshold_sums_finishes_the_previous_sums_in_its_loads(act, gated):
    """The down GEMV reading the gate/up GEMV's sums: act(gate + b) * (up + b) (or act(a + b)),
    rounded to the weights' dtype, thresholded — as the finalize and the plain GEMV would."""
    from dejavu_lab.kernels._neurons import act_ref

    g = torch.Generator().manual_seed(6)
    d, n = 64, 48
    w_in = (torch.randn(d, 2 * n if gated else n, generator=g) / 4).to(DEVICE, torch.float16)
    w2 = (torch.randn(n, 40, generator=g) / 4).to(DEVICE, torch.float16)
    b_in = (torch.randn(w_in.shape[1], generator=g) / 4).to(DEVICE, torch.float16)
    x = torch.randn(1, d, generator=g).to(DEVICE, torch.float16)
    gu = threshold_sums(x, w_in, 0.3, kind="hidden")
    if gu is None:
        pytest.skip("the tile kernel runs on a GPU or under the interpreter only")
    a = gu.float() + b_in.float()
    h = act_ref(a[:n], act) * a[n:] if gated else act_ref(a, act)
    want = threshold_gemv_ref(h.half()[None], w2, 0.05)[0]
    y = threshold_sums(gu, w2, 0.05, x_act=act, x_gated=gated, x_bias=b_in)
    torch.testing.assert_close(y.half(), want, atol=2e-2, rtol=2e-2)
    res = torch.zeros(1, 40, dtype=torch.float16, device=DEVICE)
    h2, _ = residual_norm(y, None, res, None, from_sums=True, zero=gu)
    torch.testing.assert_close(h2[0], want, atol=2e-2, rtol=2e-2)
    assert bool((gu == 0).all()) and bool((y == 0).all()), "both workspaces left at zero"
