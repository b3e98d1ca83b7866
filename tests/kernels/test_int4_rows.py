"""The rows-layout W4A16 kernels (:mod:`dejavu_lab.kernels.int4.up`, :mod:`.cats`) and the kept
heads' blocks of :func:`~dejavu_lab.kernels.int4.int4_rows_gemv`, against their references and
against the fp32 product on the dequantised weights, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), outputs poisoned with NaN
so an unwritten element fails, fp16 and bf16, batch 1 and union batches, groups 32/64/128,
tilings with groups inside a step and steps inside a group, masked tails. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_int4_rows.py
"""

import pytest
import torch
from helpers import (
    DTYPES,
    assert_close,
    assert_refused_in_one_sentence,
    int4_weight,
    odd_index,
    on_device,
    poisoned,
    seed,
)

from dejavu_lab.kernels.int4 import (
    int4_cats_up,
    int4_cats_up_ref,
    int4_kept_up,
    int4_kept_up_ref,
    int4_rows_gemv,
    int4_rows_gemv_ref,
)
from dejavu_lab.quant import GROUPS, quantize, quantize_rows

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
D, N = 384, 88  # 384 inputs: 1.5 tiles of 256 (masked tail); 88 neurons: not a tile multiple
SMALL = {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}
VARIANTS = {
    "default": {},
    "small": SMALL,
    "steps-inside-a-group": {**SMALL, "BLOCK_K": 16},
    "groups-inside-a-step": {**SMALL, "BLOCK_K": 256},
    "wide-rows": {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 2},
    "fp32-tile": {"mode": "tile"},  # one token: the fp32 tile instead of the half2 decode
    "split-inputs": {**SMALL, "SPLIT": 2},  # one token: partial sums over two input halves
    "split-four": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT": 4, "num_warps": 1},
}


