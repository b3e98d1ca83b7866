"""Sparse Triton kernels against their PyTorch references, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), unsorted distinct
indices, 0% to 100% kept, outputs poisoned with NaN so an unwritten element fails, fp16 and
bf16, batch 1 and union batches. Under the interpreter, Triton 3.9 truncates fp32 -> bf16
instead of rounding, so bf16 outputs sit about one bf16 ulp from the reference.

On a GPU box the same tests check the compiled kernels on the GPU:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/test_kernels.py
"""

import pytest
import torch
from kernel_helpers import (
    DEVICE,
    DTYPES,
    TOL,
    assert_close,
    on_device,
    pick,
    seed,
)

from dejavu_lab.kernels import (
    kv_window_write,
    kv_window_write_ref,
    row_norm,
    row_norm_ref,
    sparse_attention,
    sparse_attention_core,
    sparse_attention_core_ref,
    sparse_attention_ref,
    sparse_mlp_down,
    sparse_mlp_down_ref,
    sparse_mlp_up,
    sparse_mlp_up_ref,
)
from dejavu_lab.kernels.mlp.up import sparse_mlp_up_kernel

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
KEPT = [0.0, 0.1, 0.5, 1.0]


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernels_run_in_the_interpreter():
    assert type(sparse_mlp_up_kernel).__name__ == "InterpretedFunction", (
        "set TRITON_INTERPRET=1 before importing dejavu_lab.kernels (make test does) so the "
        "Triton kernels themselves run on the CPU"
    )


