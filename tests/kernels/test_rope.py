"""The RoPE kernels (:mod:`dejavu_lab.kernels.rope`): RoPE alone (rotate), the attention block's
fused QKV + RoPE + KV write (qkv), and the fused epilogues of a threshold GEMV's sums (RoPE;
residual add + norm) with the sums they finish, against their PyTorch references under
TRITON_INTERPRET=1 (or compiled on a GPU with ``DEJAVU_TEST_DEVICE=cuda``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from dejavu_lab.kernels import row_norm_ref, threshold_gemv_ref  # noqa: E402
from dejavu_lab.kernels.rope.epilogue import residual_norm, rope_sums  # noqa: E402
from dejavu_lab.kernels.rope.qkv import qkv_rope, qkv_rope_kernel, qkv_rope_ref  # noqa: E402
from dejavu_lab.kernels.rope.rotate import rope_, rope_ref  # noqa: E402
from dejavu_lab.kernels.threshold.fused import threshold_sums  # noqa: E402

DEVICE = os.environ.get("DEJAVU_TEST_DEVICE", "cpu")
DTYPES = [torch.float16, torch.bfloat16]


def tables(t, dh, dtype):
    ang = torch.arange(float(t))[:, None] * (1e-2 ** torch.linspace(0, 1, dh // 2)).repeat(2)
    return ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernel_runs_in_the_interpreter():
    assert type(qkv_rope_kernel).__name__ == "InterpretedFunction"


CASES = [  # (H, Hkv, d_head, d, batch, bias, rope, caches)
    (4, 4, 16, 32, 1, False, True, False),  # MHA, batch 1 (FMA path)
    (4, 2, 16, 48, 1, True, True, True),  # GQA, bias, caches
    (4, 4, 64, 64, 5, False, True, True),  # a window of 5 (tl.dot path), two row chunks
    (2, 2, 32, 40, 16, True, False, True),  # OPT: no rotation; d not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_qkv_rope_matches_reference(case, dtype):
    H, Hkv, dh, d, batch, with_bias, with_rope, caches = case
    g = torch.Generator().manual_seed(hash(case) % 1000)
    rows = (H + 2 * Hkv) * dh
    w = (torch.randn(rows, d, generator=g) / d**0.5).to(DEVICE, dtype)
    x = torch.randn(batch, d, generator=g).to(DEVICE, dtype)
    bias = (torch.randn(rows, generator=g) / 4).to(DEVICE, dtype) if with_bias else None
    kept = torch.randperm(H, generator=g)[: max(1, H // 2)]
    kv = torch.randperm(Hkv, generator=g)[: max(1, Hkv // 2)]
    blocks = torch.cat((kept, H + kv, H + Hkv + kv)).to(DEVICE)
    cos, sin = tables(24, dh, dtype) if with_rope else (None, None)
    pos = (torch.arange(batch) + 3).to(DEVICE)
    kc, vc = torch.zeros(2, Hkv, 24, dh, dtype=dtype, device=DEVICE) if caches else (None, None)
    rk, rv = (kc.clone(), vc.clone()) if caches else (None, None)
    kw = dict(n_heads=H, n_kv_heads=Hkv, positions=pos, bias=bias, cos=cos, sin=sin)
    got = qkv_rope(x if batch > 1 else x[0], w, blocks, k_cache=kc, v_cache=vc, **kw)
    ref = qkv_rope_ref(x, w, blocks, k_cache=rk, v_cache=rv, **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.reshape(ref.shape), ref, atol=tol, rtol=tol)
    if caches:
        torch.testing.assert_close(kc, rk, atol=tol, rtol=tol)
        torch.testing.assert_close(vc, rv, atol=tol, rtol=tol)
        assert kc.abs().sum() > 0 and kc[:, :3].abs().sum() == 0  # only the batch's rows


def test_qkv_rope_is_the_unfused_chain():
    """= gather-GEMV of the blocks, then HF's rotation (rotate_half), then a cache write."""
    H, dh, d = 2, 16, 32
    w = torch.randn(4 * dh, d).half().to(DEVICE) / 6
    x = torch.randn(1, d).half().to(DEVICE)
    cos, sin = tables(8, dh, torch.float16)
    pos = torch.tensor([6], device=DEVICE)
    y = qkv_rope(
        x,
        w,
        torch.tensor([1, 2], device=DEVICE),
        n_heads=H,
        n_kv_heads=1,
        positions=pos,
        cos=cos,
        sin=sin,
    )
    q, k = (x.float() @ w.float().T).view(4, dh)[[1, 2]].unbind()
    for got, want in ((y[0, :dh], q), (y[0, dh:], k)):
        half1, half2 = want.chunk(2)
        turned = want * cos[6].float() + torch.cat((-half2, half1)) * sin[6].float()
        torch.testing.assert_close(got.float(), turned, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,n_rot,dh", [(1, 6, 16), (3, 3, 64), (4, 2, 24)])
def test_rope_matches_reference(batch, n_rot, dh, dtype):
    qkv = torch.randn(batch, (n_rot + 2) * dh).to(DEVICE, dtype)
    cos, sin = tables(12, dh, dtype)
    pos = torch.randint(0, 12, (batch,)).to(DEVICE)
    ref = rope_ref(qkv, cos, sin, pos, n_rot=n_rot)
    got = rope_(qkv, cos, sin, pos, n_rot=n_rot)
    assert got is qkv
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_qkv_rope_bad_inputs():
    w = torch.randn(64, 32, dtype=torch.float16)
    x = torch.randn(32, dtype=torch.float16)
    blocks, pos = torch.tensor([0]), torch.tensor([0])
    kw = dict(n_heads=2, n_kv_heads=1, positions=pos)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        qkv_rope(x.float(), w, blocks, **kw)
    with pytest.raises(ValueError, match="multiple of 5 heads"):
        qkv_rope(x, w, blocks, n_heads=3, n_kv_heads=1, positions=pos)
    with pytest.raises(ValueError, match="positions has 1 entries for a batch of 2"):
        qkv_rope(torch.randn(2, 32, dtype=torch.float16), w, blocks, **kw)
    with pytest.raises(ValueError, match="cos with sin"):
        qkv_rope(x, w, blocks, cos=torch.zeros(4, 16, dtype=torch.float16), **kw)
    with pytest.raises(ValueError, match="d_head = 16"):
        qkv_rope(x, w, blocks, cos=torch.zeros(4, 8), sin=torch.zeros(4, 8), **kw)


# ---------------------------------------------------------------------------- epilogues
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


# --------------------------------------------- threshold sums finished by the epilogues
# Here, not in test_threshold.py: these draw from CPU generators and move each tensor to DEVICE
# themselves, which test_threshold.py's autouse on_device fixture (a CUDA default device on a
# GPU box) would refuse.
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
