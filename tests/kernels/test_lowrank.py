"""R-Sparse's low-rank term (:mod:`dejavu_lab.kernels.threshold.lowrank`) against its PyTorch
reference, run through TRITON_INTERPRET=1.

Fresh random inputs every run (the seed is in each failure message), fp16 and bf16, thresholds
dropping none, some or all entries (one number or one per column), ranks not a multiple of the
tiles, added in place to fp32 sums and to fp16/bf16 outputs. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_lowrank.py
"""

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, on_device, seed

from dejavu_lab.kernels.threshold.lowrank import lowrank_add, lowrank_partial_kernel, lowrank_ref

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the compiled kernels run")
def test_kernel_runs_in_the_interpreter():
    assert type(lowrank_partial_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_in, r, d_out", [(300, 40, 200), (129, 3, 70), (64, 33, 300)])
@pytest.mark.parametrize("dropped", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("into", ["sums", "output"])
def test_lowrank_add_matches_the_reference(dtype, d_in, r, d_out, dropped, into, seed):
    x = torch.randn(1, d_in, dtype=dtype)
    v_t = (torch.randn(d_in, r) / d_in**0.5).to(dtype)
    u_t = (torch.randn(r, d_out) / r**0.5).to(dtype)
    q = float(torch.quantile(x.float().abs(), dropped)) if 0 < dropped < 1 else None
    thr = torch.full((d_in,), -1.0 if dropped == 0 else float("inf") if dropped == 1 else q)
    if q is not None:  # one threshold per column, as WINA's weighting gives
        thr = thr * (torch.rand(d_in) + 0.5)
    base = torch.randn(d_out)
    out = base.clone() if into == "sums" else base.to(dtype)[None]
    before = out.clone().float()  # (.float() of fp32 sums is the same tensor)
    want = (before + lowrank_ref(x, thr, v_t, u_t).view(out.shape)).to(out.dtype)
    got = lowrank_add(x, thr, v_t, u_t, out)
    assert got is out  # in place
    if into == "sums":
        assert_close(got - before, want - before, dtype, seed)
    else:  # rounded once into fp16/bf16: a sum at a rounding edge may land one ulp of the
        # output away, a large share of the small term, so compare the sums (the term is
        # tenths of the base: a missing or doubled term fails by far)
        assert_close(got.float(), want.float(), dtype, seed)


def test_shapes_that_do_not_chain_are_one_sentence():
    with pytest.raises(ValueError, match="shapes do not chain") as err:
        lowrank_add(torch.zeros(1, 8).half(), torch.zeros(8), torch.zeros(8, 2).half(),
                    torch.zeros(3, 4).half(), torch.zeros(4))  # fmt: skip
    assert "\n" not in str(err.value)