# ----------------------------------------------------------------------------- up-projection
UP_CASES = [  # (activation, gated, with biases)
    ("relu", False, True),
    ("gelu", True, True),
    ("silu", True, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("case", UP_CASES, ids=lambda c: c[0] + ("_gated" if c[1] else ""))
def test_sparse_mlp_up(dtype, batch, kept, case, seed):
    act, gated, biased = case
    n, d = 96, 80  # d not a multiple of BLOCK_D: masked tail
    x = torch.randn(batch, d, dtype=dtype)
    w = (torch.randn(n, d) / d**0.5).to(dtype)
    wu = (torch.randn(n, d) / d**0.5).to(dtype) if gated else None
    b = torch.randn(n, dtype=dtype) if biased else None
    bu = torch.randn(n, dtype=dtype) if biased and gated else None
    idx = pick(n, kept)
    kw = dict(bias=b, activation=act, up_weight=wu, up_bias=bu)
    out = torch.full((batch, idx.numel()), float("nan"), dtype=dtype)
    cfg = {"BLOCK_N": 4 if batch == 1 else 16, "BLOCK_D": 32, "num_warps": 4}
    got = sparse_mlp_up(x, w, idx, out=out, config=cfg, **kw)
    assert got is out
    ref = sparse_mlp_up_ref(x, w, idx, **kw)
    if idx.numel():
        assert_close(out, ref, dtype, seed)
        # the reference is the dense layer read at the selected neurons
        dense = sparse_mlp_up_ref(x, w, torch.arange(n), **kw)
        assert_close(ref, dense[:, idx.long()], dtype, seed)


def test_sparse_mlp_up_1d_default_config_and_head_blocks(seed):
    dtype, d = torch.float16, 48
    x = torch.randn(d, dtype=dtype)
    w = (torch.randn(64, d) / 7).to(dtype)
    idx = pick(64, 0.3)
    got = sparse_mlp_up(x, w, idx, activation="none")
    assert got.shape == (idx.numel(),)
    assert_close(got, sparse_mlp_up_ref(x[None], w, idx, activation="none")[0], dtype, seed)
    heads = pick(4, 0.5)  # 4 blocks of 16 rows
    got = sparse_mlp_up(x, w, heads, activation="none", rows_per_index=16)
    rows = (heads.long()[:, None] * 16 + torch.arange(16)).reshape(-1)
    assert_close(got, sparse_mlp_up_ref(x[None], w, rows, activation="none")[0], dtype, seed)


# --------------------------------------------------------------------------- down-projection
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("split", [1, 3])
def test_sparse_mlp_down(dtype, batch, kept, split, seed):
    n, d = 96, 80
    w2t = (torch.randn(n, d) / n**0.5).to(dtype)  # W2 transposed: one row per neuron
    bias = torch.randn(d, dtype=dtype)
    idx = pick(n, kept)
    h = torch.randn(batch, idx.numel(), dtype=dtype)
    out = torch.full((batch, d), float("nan"), dtype=dtype)
    cfg = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "split": split}
    assert sparse_mlp_down(h, w2t, idx, bias=bias, out=out, config=cfg) is out
    ref = sparse_mlp_down_ref(h, w2t, idx, bias=bias)
    assert_close(out, ref, dtype, seed)
    # the reference equals the dense layer fed zeros at the skipped neurons
    full = torch.zeros(batch, n, dtype=dtype)
    full[:, idx.long()] = h
    assert_close(ref, sparse_mlp_down_ref(full, w2t, torch.arange(n), bias=bias), dtype, seed)


def test_union_batch_32_up_then_down(seed):
    dtype, n, d = torch.float16, 64, 32
    x = torch.randn(32, d, dtype=dtype)
    w1 = (torch.randn(n, d) / d**0.5).to(dtype)
    w2t = (torch.randn(n, d) / n**0.5).to(dtype)
    idx = pick(n, 0.5)
    h = sparse_mlp_up(x, w1, idx, config={"BLOCK_N": 16, "BLOCK_D": 16, "num_warps": 4})
    assert_close(h, sparse_mlp_up_ref(x, w1, idx), dtype, seed)
    y = sparse_mlp_down(h, w2t, idx, config={"BLOCK_R": 16, "BLOCK_D": 16, "num_warps": 4})
    assert_close(y, sparse_mlp_down_ref(h, w2t, idx), dtype, seed)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU fallback")
def test_cpu_without_interpreter_runs_the_reference(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 32, dtype=torch.float16)
    w = torch.randn(40, 32, dtype=torch.float16)
    idx = pick(40, 0.5)
    assert torch.equal(sparse_mlp_up(x, w, idx), sparse_mlp_up_ref(x, w, idx))


# ----------------------------------------------------------------------------- attention
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


# ------------------------------------------------------------------------------ KV window
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


# ------------------------------------------------------------------------------ row norm
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("shape", [(1, 7168), (3, 100), (2, 2, 64)], ids=["row", "rows", "3d"])
def test_row_norm(dtype, kind, shape, seed):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    w = torch.rand(shape[-1]).to(dtype)
    b = torch.randn(shape[-1]).to(dtype) if kind == "layer" else None
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert row_norm(x, w, b, eps=1e-6, kind=kind, out=out) is out
    ref = row_norm_ref(x.float(), w.float(), None if b is None else b.float(), eps=1e-6, kind=kind)
    assert_close(out, ref, dtype if dtype != torch.float32 else torch.float16, seed)


def test_row_norm_rejects_bad_inputs():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="kind='batch'"):
        row_norm(x, w, kind="batch")
    with pytest.raises(ValueError, match=r"weight has shape \(7,\); expected \(8,\)"):
        row_norm(x, w[:7])
    with pytest.raises(ValueError, match="contiguous last dimension"):
        row_norm(x.T, torch.ones(2))


# ------------------------------------------------------------------------------ bad inputs
def _mlp():
    x = torch.randn(2, 32, dtype=torch.float16)
    w = torch.randn(40, 32, dtype=torch.float16)
    return x, w, pick(40, 0.5)


