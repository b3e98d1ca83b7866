"""The one-launch top-k select (:mod:`dejavu_lab.kernels.select`) against ``torch.topk``, run
through TRITON_INTERPRET=1 (or compiled on a GPU: ``DEJAVU_TEST_DEVICE=cuda
TRITON_INTERPRET=0``).

Fresh random scores every run (the seed is in each failure message): DejaVu's widths and
budgets, one row and a batch's rows, fp32/fp16/bf16 scores, ties at the k-th value, signed
zeros, infinities, and outputs poisoned so an unwritten slot fails.
"""

import pytest
import torch
from helpers import assert_compiles, needs_ptxas, on_device, seed

from dejavu_lab.kernels.select import MAX_ROW, topk_select, topk_select_ref

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


def check(s, k, v, i, s_seed):
    """Distinct indices in ascending order inside each row, pointing at their values, and the
    kept values those of torch.topk (ties may keep other, equal entries)."""
    assert not v.isnan().any() and (i >= 0).all(), f"unwritten slots; seed={s_seed}"
    assert (i[..., 1:] > i[..., :-1]).all(), f"indices not ascending/distinct; seed={s_seed}"
    assert torch.equal(s.float().gather(-1, i), v), f"values are not the scores; seed={s_seed}"
    want = torch.topk(s.float(), k, dim=-1).values.sort(dim=-1).values
    assert torch.equal(v.sort(dim=-1).values, want), f"other values kept; seed={s_seed}"


@pytest.mark.parametrize("n,k,rows", [(20480, 3072, 1), (28672, 4301, 1), (14336, 7168, 1),
                                      (40, 20, 1), (56, 28, 1), (20480, 3072, 3), (14336, 2150, 4),
                                      (7, 7, 1), (300, 1, 2), (49152, 7373, 1)])  # fmt: skip
def test_same_sets_as_torch(n, k, rows, seed):
    s = torch.randn(rows, n)
    v = torch.full((rows, k), float("nan"))
    i = torch.full((rows, k), -1, dtype=torch.long)
    topk_select(s, k, v, i)
    check(s, k, v, i, seed)
    _, ref = topk_select_ref(s, k)  # distinct scores: exactly torch's set
    assert torch.equal(i, ref), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ties_and_dtypes(dtype, seed):
    """Coarse scores (many ties at the k-th value) keep the lowest tied indices; a 1-D row, an
    int32 index buffer."""
    s = torch.randn(5000).mul(4).round().to(dtype)
    v, i = torch.empty(700), torch.empty(700, dtype=torch.int32)
    topk_select(s, 700, v, i)
    i = i.long()
    check(s, 700, v, i, seed)
    kth = v.min()
    above = (s.float() > kth).nonzero().flatten()
    ties = (s.float() == kth).nonzero().flatten()[: 700 - above.numel()]
    assert torch.equal(i, torch.cat((above, ties)).sort().values), f"seed={seed}"


def test_special_values():
    inf = float("inf")
    s = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, -5.0, inf, -inf, 3.0])
    v, i = topk_select(s, 3)
    assert i.tolist() == [3, 5, 7] and torch.equal(v, s[[3, 5, 7]])
    v, i = topk_select(s, 8)  # everything, in index order
    assert i.tolist() == list(range(8))
    v, i = topk_select(torch.full((3, 10), -inf), 4)  # all tied: the first four
    assert i.tolist() == [[0, 1, 2, 3]] * 3


def test_clear_errors():
    s = torch.randn(100)
    with pytest.raises(ValueError, match=r"k = 0 must lie in \[1, 100\]"):
        topk_select(s, 0)
    with pytest.raises(ValueError, match=r"k = 101"):
        topk_select(s, 101)
    with pytest.raises(ValueError, match="float tensor"):
        topk_select(torch.arange(10), 2)
    with pytest.raises(ValueError, match="indices must be"):
        topk_select(s, 5, indices=torch.empty(5, dtype=torch.int16))
    with pytest.raises(ValueError, match="values must be"):
        topk_select(s, 5, values=torch.empty(6))


def test_long_rows_fall_back_to_torch():
    s = torch.randn(MAX_ROW + 8)
    v, i = topk_select(s, 10)
    assert torch.equal(i, topk_select_ref(s, 10)[1]) and torch.equal(s[i], v)


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_lab.kernels.select import topk_select_kernel as k

for idx, src, block in [("i64", "fp32", 64), ("i32", "bf16", 32768)]:
    sig = {"s_ptr": "*" + src, "val_ptr": "*fp32", "idx_ptr": "*" + idx, "N": "i32", "K": "i32",
           "stride_s": "i32", "stride_v": "i32", "stride_i": "i32"}
    triton.compile(ASTSource(k, sig, constexprs={"BLOCK": block, "CHUNK": min(block, 4096)}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": max(1, min(16, block // 256))})
print("compiled")
"""


@needs_ptxas
def test_the_kernel_compiles_for_sm90():
    """The interpreter runs the Python, not Triton's compiler (which, for one, refuses a
    constexpr assigned in each pass of an unrolled loop): compile for Hopper without a GPU."""
    assert_compiles(COMPILE, timeout=300)
