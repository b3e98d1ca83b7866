"""The row norm kernel (:mod:`dejavu_lab.kernels.norm`: LayerNorm and RMSNorm of each row)
against its PyTorch reference, run through TRITON_INTERPRET=1. On a GPU box:

    DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0 pytest tests/kernels/test_norm.py
"""

import pytest
import torch
from helpers import DTYPES, assert_close, on_device, seed

from dejavu_lab.kernels import row_norm, row_norm_ref

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


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
