"""The W4A16 GEMVs (:mod:`dejavu_lab.kernels.int4`) against their references and against
``x @ w.dequantize()``, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), outputs poisoned with NaN
so an unwritten element fails, fp16 and bf16, batch 1 and union batches, groups 32/64/128,
every tiling and unpacking variant at tiny shapes. On a GPU box the same tests check the
compiled kernel:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_int4.py
"""

import pytest
import torch
from helpers import (
    DEVICE,
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
    int4_gemv,
    int4_gemv_ref,
    int4_rows_gemv,
    int4_rows_gemv_ref,
    int4_threshold_gemv,
    int4_threshold_gemv_ref,
)
from dejavu_lab.kernels.int4.dense import activated
from dejavu_lab.kernels.int4.half2 import HALF2
from dejavu_lab.kernels.int4.kernel import default_config, int4_gemv_kernel
from dejavu_lab.kernels.int4.sums import int4_sums
from dejavu_lab.kernels.int4.tile import TILE, int4_tile_kernel
from dejavu_lab.quant import GROUPS

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
D_IN, D_OUT = 256, 80  # 80 outputs: not a multiple of the column tiles (masked tails)
SMALL = {"BLOCK_R": 32, "BLOCK_D": 32, "num_warps": 4, "programs": 9}  # 3 column tiles x 3 splits


def weight(dtype, group=64, d_out=D_OUT):
    return int4_weight(dtype, D_IN, d_out, group)


def threshold_keeping(x, kept):
    """A threshold keeping about ``kept`` of x's entries (inf: none, -1: all)."""
    if kept == 0:
        return float("inf")
    if kept == 1:
        return -1.0
    return float(torch.quantile(x.float().abs().flatten(), 1 - kept))


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernel runs")
def test_kernel_runs_in_the_interpreter():
    assert type(int4_gemv_kernel).__name__ == "InterpretedFunction"
    assert type(int4_tile_kernel).__name__ == "InterpretedFunction"


def test_one_token_runs_half2_and_batches_the_loop():
    assert default_config(1, D_IN, 4096) == HALF2
    assert default_config(1, D_IN, 4096, op="int4_threshold_gemv")["mode"] == "half2"
    assert default_config(1, D_IN, 84).get("mode") != "half2"  # codes not in int32 words
    assert default_config(4, D_IN, 4096).get("mode") != "half2"
    assert default_config(1, D_IN, 4096, op="int4_rows_gemv").get("mode") != "half2"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("group", GROUPS)
def test_dense_equals_the_dequantised_product(dtype, batch, group, seed):
    w = weight(dtype, group)
    x = torch.randn(batch, D_IN, dtype=dtype)
    b = torch.randn(D_OUT, dtype=dtype)
    out = poisoned(batch, D_OUT, dtype)
    assert int4_gemv(x, w, bias=b, out=out, config=SMALL) is out
    assert_close(out, int4_gemv_ref(x, w, bias=b), dtype, seed)
    # the reference is the dense fp16/bf16 layer on the dequantised weight, to rounding
    assert_close(out, (x @ w.dequantize() + b).to(dtype), dtype, seed)