@pytest.mark.parametrize(
    "mutate, exc, message",
    [
        (lambda x, w, i: (x.float(), w, i), TypeError, "float16 or bfloat16"),
        (lambda x, w, i: (x, w.bfloat16(), i), TypeError, "cast it to match"),
        (lambda x, w, i: (x.to("meta"), w, i), ValueError, "on meta"),
        (lambda x, w, i: (x, w.to("meta"), i), ValueError, "weight is on meta"),
        (lambda x, w, i: (x[:, :31], w, i), ValueError, "expected [32] or [B, 32]"),
        (lambda x, w, i: (x[:1].expand(33, 32), w, i), ValueError, "1 to 32 tokens"),
        (lambda x, w, i: (x, w.T, i), ValueError, "row-major"),
        (lambda x, w, i: (x, w, i.float()), TypeError, "int32 or int64"),
        (lambda x, w, i: (x, w, i[None]), ValueError, "1-D"),
        (
            lambda x, w, i: (x, w, torch.cat([i, torch.tensor([40], dtype=i.dtype)])),
            ValueError,
            "must lie in [0, 39]",
        ),
        (lambda x, w, i: (x, w, torch.cat([i, i[:1]])), ValueError, "duplicate"),
    ],
    ids=[
        "dtype",
        "mixed-dtype",
        "device",
        "weight-device",
        "shape",
        "batch",
        "layout",
        "index-dtype",
        "index-dim",
        "out-of-range",
        "duplicate",
    ],
)
def test_up_rejects_bad_inputs(mutate, exc, message):
    x, w, idx = mutate(*_mlp())
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        sparse_mlp_up(x, w, idx)


def test_down_and_options_reject_bad_inputs():
    x, w, idx = _mlp()
    with pytest.raises(ValueError, match="activation 'tanh'"):
        sparse_mlp_up(x, w, idx, activation="tanh")
    with pytest.raises(ValueError, match="expected"):
        sparse_mlp_up(x, w, idx, out=torch.empty(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias has shape"):
        sparse_mlp_up(x, w, idx, bias=torch.zeros(39, dtype=torch.float16))
    h = torch.randn(2, idx.numel(), dtype=torch.float16)
    with pytest.raises(ValueError, match="h has shape"):
        sparse_mlp_down(h[:, 1:], w, idx)
    with pytest.raises(ValueError, match="duplicate"):
        sparse_mlp_down(torch.randn(2, 2, dtype=torch.float16), w, torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        sparse_mlp_down(h.double(), w, idx)


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_alternative_tilings(dtype, seed):
    """The tuned variants: prefetching FMA path (up), tensor-core path at batch 1 (down)."""
    n, d = 96, 80
    x = torch.randn(1, d, dtype=dtype)
    w = (torch.randn(n, d) / d**0.5).to(dtype)
    wu = (torch.randn(n, d) / d**0.5).to(dtype)
    idx = pick(n, 0.4)
    for gated in (False, True):
        kw = dict(activation="silu", up_weight=wu if gated else None)
        out = torch.full((1, idx.numel()), float("nan"), dtype=dtype)
        cfg = {"BLOCK_N": 2, "BLOCK_D": 32, "num_warps": 4, "prefetch": True}
        sparse_mlp_up(x, w, idx, out=out, config=cfg, **kw)
        assert_close(out, sparse_mlp_up_ref(x, w, idx, **kw), dtype, seed)
    h = torch.randn(1, idx.numel(), dtype=dtype)
    bias = torch.randn(d, dtype=dtype)
    for split, extra in [
        (1, {"dot": True}),
        (2, {"dot": True}),
        (3, {"prefetch": True}),
        (1, {"prefetch": True}),
        (3, {"fused": False}),
        (19, {"BLOCK_R": 2, "fused": False}),  # 2 chunks of partials, each path
        (19, {"BLOCK_R": 2, "BLOCK_D": 64, "num_warps": 1}),
    ]:
        out = torch.full((1, d), float("nan"), dtype=dtype)
        cfg = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "split": split, **extra}
        sparse_mlp_down(h, w, idx, bias=bias, out=out, config=cfg)
        assert_close(out, sparse_mlp_down_ref(h, w, idx, bias=bias), dtype, seed)
