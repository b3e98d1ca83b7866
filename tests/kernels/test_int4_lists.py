"""A token's kept rows listed once (:mod:`dejavu_lab.kernels.int4.lists`): the lists equal
their reference, the norm epilogue makes the same lists as the standalone kernel, and the int4
threshold GEMV walking them equals the GEMV that lists its rows itself, and the reference.

Fresh random inputs every run (the seed is in each failure message), fp16 and bf16, one
threshold per site (TEAL) and one per input channel (WINA), every row kept and none. On a GPU:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_int4_lists.py
"""

import pytest
import torch
from helpers import (
    DTYPES,
    assert_close,
    assert_refused_in_one_sentence,
    int4_weight,
    on_device,
    seed,
)

from dejavu_lab.kernels import _workspace, residual_norm
from dejavu_lab.kernels.int4 import int4_threshold_gemv, int4_threshold_gemv_ref
from dejavu_lab.kernels.int4.lists import KeptLists, kept_lists, kept_lists_ref
from dejavu_lab.kernels.int4.sums import int4_sums

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module
D_IN, D_OUT = 256, 80  # four blocks of 64 rows; 80 outputs: a masked column tail


def thresholds(x, which):
    """TEAL's one threshold keeping about half, WINA's one per channel, all kept, none kept."""
    if which == "site":
        return float(x.float().abs().median())
    if which == "channel":
        return (torch.rand(x.shape[-1]) * 2 * x.float().abs().median()).float()
    return -1.0 if which == "all" else float("inf")


def assert_same_lists(got: KeptLists, want: KeptLists, seed):
    """The same counts and scales, sums to fp32 rounding, and each block's listed entries."""
    assert torch.equal(got.meta[:, :2].cpu(), want.meta[:, :2].cpu()), f"seed={seed}"
    torch.testing.assert_close(got.sums().cpu(), want.sums().cpu(), rtol=1e-5, atol=1e-5)
    for b, n in enumerate(want.counts().tolist()):
        rows = slice(b * want.rows, b * want.rows + n)
        assert torch.equal(got.entries[rows].cpu(), want.entries[rows].cpu()), (
            f"block {b}; seed={seed}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["site", "channel", "all", "none"])
def test_kept_lists_equal_their_reference_and_feed_the_gemv(dtype, which, seed):
    x = torch.randn(1, D_IN).to(dtype)
    thr = thresholds(x, which)
    lists = kept_lists(x, thr)
    assert_same_lists(
        lists, kept_lists_ref(x.cpu(), thr.cpu() if torch.is_tensor(thr) else thr), seed
    )
    kept = (x.float().abs() > torch.as_tensor(thr)).flatten().nonzero().flatten()
    assert torch.equal(lists.kept().cpu(), kept.cpu())
    w = int4_weight(dtype, D_IN, D_OUT, 128)
    listed = int4_threshold_gemv(x, w, thr, lists=lists)
    own = int4_threshold_gemv(x, w, thr)
    assert_close(listed, int4_threshold_gemv_ref(x, w, thr), dtype, seed)
    # the same numbers walked in the same order: equal up to the fp32 sum of the kept x
    torch.testing.assert_close(listed.float(), own.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("which", ["site", "channel"])
@pytest.mark.parametrize("kind,n", [("rms", 512), ("layer", 320)])
def test_the_norm_epilogue_lists_what_the_kernel_lists(which, kind, n, seed):
    """``residual_norm(..., lists=(thr, kept))`` (its programs each normalise and list a slice):
    the same h and norm(h) as the one-program norm, the sums and the consumed workspace left at
    zero, the lists kept_lists makes from norm(h), and the sums product over them equals the
    reference."""
    x, ws, gu = torch.randn(1, n).half(), torch.randn(n), torch.randn(700)
    norm = ((torch.rand(n) + 0.5).half(), torch.randn(n).half() if kind == "layer" else None, 1e-5)
    bias = torch.randn(n).half()
    thr = thresholds(torch.randn(1, n).half(), which)
    kept = KeptLists.empty(n, x.device)
    want_h, want_y = residual_norm(ws.clone(), bias, x, norm, kind=kind, from_sums=True)
    h, y = residual_norm(ws, bias, x, norm, kind=kind, from_sums=True, zero=gu, lists=(thr, kept))
    assert torch.equal(h, want_h), f"seed={seed}"
    torch.testing.assert_close(y.float(), want_y.float(), rtol=0, atol=4e-3)  # one rounding
    assert bool((ws == 0).all()) and bool((gu == 0).all()), f"workspaces left non-zero; seed={seed}"
    assert_same_lists(kept, kept_lists(y, thr), seed)
    w = int4_weight(torch.float16, n, D_OUT, 64)
    sums = int4_sums(y, w, thr, lists=kept)
    assert sums is not None
    out = sums.clone()
    sums.zero_()  # what the next launch does with the workspace
    assert_close(out[None].half(), int4_threshold_gemv_ref(y, w, thr), torch.float16, seed)
    counter = _workspace.buffer(x.device, "norm_lists", 1, torch.int32)
    assert int(counter[0]) == 0, "the arrival counter was not reset for the next launch"


def test_bad_lists_are_refused_in_one_sentence():
    x, w = torch.randn(1, D_IN).half(), int4_weight(torch.float16, D_IN, D_OUT, 64)
    lists = kept_lists(x, 0.5)
    assert_refused_in_one_sentence([
        (lambda: kept_lists(torch.randn(1, 100).half(), 0.5), ValueError, "multiple of the list"),
        (lambda: kept_lists(torch.randn(2, D_IN).half(), 0.5), ValueError, "one token"),
        (lambda: kept_lists(x, float("nan")), ValueError, "NaN"),
        (lambda: kept_lists(x, torch.zeros(D_IN, dtype=torch.float64)), TypeError, "float32"),
        (lambda: kept_lists(x, 0.5, out=KeptLists.empty(128, x.device)), ValueError, "out holds"),
        (lambda: int4_threshold_gemv(x, w, 0.5, lists=(1, 2)), TypeError, "kept_lists"),
        (lambda: int4_threshold_gemv(torch.randn(2, D_IN).half(), w, 0.5, lists=lists),
         ValueError, "one token"),
        (lambda: int4_threshold_gemv(x[:, :128], int4_weight(torch.float16, 128, D_OUT, 64), 0.5,
                                     lists=lists), ValueError, "make them from this x"),
        (lambda: KeptLists.empty(100, x.device), ValueError, "not a multiple"),
    ])  # fmt: skip