LOOP = {**SMALL, "mode": "loop"}  # one token on the loop kernel (batches always run it)
VARIANTS = {  # every config computes the same function
    "default": {},
    "small": SMALL,
    "tile-narrow": {"mode": "tile", "BLOCK_R": 16, "BLOCK_D": 16, "num_warps": 1},
    "tile-a-whole-group": {"mode": "tile", "BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4},
    "half2": {"mode": "half2", "ROWS": 32, "SUB": 16, "BLOCK_D": 32, "num_warps": 1},
    "half2-default": HALF2,
    "half2-compact": {
        "mode": "half2",
        "ROWS": 32,
        "SUB": 8,
        "BLOCK_D": 32,
        "num_warps": 1,
        "compact": 1,
    },
    "loop": LOOP,
    "rows-inside-a-group": {**LOOP, "BLOCK_R": 16},
    "groups-inside-a-step": {**LOOP, "BLOCK_R": 128},
    "gather-unpack": {**LOOP, "unpack": 1},
    "groups-inside-a-gather-step": {**LOOP, "BLOCK_R": 128, "unpack": 1},
    "one-split": {**LOOP, "split": 1},
    "many-splits-atomic": {**LOOP, "split": 8, "reduce": "atomic"},
    "wide-columns": {"mode": "loop", "BLOCK_R": 64, "BLOCK_D": 128, "num_warps": 2, "programs": 4},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(dtype, batch, variant, seed):
    w = weight(dtype, 32)
    x = torch.randn(batch, D_IN, dtype=dtype)
    out = poisoned(batch, D_OUT, dtype)
    int4_gemv(x, w, out=out, config=VARIANTS[variant])
    assert_close(out, int4_gemv_ref(x, w), dtype, seed)
    thr = threshold_keeping(x, 0.4)
    int4_threshold_gemv(x, w, thr, out=out, config=VARIANTS[variant])
    assert_close(out, int4_threshold_gemv_ref(x, w, thr), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_half2_sums_neither_overflow_nor_vanish(dtype, scale, seed):
    # the half2 kernel sums in fp16: it divides each program's activations by their largest
    # magnitude first, so activations of 1e3 (fp16 sums of 32 rows would pass 65504) and 1e-3
    # (fp16 subnormals) give the reference's result too
    w = weight(dtype, 64)
    x = (torch.randn(1, D_IN) * scale).to(dtype)
    out = poisoned(1, D_OUT, dtype)
    int4_gemv(x, w, out=out, config=HALF2)
    assert_close(out, int4_gemv_ref(x, w), dtype, seed)
    thr = threshold_keeping(x, 0.5)
    for cfg in (HALF2, {**HALF2, "compact": 1}):
        int4_threshold_gemv(x, w, torch.full((D_IN,), thr), out=out, config=cfg)
        assert_close(out, int4_threshold_gemv_ref(x, w, thr), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half2_fused_and_compact_with_bias_repeat(dtype, seed):
    # the fused epilogue leaves its counters and sums at zero, the kept-row lists are rewritten:
    # a second call gives the same output, and both equal the reference with the bias added
    w = weight(dtype, 64)
    x = torch.randn(1, D_IN, dtype=dtype)
    b = torch.randn(D_OUT, dtype=dtype)
    thr = threshold_keeping(x, 0.3)
    for cfg in ({**HALF2, "fused": 1}, {**HALF2, "fused": 1, "compact": 1, "SUB": 16}):
        first = int4_threshold_gemv(x, w, thr, bias=b, config=cfg)
        assert torch.equal(int4_threshold_gemv(x, w, thr, bias=b, config=cfg), first), cfg
        assert_close(first, int4_threshold_gemv_ref(x, w, thr, bias=b), dtype, seed)
    dense = int4_gemv(x, w, bias=b, config={**HALF2, "fused": 1})
    assert_close(dense, int4_gemv_ref(x, w, bias=b), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_activation_in_the_epilogue(dtype, batch, seed):
    # act(gate) * up of the product's two halves (one token: in the finishing launch; batches:
    # after the product), and a plain activation, equal the activation of the reference
    w = weight(dtype, 64)
    x = torch.randn(batch, D_IN, dtype=dtype)
    b = torch.randn(D_OUT, dtype=dtype)
    thr = threshold_keeping(x, 0.5)
    for cfg in (None, TILE, {**HALF2, "fused": 1}):
        for activation, gated in (("silu", True), ("gelu", False), ("relu", True)):
            full = int4_gemv_ref(x, w, bias=b)
            got = int4_gemv(x, w, bias=b, config=cfg, activation=activation, gated=gated)
            assert got.shape == (batch, D_OUT // 2 if gated else D_OUT)
            assert_close(got, activated(full, activation, gated), dtype, seed)
            full = int4_threshold_gemv_ref(x, w, thr, bias=b)
            got = int4_threshold_gemv(x, w, thr, bias=b, config=cfg, activation=activation,
                                      gated=gated)  # fmt: skip
            assert_close(got, activated(full, activation, gated), dtype, seed)
    with pytest.raises(ValueError, match="activation="):
        int4_gemv(x, w, activation="swish")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kept", [1.0, 0.5])
def test_sums_left_for_the_epilogue_and_read_back_finished(dtype, kept, seed):
    # one token's product left as fp32 sums (no finishing launch); a second product reads them
    # as its input, finished in its loads (act(gate + b) * (up + b), rounded to dtype): the
    # MLP's hidden activations with no launch of their own
    w_in = weight(dtype, 64, d_out=2 * D_IN)  # gate | up of D_IN neurons
    w_down = weight(dtype, 64)
    x = torch.randn(1, D_IN, dtype=dtype)
    b_in = torch.randn(2 * D_IN, dtype=dtype) / 4
    gu = int4_sums(x, w_in, kind="hidden")
    assert gu.dtype == torch.float32
    assert_close(gu[None].to(dtype), int4_gemv_ref(x, w_in), dtype, seed)
    for bias, gated, a in ((b_in, True, "silu"), (None, False, "gelu")):
        full = gu[None].float() + (0 if bias is None else bias.float())
        h = activated(full, a, True) if gated else activated(full[:, :D_IN], a, False)
        thr = None if kept == 1.0 else threshold_keeping(h, kept)
        got = int4_sums(gu, w_down, thr, x_act=a, x_gated=gated, x_bias=bias)
        ref = int4_gemv_ref(h.to(dtype), w_down) if thr is None else int4_threshold_gemv_ref(
            h.to(dtype), w_down, thr)  # fmt: skip
        assert_close(got[None].to(dtype), ref, dtype, seed)
        got.zero_()
    assert bool((gu != 0).any())  # the reader left x's sums for the caller to zero
    gu.zero_()


@pytest.mark.parametrize("d_out", [84, 6])  # int16 words (4 codes), bytes (2 codes)
def test_output_counts_that_are_not_multiples_of_eight(d_out, seed):
    w = weight(torch.float16, 32, d_out=d_out)
    x = torch.randn(2, D_IN, dtype=torch.float16)
    for unpack in (0, 1):
        out = poisoned(2, d_out, torch.float16)
        int4_gemv(x, w, out=out, config={**SMALL, "unpack": unpack})
        assert_close(out, int4_gemv_ref(x, w), torch.float16, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 4, 32])
@pytest.mark.parametrize("kept", [0.0, 0.2, 0.5, 1.0])
def test_threshold(dtype, batch, kept, seed):
    w = weight(dtype, 64)
    x = torch.randn(batch, D_IN, dtype=dtype)
    thr = threshold_keeping(x, kept)
    b = torch.randn(D_OUT, dtype=dtype)
    out = poisoned(batch, D_OUT, dtype)
    int4_threshold_gemv(x, w, thr, bias=b, out=out, config=SMALL)
    ref = int4_threshold_gemv_ref(x, w, thr, bias=b)
    assert_close(out, ref, dtype, seed)
    # the reference is the dense layer fed the masked input
    xm = torch.where(x.float().abs() > thr, x.float(), 0.0).to(dtype)
    assert_close(ref, int4_gemv_ref(xm, w, bias=b), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 6])
def test_wina_per_channel_thresholds(dtype, batch, seed):
    w = weight(dtype, 32)
    x = torch.randn(batch, D_IN, dtype=dtype)
    norms = w.dequantize(torch.float32).norm(dim=1)  # ||W[:, i]||: row i of w_t
    thr = (0.5 / norms).float().contiguous()
    out = poisoned(batch, D_OUT, dtype)
    int4_threshold_gemv(x, w, thr, out=out, config=SMALL)
    assert_close(out, int4_threshold_gemv_ref(x, w, thr), dtype, seed)


@pytest.mark.parametrize("batch", [1, 7])
def test_all_kept_threshold_equals_dense_and_edge_thresholds(batch, seed):
    dtype = torch.float16
    w = weight(dtype, 128)
    x = torch.randn(batch, D_IN, dtype=dtype)
    x[:, ::5] = 0  # exact zeros: dropped at thr = 0, kept at -1; the sum is the same
    # one config for both calls: the same kernel, the same order (the masked half2 walk)
    for cfg in (LOOP, {**HALF2, "compact": 0}):
        dense = int4_gemv(x, w, config=cfg)
        for thr in (-1.0, 0.0, torch.full((D_IN,), -1.0)):
            got = int4_threshold_gemv(x, w, thr, config=cfg)
            assert torch.equal(got, dense), f"{cfg}, thr={thr!r}; seed={seed}"
        none = int4_threshold_gemv(x, w, float("inf"), config=cfg)
        assert (none == 0).all()
    if batch == 1:  # the default walks a list of the kept rows: other fp16 sums, same function
        dense = int4_gemv(x, w)
        for thr in (-1.0, 0.0):
            assert_close(int4_threshold_gemv(x, w, thr), dense, dtype, seed)
        assert (int4_threshold_gemv(x, w, float("inf")) == 0).all()


def test_union_batch_reads_a_row_when_any_token_keeps_it(seed):
    dtype = torch.float16
    w = weight(dtype, 32)
    x = torch.zeros(2, D_IN, dtype=dtype)
    x[0, :40] = 2.0  # token 0 keeps rows 0..39, token 1 keeps rows 100..139
    x[1, 100:140] = -3.0
    x[1, :40] = 0.5  # below the threshold: masked by token 1's own rule
    y = int4_threshold_gemv(x, w, 1.0, config=SMALL)
    assert_close(y, int4_threshold_gemv_ref(x, w, 1.0), dtype, seed)
    assert_close(y[1:], int4_gemv_ref(torch.where(x[1:].abs() > 1, x[1:], 0), w), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("group", [32, 128])
def test_kept_rows(dtype, batch, group, seed):
    w = weight(dtype, group)
    idx = odd_index(D_IN, 77)
    h = torch.randn(batch, 77, dtype=dtype)
    b = torch.randn(D_OUT, dtype=dtype)
    out = poisoned(batch, D_OUT, dtype)
    int4_rows_gemv(h, w, idx, bias=b, out=out, config=SMALL)
    ref = int4_rows_gemv_ref(h, w, idx, bias=b)
    assert_close(out, ref, dtype, seed)
    # every row listed, in order: the dense product
    every = int4_rows_gemv(torch.randn(batch, D_IN, dtype=dtype), w, torch.arange(D_IN))
    assert not every.isnan().any()
    h_all = torch.zeros(batch, D_IN, dtype=dtype)
    h_all[:, idx.long()] = h
    assert_close(int4_gemv_ref(h_all, w, bias=b), ref, dtype, seed)


def test_kept_rows_empty_list_gives_the_bias():
    w = weight(torch.float16, 32)
    b = torch.randn(D_OUT, dtype=torch.float16)
    y = int4_rows_gemv(torch.zeros(0, dtype=torch.float16), w, torch.zeros(0, dtype=torch.int32),
                       bias=b)  # fmt: skip
    assert torch.equal(y, b)


def test_one_token_vector_in_vector_out(seed):
    w = weight(torch.bfloat16, 64)
    x = torch.randn(D_IN, dtype=torch.bfloat16)
    y = int4_gemv(x, w)
    assert y.shape == (D_OUT,)
    assert_close(y, int4_gemv_ref(x, w), torch.bfloat16, seed)


def _bad_calls():
    w16 = weight(torch.float16, 32)
    x = torch.randn(2, D_IN, dtype=torch.float16)
    return [
        (lambda: int4_gemv(x.float(), w16), TypeError, "pass float16 or bfloat16"),
        (lambda: int4_gemv(x.bfloat16(), w16), TypeError, "quantise with dtype"),
        (lambda: int4_gemv(x, w16.dequantize()), TypeError, "must be an Int4Weight"),
        (lambda: int4_gemv(x[:, :100], w16), ValueError, r"expected \[256\] or \[B, 256\]"),
        (lambda: int4_gemv(torch.randn(33, D_IN).half(), w16), ValueError, "1 to 32 tokens"),
        (lambda: int4_gemv(x, w16, bias=torch.zeros(3).half()), ValueError, "bias has shape"),
        (lambda: int4_gemv(x, w16, out=torch.empty(2, 3).half()), ValueError, "out has shape"),
        (lambda: int4_threshold_gemv(x, w16, float("nan")), ValueError, "thr is NaN"),
        (lambda: int4_threshold_gemv(x, w16, torch.ones(D_IN).half()), TypeError, "float32"),
        (lambda: int4_threshold_gemv(x, w16, torch.ones(7)), ValueError, "thr has shape"),
        (lambda: int4_rows_gemv(x[:, :3], w16, torch.tensor([1, 1, 2])), ValueError, "duplicate"),
        (lambda: int4_rows_gemv(x[:, :2], w16, torch.tensor([0, 999])), ValueError, "must lie in"),
        (lambda: int4_rows_gemv(x[:, :3], w16, torch.tensor([0, 1])), ValueError, r"expected \[2\]"),
        (lambda: int4_gemv(x, w16, config={"BLOCK_R": 48}), ValueError, "powers of two"),
        (lambda: int4_gemv(x[0], w16, config={"mode": "tile", "BLOCK_R": 24}), ValueError,
         "dividing the group"),
        (lambda: int4_gemv(x[0], w16, config={"ROWS": 24}), ValueError, "dividing the group"),
    ]  # fmt: skip


def test_bad_inputs_are_refused_in_one_sentence():
    assert_refused_in_one_sentence(_bad_calls())


@pytest.mark.skipif(DEVICE != "cpu", reason="needs a second device kind")
def test_meta_tensors_are_refused():
    w = weight(torch.float16, 32)
    with pytest.raises(ValueError, match="these kernels run on CUDA"):
        int4_gemv(torch.randn(2, D_IN, dtype=torch.float16, device="meta"), w)
