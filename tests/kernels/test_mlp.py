"""The sparse MLP kernels (:mod:`dejavu_lab.kernels.mlp`: up, down, fused) against their PyTorch
references, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), unsorted distinct
indices, 0% to 100% kept, outputs poisoned with NaN so an unwritten element fails, fp16 and
bf16, batch 1 and union batches up to 32, ReLU/GELU MLPs with biases and SwiGLU/GeGLU gated
MLPs, every tiling. Under the interpreter, Triton 3.9 truncates fp32 -> bf16 instead of
rounding, so bf16 outputs sit about one bf16 ulp from the reference.

On a GPU box the same tests check the compiled kernels on the GPU:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_mlp.py
"""

import pytest
import torch
from helpers import (
    CASES,
    DEVICE,
    DTYPES,
    D,
    N,
    assert_close,
    assert_compiles,
    mlp,
    needs_ptxas,
    on_device,
    pick,
    seed,
    small,
)

from dejavu_lab.kernels import (
    cats_mlp,
    fused_sparse_mlp,
    fused_sparse_mlp_ref,
    sparse_mlp_down,
    sparse_mlp_down_ref,
    sparse_mlp_up,
    sparse_mlp_up_ref,
)
from dejavu_lab.kernels.mlp.fused import default_config, fused_mlp_kernel
from dejavu_lab.kernels.mlp.up import default_config as default_up_config
from dejavu_lab.kernels.mlp.up import sparse_mlp_up_kernel

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
KEPT = [0.0, 0.1, 0.5, 1.0]


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernels_run_in_the_interpreter():
    assert type(sparse_mlp_up_kernel).__name__ == "InterpretedFunction", (
        "set TRITON_INTERPRET=1 before importing dejavu_lab.kernels (make test does) so the "
        "Triton kernels themselves run on the CPU"
    )


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernel_runs_in_the_interpreter():
    assert type(fused_mlp_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------ up-projection
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
    one = sparse_mlp_up(x, w, idx, activation="none", config=default_up_config(1, 1, d))
    assert torch.equal(one, got)  # one row per program, as on a GPU: the same sums
    assert_close(got, sparse_mlp_up_ref(x[None], w, idx, activation="none")[0], dtype, seed)
    heads = pick(4, 0.5)  # 4 blocks of 16 rows
    got = sparse_mlp_up(x, w, heads, activation="none", rows_per_index=16)
    rows = (heads.long()[:, None] * 16 + torch.arange(16)).reshape(-1)
    assert_close(got, sparse_mlp_up_ref(x[None], w, rows, activation="none")[0], dtype, seed)


# ---------------------------------------------------------------------- down-projection
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
    cfg = {"mode": "split", "BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "split": split}
    assert sparse_mlp_down(h, w2t, idx, bias=bias, out=out, config=cfg) is out
    ref = sparse_mlp_down_ref(h, w2t, idx, bias=bias)
    assert_close(out, ref, dtype, seed)
    # the reference equals the dense layer fed zeros at the skipped neurons
    full = torch.zeros(batch, n, dtype=dtype)
    full[:, idx.long()] = h
    assert_close(ref, sparse_mlp_down_ref(full, w2t, torch.arange(n), bias=bias), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kept", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("g", [1, 16])
def test_sparse_mlp_down_tile(dtype, kept, g, seed):
    """The batch-1 default: one tile per program, fp32 atomics into a workspace the finalize
    leaves at zero (a second call with other inputs must not see the first's sums)."""
    n, d = 96, 80  # 80 is not a multiple of BLOCK_D = 32: the column mask
    w2t = (torch.randn(n, d) / n**0.5).to(dtype)
    for bias in (torch.randn(d, dtype=dtype), None):
        idx = pick(n // g, kept)
        h = torch.randn(1, idx.numel() * g, dtype=dtype)
        out = torch.full((1, d), float("nan"), dtype=dtype)
        cfg = {"mode": "tile", "BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 2}
        assert sparse_mlp_down(h, w2t, idx, bias=bias, out=out, config=cfg, rows_per_index=g) is out
        assert_close(
            out, sparse_mlp_down_ref(h, w2t, idx, bias=bias, rows_per_index=g), dtype, seed
        )
    y = sparse_mlp_down(h[0], w2t, idx, rows_per_index=g)  # 1-D, the default config: the tiles
    assert_close(y, sparse_mlp_down_ref(h[0], w2t, idx, rows_per_index=g), dtype, seed)


DOWN_TILE_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_lab.kernels.mlp.down_tile import sparse_mlp_down_tile_kernel as tile

sig = {"h_ptr": "*fp16", "w_ptr": "*fp16", "idx_ptr": "*i32", "ws_ptr": "*fp32", "K": "i32",
       "D": "i32", "stride_w": "i32"}
for g, even in ((1, True), (128, False)):
    const = {"G": g, "EVEN_D": even, "BLOCK_R": 64, "BLOCK_D": 128, "PDL": True}
    triton.compile(ASTSource(tile, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})
print("compiled")
"""


@needs_ptxas
def test_down_tile_compiles_for_sm90():
    assert_compiles(DOWN_TILE_COMPILE, timeout=300)


def test_down_default_config_modes():
    from dejavu_lab.kernels.mlp.down import default_config

    cpu = torch.device("cpu")
    assert default_config(1, 64, 80, cpu)["mode"] == "tile"
    assert "mode" not in default_config(1, 64, 80, cpu, mode="split")
    assert default_config(5, 64, 80, cpu)["BLOCK_R"] >= 16  # union batches: tensor-core tiles


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
        (3, {"prefetch": 2}),  # weights one step ahead
        (1, {"prefetch": 2}),
        (19, {"BLOCK_R": 2, "prefetch": 2}),
        (3, {"fused": False}),
        (19, {"BLOCK_R": 2, "fused": False}),  # 2 chunks of partials, each path
        (19, {"BLOCK_R": 2, "BLOCK_D": 64, "num_warps": 1}),
    ]:
        out = torch.full((1, d), float("nan"), dtype=dtype)
        cfg = {"mode": "split", "BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "split": split,
               **extra}  # fmt: skip
        sparse_mlp_down(h, w, idx, bias=bias, out=out, config=cfg)
        assert_close(out, sparse_mlp_down_ref(h, w, idx, bias=bias), dtype, seed)
    heads = pick(6, 0.5)  # W_O^T's kept heads: blocks of 16 rows, weights one step ahead
    h = torch.randn(1, heads.numel() * 16, dtype=dtype)
    for split in (1, 2):
        out = torch.full((1, d), float("nan"), dtype=dtype)
        cfg = {"mode": "split", "BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "split": split,
               "prefetch": 2}  # fmt: skip
        sparse_mlp_down(h, w, heads, bias=bias, out=out, config=cfg, rows_per_index=16)
        ref = sparse_mlp_down_ref(h, w, heads, bias=bias, rows_per_index=16)
        assert_close(out, ref, dtype, seed)


# --------------------------------------------------------------------- fused sparse MLP
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


# --------------------------------------------------------------------------- bad inputs
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
