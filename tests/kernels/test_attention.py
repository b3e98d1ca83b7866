"""The sparse attention kernels (:mod:`dejavu_lab.kernels.attention`: core, sparse, kv_window)
against their PyTorch references, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), unsorted distinct heads,
MHA and GQA, cache rows past each sequence poisoned with NaN so a read of them fails, fp16 and
bf16, batch 1 and union batches with per-sequence heads. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_attention.py
"""

import pytest
import torch
from helpers import DTYPES, TOL, assert_close, on_device, pick, seed

from dejavu_lab.kernels import (
    kv_window_write,
    kv_window_write_ref,
    sparse_attention,
    sparse_attention_core,
    sparse_attention_core_ref,
    sparse_attention_ref,
)

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_kv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kept", [0.0, 0.5, 1.0])
def test_sparse_attention(dtype, heads_kv, batch, kept, seed):
    n_heads, n_kv = heads_kv
    dh, d, t_max = 16, 32, 40
    x = torch.randn(batch, d, dtype=dtype)
    w_qkv = (torch.randn((n_heads + 2 * n_kv) * dh, d) / d**0.5).to(dtype)
    w_o_t = (torch.randn(n_heads * dh, d) / (n_heads * dh) ** 0.5).to(dtype)
    b_qkv = (torch.randn((n_heads + 2 * n_kv) * dh) / 4).to(dtype)
    b_o = torch.randn(d, dtype=dtype)
    seqlens = torch.randint(1, t_max + 1, (batch,), dtype=torch.int32)
    seqlens[0] = t_max  # a full cache, whatever the draw
    k_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    v_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    for b in range(batch):  # positions not yet written must never be read
        k_cache[b, :, seqlens[b] - 1 :] = float("nan")
        v_cache[b, :, seqlens[b] - 1 :] = float("nan")
    heads = pick(n_heads, kept)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.full((batch, d), float("nan"), dtype=dtype)
    args = (x, w_qkv, w_o_t)
    kw = dict(n_heads=n_heads, b_qkv=b_qkv, b_o=b_o)
    cfg = {
        "up": {"BLOCK_N": 32, "BLOCK_D": 32, "num_warps": 4},
        "BLOCK_T": 16,
        "kv_splits": 1 if batch == 1 else 3,
    }
    assert sparse_attention(*args, kc, vc, seqlens, heads, out=out, config=cfg, **kw) is out
    ref = sparse_attention_ref(*args, k_cache, v_cache, seqlens, heads, **kw)
    assert_close(out, ref, dtype, seed)
    # the new token's key/value lands in the cache of each needed KV head, nowhere else
    tol = dict(rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(kc, k_cache, **tol, msg=lambda m: f"{m}; seed={seed}")
    torch.testing.assert_close(vc, v_cache, **tol, msg=lambda m: f"{m}; seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_kv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("all_kv", [False, True], ids=["needed-kv", "every-kv"])
def test_sparse_attention_core(dtype, heads_kv, all_kv, seed):
    """The attention step alone, as the engine calls it (its own projection; every KV head's
    K/V appended when it computed them all)."""
    n_heads, n_kv = heads_kv
    dh, t_max, batch = 16, 24, 2
    heads = pick(n_heads, 0.5)
    kv_heads = torch.arange(n_kv) if all_kv else None
    n_s = n_kv if all_kv else (heads.numel() if n_heads == n_kv else (heads // 4).unique().numel())
    qkv = torch.randn(batch, (heads.numel() + 2 * n_s) * dh, dtype=dtype)
    seqlens = torch.tensor([t_max, 7], dtype=torch.int32)
    k_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    v_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    kw = dict(n_heads=n_heads, kv_heads=kv_heads)
    out = sparse_attention_core(qkv, kc, vc, seqlens, heads, config={"kv_splits": 3}, **kw)
    ref = sparse_attention_core_ref(qkv, k_cache, v_cache, seqlens, heads, **kw)
    assert_close(out, ref, dtype, seed)
    torch.testing.assert_close(kc, k_cache, msg=lambda m: f"{m}; seed={seed}")
    torch.testing.assert_close(vc, v_cache, msg=lambda m: f"{m}; seed={seed}")


@pytest.mark.parametrize(("dtype", "splits"), [(torch.float16, 1), (torch.bfloat16, 3)])
@pytest.mark.parametrize("heads_kv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("all_kv", [False, True], ids=["needed-kv", "every-kv"])
def test_sparse_attention_core_per_sequence_heads(dtype, heads_kv, all_kv, splits, seed):
    """A batch's union of heads, each sequence attending its own (head_mask): skipped heads
    output zeros, every projected K/V is appended, and no cache row past a sequence is read."""
    n_heads, n_kv = heads_kv
    dh, t_max, batch = 16, 24, 3
    heads = pick(n_heads, 0.75)  # the union
    kv_heads = torch.arange(n_kv) if all_kv else None
    n_s = n_kv if all_kv else (heads.numel() if n_heads == n_kv else (heads // 4).unique().numel())
    qkv = torch.randn(batch, (heads.numel() + 2 * n_s) * dh, dtype=dtype)
    seqlens = torch.tensor([t_max, 7, 1], dtype=torch.int32)
    mask = torch.rand(batch, heads.numel()) < 0.5
    mask[1] = False  # a sequence that attends nothing (finished, or all its heads skipped)
    mask[2, 0] = True
    k_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    v_cache = torch.randn(batch, n_kv, t_max, dh, dtype=dtype)
    for b in range(batch):  # positions not yet written must never be read
        k_cache[b, :, seqlens[b] - 1 :] = float("nan")
        v_cache[b, :, seqlens[b] - 1 :] = float("nan")
    kc, vc = k_cache.clone(), v_cache.clone()
    kw = dict(n_heads=n_heads, kv_heads=kv_heads)
    cfg = {"kv_splits": splits, "BLOCK_T": 16}
    given = mask if splits > 1 else mask.to(torch.int8)  # bool or int masks
    out = sparse_attention_core(qkv, kc, vc, seqlens, heads, head_mask=given, config=cfg, **kw)
    ref = sparse_attention_core_ref(qkv, k_cache, v_cache, seqlens, heads, head_mask=mask, **kw)
    assert_close(out, ref, dtype, seed)
    blocks = out.view(batch, heads.numel(), dh)
    assert not blocks[~mask].any(), f"a skipped head wrote non-zeros; seed={seed}"
    tol = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kc, k_cache, **tol, msg=lambda m: f"{m}; seed={seed}")
    torch.testing.assert_close(vc, v_cache, **tol, msg=lambda m: f"{m}; seed={seed}")


def test_sparse_attention_with_per_sequence_heads(seed):
    n_heads, dh, d, t_max, batch = 4, 16, 32, 12, 2
    dtype = torch.float16
    x = torch.randn(batch, d, dtype=dtype)
    w_qkv = (torch.randn(3 * n_heads * dh, d) / d**0.5).to(dtype)
    w_o_t = (torch.randn(n_heads * dh, d) / (n_heads * dh) ** 0.5).to(dtype)
    seqlens = torch.tensor([t_max, 5], dtype=torch.int32)
    kc, vc = (torch.randn(batch, n_heads, t_max, dh, dtype=dtype) for _ in range(2))
    heads, mask = torch.tensor([2, 0, 3]), torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.int8)
    out = sparse_attention(
        x, w_qkv, w_o_t, kc.clone(), vc.clone(), seqlens, heads, n_heads=n_heads, head_mask=mask
    )
    ref = sparse_attention_ref(
        x, w_qkv, w_o_t, kc, vc, seqlens, heads, n_heads=n_heads, head_mask=mask
    )
    assert_close(out, ref, dtype, seed)
    own = heads[mask[1].bool()]  # sequence 1 alone with its own heads: the same output
    alone = sparse_attention_ref(
        x[1:], w_qkv, w_o_t, kc[1:].clone(), vc[1:].clone(), seqlens[1:], own, n_heads=n_heads
    )
    assert_close(out[1:], alone, dtype, seed)
    with pytest.raises(ValueError, match="head_mask has shape"):
        sparse_attention(
            x, w_qkv, w_o_t, kc, vc, seqlens, heads, n_heads=n_heads, head_mask=mask[:, :2]
        )
    with pytest.raises(TypeError, match="head_mask must be a bool or integer"):
        sparse_attention(
            x, w_qkv, w_o_t, kc, vc, seqlens, heads, n_heads=n_heads, head_mask=mask.float()
        )


# ---------------------------------------------------------------------------- KV window
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_kv_window_write(dtype, rows, seed):
    n_kv, t_max, dh, n_q = 6, 20, 16, 3
    heads = pick(n_kv, 0.5)
    qkv = torch.randn(rows, (n_q + 2 * heads.numel()) * dh, dtype=dtype)
    base = torch.tensor([t_max - rows - 2])
    kc, vc = torch.randn(2, n_kv, t_max, dh, dtype=dtype)
    k_ref, v_ref = kc.clone(), vc.clone()
    kv_window_write(qkv, kc, vc, heads, base, n_q=n_q)
    kv_window_write_ref(qkv, k_ref, v_ref, heads, base, n_q=n_q)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref), f"seed={seed}"


# --------------------------------------------------------------------------- bad inputs
def test_attention_rejects_bad_inputs():
    n_heads, dh, d, t_max = 4, 16, 32, 8
    x = torch.randn(1, d, dtype=torch.float16)
    w_qkv = torch.randn(3 * n_heads * dh, d, dtype=torch.float16)
    w_o_t = torch.randn(n_heads * dh, d, dtype=torch.float16)
    kc = torch.randn(1, n_heads, t_max, dh, dtype=torch.float16)
    vc = kc.clone()
    ok = torch.tensor([t_max], dtype=torch.int32)
    heads = torch.tensor([2, 0])
    with pytest.raises(ValueError, match=r"seqlens must lie in \[1, 8\]"):
        sparse_attention(x, w_qkv, w_o_t, kc, vc, ok + 1, heads, n_heads=n_heads)
    with pytest.raises(ValueError, match="duplicate"):
        sparse_attention(x, w_qkv, w_o_t, kc, vc, ok, torch.tensor([1, 1]), n_heads=n_heads)
    with pytest.raises(ValueError, match="must lie in"):
        sparse_attention(x, w_qkv, w_o_t, kc, vc, ok, torch.tensor([4]), n_heads=n_heads)
    with pytest.raises(ValueError, match="w_qkv has shape"):
        sparse_attention(x, w_qkv[:-1], w_o_t, kc, vc, ok, heads, n_heads=n_heads)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        sparse_attention(x, w_qkv, w_o_t, kc.bfloat16(), vc, ok, heads, n_heads=n_heads)
    with pytest.raises(TypeError, match="seqlens"):
        sparse_attention(x, w_qkv, w_o_t, kc, vc, ok.float(), heads, n_heads=n_heads)