def rows(dtype, n_rows, group=64):
    return int4_weight(dtype, D, n_rows, group, "rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("group", GROUPS)
def test_kept_up_equals_the_dequantised_rows(dtype, batch, group, seed):
    w = rows(dtype, N, group)
    x = torch.randn(batch, D, dtype=dtype)
    b = torch.randn(N, dtype=dtype)
    idx = odd_index(N, 37)
    out = poisoned(batch, 37, dtype)
    assert int4_kept_up(x, w, idx, bias=b, out=out, config=SMALL) is out
    ref = int4_kept_up_ref(x, w, idx, bias=b)
    assert_close(out, ref, dtype, seed)
    # the reference is the dense layer on the dequantised W, the listed columns
    dense = x.float() @ w.dequantize(torch.float32).T + b.float()
    assert_close(ref, dense[:, idx.long()].to(dtype), dtype, seed)


# the activation is the epilogue's, apart from the tiling: the default tiling (the half2 decode
# at one token) takes each, and every other tiling one in turn
ACTS = ("silu", "relu", "gelu")
ACTIVATED = [("default", a) for a in ACTS] + [
    (v, ACTS[i % 3]) for i, v in enumerate(v for v in VARIANTS if v != "default")
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant, activation", ACTIVATED)
def test_kept_up_gated_variants(dtype, batch, variant, activation, seed):
    w = rows(dtype, 2 * N, 32)  # gate rows, then up rows
    x = torch.randn(batch, D, dtype=dtype)
    b = torch.randn(2 * N, dtype=dtype)
    idx = odd_index(N, 21)
    kw = dict(activation=activation, gated=True, bias=b)
    out = poisoned(batch, 21, dtype)
    int4_kept_up(x, w, idx, out=out, config=VARIANTS[variant], **kw)
    assert_close(out, int4_kept_up_ref(x, w, idx, **kw), dtype, seed)
    # every neuron (idx None) in order, against the columns layout of the same weight
    every = int4_kept_up(x, w, None, config=VARIANTS[variant], **kw)
    assert_close(every, int4_kept_up_ref(x, w, torch.arange(N), **kw), dtype, seed)


@pytest.mark.parametrize("batch", [1, 4])
def test_kept_up_head_blocks_and_empty_list(batch, seed):
    dtype, dh = torch.float16, 16
    w = rows(dtype, 8 * dh, 64)  # 8 heads of 16 rows
    x = torch.randn(batch, D, dtype=dtype)
    heads = torch.tensor([6, 1, 3])
    got = int4_kept_up(x, w, heads, rows_per_index=dh, config=SMALL)
    assert got.shape == (batch, 3 * dh)
    assert_close(got, int4_kept_up_ref(x, w, heads, rows_per_index=dh), dtype, seed)
    want = (
        (x.float() @ w.dequantize(torch.float32).T).view(batch, 8, dh)[:, heads].reshape(batch, -1)
    )
    assert_close(got, want.to(dtype), dtype, seed)
    none = int4_kept_up(x, w, torch.zeros(0, dtype=torch.int32), rows_per_index=dh)
    assert none.shape == (batch, 0)


def test_kept_up_one_token_vector_in_vector_out(seed):
    w = rows(torch.bfloat16, N, 128)
    x = torch.randn(D, dtype=torch.bfloat16)
    y = int4_kept_up(x, w)
    assert y.shape == (N,)
    assert_close(y, int4_kept_up_ref(x, w), torch.bfloat16, seed)


def cats_thr(w, x, kept):
    """Thresholds keeping about ``kept`` of the |silu(gate)| entries (inf: none, -1: all)."""
    n = w.shape[0] // 2
    if kept in (0, 1):
        return torch.full((n,), float("inf") if kept == 0 else -1.0)
    return torch.full((n,), float(torch.quantile(gate_act(w, x).abs().flatten(), 1 - kept)))


def gate_act(w, x, bias=None):
    n = w.shape[0] // 2
    g = x.float() @ w.dequantize(torch.float32)[:n].T
    return torch.nn.functional.silu(g if bias is None else g + bias[:n].float())


def assert_close_off_threshold(out, ref, a, thr, dtype, seed):
    """``out`` against ``ref`` where ``|a|`` is not within 2% of its threshold: there the
    kernel's gate (summed in another order, its tile rounded to x's dtype in a union batch) may
    fall on the other side, and the neuron flips between kept and dropped."""
    near = ((a.abs() - thr).abs() <= 0.02 * thr.abs()).expand_as(out)
    # a median threshold has 3.5% of 88 neurons within 2% of it on average, up to 15% in 800
    # random draws: the bound only guards that most entries are compared
    assert near.float().mean() < 0.25, f"too many entries near the threshold; seed={seed}"
    assert_close(out.masked_fill(near, 0), ref.masked_fill(near, 0), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("kept", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("variant", ["default", "small", "groups-inside-a-step"])
def test_cats_up(dtype, batch, kept, variant, seed):
    w = rows(dtype, 2 * N, 64)
    x = torch.randn(batch, D, dtype=dtype)
    b = torch.randn(2 * N, dtype=dtype) / 4
    thr = cats_thr(w, x, kept)
    out = poisoned(batch, N, dtype)
    int4_cats_up(x, w, thr, activation="silu", bias=b, out=out, config=VARIANTS[variant])
    ref = int4_cats_up_ref(x, w, thr, activation="silu", bias=b)
    if kept == 0:
        assert (out == 0).all()
    else:
        assert_close_off_threshold(out, ref, gate_act(w, x, b), thr, dtype, seed)
    if kept == 1:  # every neuron kept: DejaVu's up projection over every neuron
        full = int4_kept_up_ref(x, w, None, activation="silu", gated=True, bias=b)
        assert_close(ref, full, dtype, seed)


def test_cats_up_fc1_and_per_neuron_thresholds(seed):
    dtype = torch.float16
    w = rows(dtype, N, 32)  # fc1: no up rows
    x = torch.randn(2, D, dtype=dtype)
    thr = torch.rand(N) * 0.8
    got = int4_cats_up(x, w, thr, activation="relu", config=SMALL)
    a = torch.relu(x.float() @ w.dequantize(torch.float32).T)
    ref = int4_cats_up_ref(x, w, thr, activation="relu")
    assert_close_off_threshold(got, ref, a, thr, dtype, seed)
    assert_close_off_threshold(got, torch.where(a > thr, a, 0.0).to(dtype), a, thr, dtype, seed)


def test_cats_union_batch_masks_each_token_by_its_own_rule(seed):
    dtype = torch.float16
    w = rows(dtype, 2 * N, 64)
    x = torch.randn(2, D, dtype=dtype)
    thr = cats_thr(w, x, 0.5)
    both = int4_cats_up(x, w, thr, activation="silu", config=SMALL)
    for b in range(2):
        one = int4_cats_up(x[b], w, thr, activation="silu", config=SMALL)
        assert_close_off_threshold(both[b], one, gate_act(w, x[b]), thr, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 300.0])
def test_one_token_half2_kernels_take_activations_of_any_scale(dtype, scale, seed):
    # the half2 kernels divide x by its largest magnitude before the fp16 products: tiny and
    # large activations (and bf16 ones beyond fp16's range) keep their relative accuracy
    w = rows(dtype, N, 32)
    x = (torch.randn(1, D) * scale).to(dtype)
    x[0, 7] = 40 * scale  # one outlier channel, as LLM activations have
    idx = odd_index(N, 37)
    got = int4_kept_up(x, w, idx)
    ref = int4_kept_up_ref(x, w, idx)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, f"seed {seed}: relative error {rel:.2e} at activation scale {scale}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("path", ["default", "rows"])
def test_rows_gemv_head_blocks(dtype, batch, path, seed):
    dh = 16
    w = quantize(torch.randn(8 * dh, 80) / 4, group=32, dtype=dtype)  # W_O^T: 8 heads, d = 80
    heads = torch.tensor([5, 0, 2, 7], dtype=torch.int32)
    o = torch.randn(batch, 4 * dh, dtype=dtype)
    out = poisoned(batch, 80, dtype)
    cfg = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "programs": 6}
    if path == "rows":  # one token walks the index list in the GEMV instead of a scatter
        cfg["mode"] = "rows"
    int4_rows_gemv(o, w, heads, rows_per_index=dh, out=out, config=cfg)
    ref = int4_rows_gemv_ref(o, w, heads, rows_per_index=dh)
    assert_close(out, ref, dtype, seed)
    rows_of = (heads.long()[:, None] * dh + torch.arange(dh)).reshape(-1)
    assert_close(ref, int4_rows_gemv_ref(o, w, rows_of), dtype, seed)


def _bad_calls():
    w = rows(torch.float16, 2 * N, 32)
    x = torch.randn(2, D, dtype=torch.float16)
    thr = torch.zeros(N)
    return [
        (lambda: int4_kept_up(x.float(), w), TypeError, "pass float16 or bfloat16"),
        (lambda: int4_kept_up(x.bfloat16(), w), TypeError, "quantise with dtype"),
        (lambda: int4_kept_up(x, w.dequantize()), TypeError, "must be an Int4Rows"),
        (lambda: int4_kept_up(x[:, :100], w), ValueError, r"expected \[384\] or \[B, 384\]"),
        (lambda: int4_kept_up(torch.randn(33, D).half(), w), ValueError, "1 to 32 tokens"),
        (lambda: int4_kept_up(x, w, torch.tensor([1, 1])), ValueError, "duplicate"),
        (lambda: int4_kept_up(x, w, torch.tensor([0, 999])), ValueError, "must lie in"),
        (lambda: int4_kept_up(x, w, torch.tensor([0.5])), TypeError, "int32 or int64"),
        (lambda: int4_kept_up(x, w, activation="tanh"), ValueError, "is not one of"),
        (lambda: int4_kept_up(x, w, gated=True, rows_per_index=2), ValueError, "gate rows then up"),
        (lambda: int4_kept_up(x, w, torch.tensor([0]), rows_per_index=7), ValueError, "blocks of 7"),
        (lambda: int4_kept_up(x, w, bias=torch.zeros(3).half()), ValueError, "bias has shape"),
        (lambda: int4_kept_up(x, w, out=torch.empty(2, 3).half()), ValueError, "out has shape"),
        (lambda: int4_kept_up(x, w, config={"BLOCK_N": 24}), ValueError, "powers of two"),
        (lambda: int4_cats_up(x, w, thr.half(), activation="silu"), TypeError, "float32"),
        (lambda: int4_cats_up(x, w, torch.zeros(7), activation="silu"), ValueError, "rows for thr's 7"),
        (lambda: int4_cats_up(x, w, thr, activation="none"), ValueError, "is not one of"),
        (lambda: int4_cats_up(x, w, [0.0] * N, activation="silu"), TypeError, "torch.Tensor"),
        (lambda: int4_rows_gemv(x[:, :32], quantize(torch.randn(64, 8), 32, torch.float16),
                                torch.tensor([0, 1]), rows_per_index=3), ValueError, "dividing"),
    ]  # fmt: skip


def test_bad_inputs_are_refused_in_one_sentence():
    assert_refused_in_one_sentence(_bad_calls())


def test_rows_layout_and_columns_layout_hold_the_same_numbers(seed):
    w = torch.randn(2 * N, D)
    r = quantize_rows(w, group=64, dtype=torch.float16)
    c = quantize(w.T, group=64, dtype=torch.float16)
    assert torch.equal(r.dequantize(), c.dequantize().T)
    assert torch.equal(r.columns().packed, c.packed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_kernel_lays_out_x_as_the_decode_reads_it(dtype, seed):
    import triton

    from dejavu_lab.kernels.int4.up_half2 import int4_pairs_kernel

    x = torch.randn(1, D, dtype=dtype)
    x[0, 5] = -9.0  # the largest magnitude, negative
    nw = D // 8
    xp = torch.full((4 * nw,), -1, dtype=torch.int32)
    xw = torch.full((nw,), float("nan"))
    inv = torch.full((1,), float("nan"))
    int4_pairs_kernel[(1,)](x, xp, xw, inv, D, BLOCK_W=triton.next_power_of_2(nw) // 2)
    inv9 = torch.tensor(1.0) / torch.tensor(9.0)  # the kernel's fp32 inverse, then a product
    xs = (x[0].float() * inv9).half().view(nw, 2, 4)  # input 8w + 4h + p
    bits = xs.view(torch.int16).int() & 0xFFFF
    want = (bits[:, 0, :] | (bits[:, 1, :] << 16)).T.reshape(-1)  # pair p of word w at [p, w]
    assert torch.equal(xp, want.to(torch.int32)), f"seed {seed}"
    assert torch.allclose(xw, x[0].float().view(nw, 8).sum(1), atol=1e-4), f"seed {seed}"
    assert inv.item() == pytest.approx(1 / 9.0), f"seed {seed}"
