"""The attention block's fused kernels (the engine's): QKV + RoPE + KV write, and RoPE alone,
against their PyTorch references under TRITON_INTERPRET=1 (or compiled on a GPU with
``DEJAVU_TEST_DEVICE=cuda``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from dejavu_lab.kernels.rope.qkv import qkv_rope, qkv_rope_kernel, qkv_rope_ref  # noqa: E402
from dejavu_lab.kernels.rope.rotate import rope_, rope_ref  # noqa: E402

DEVICE = os.environ.get("DEJAVU_TEST_DEVICE", "cpu")


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
