"""The int4 format: packing, round-to-nearest quantisation and its checks."""

import pytest
import torch

from dejavu_lab.quant import GROUPS, Int4Weight, QuantError, quantize
from dejavu_lab.quant.int4 import pack, unpack


def test_pack_round_trips_every_code():
    q = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # [3, 32]
    assert torch.equal(unpack(pack(q)), q)
    assert pack(q).shape == (3, 16)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_is_within_half_a_step_and_exact_on_the_grid(group, dtype):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(256, 48, generator=g)
    q = quantize(w, group=group, dtype=dtype)
    assert q.shape == (256, 48) and q.dtype == dtype and q.group == group
    step = q.scales.float().repeat_interleave(group, 0)
    # codes are chosen against the rounded scales/mins, so the error is half a step (+ the
    # rounding of the min to the scales' dtype at the group's low end)
    tol = 0.5 * step + (q.mins.float().repeat_interleave(group, 0) - w).clamp(min=0)
    assert ((q.dequantize(torch.float32) - w).abs() <= tol + 1e-6).all()
    # a weight that is already on the grid comes back exactly
    again = quantize(q.dequantize(torch.float32), group=group, dtype=torch.float32)
    assert torch.allclose(again.dequantize(), q.dequantize(torch.float32), atol=1e-6, rtol=0)


def test_skipping_a_channel_skips_its_bytes():
    q = quantize(torch.randn(128, 64), group=64, dtype=torch.float16)
    assert q.row_bytes == 32  # 64 outputs at 4 bits
    assert q.group_bytes == 2 * 64 * 2  # a scale and a min per output, fp16
    assert q.nbytes == 128 * q.row_bytes + 2 * q.group_bytes
    dense = q.dequantize(torch.float32)
    rows = q.codes()[5].float() * q.scales[0].float() + q.mins[0].float()
    assert torch.equal(dense[5], rows)  # row 5 needs only its own bytes and its group's


def test_constant_groups_and_zero_weights():
    w = torch.zeros(64, 4)
    w[:, 1] = 3.0
    q = quantize(w, group=32)
    assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(100, 8),), "do not split into groups of 128"),
        ((torch.zeros(64, 7), 32), "cannot pack two per byte"),
        ((torch.zeros(64, 8), 48), "group=48 is not supported"),
        ((torch.zeros(64, 8, dtype=torch.int32), 32), "2-D float tensor"),
        ((torch.full((64, 8), float("nan")), 32), "NaN or inf"),
    ],
)
def test_quantize_refuses_bad_input(args, match):
    with pytest.raises(QuantError, match=match):
        quantize(*args)


def test_int4weight_checks_its_parts():
    q = quantize(torch.randn(64, 8), group=32)
    with pytest.raises(QuantError, match="scales has shape"):
        Int4Weight(q.packed, q.scales[:1], q.mins, 32)
    with pytest.raises(QuantError, match="uint8"):
        Int4Weight(q.packed.int(), q.scales, q.mins, 32)
    with pytest.raises(QuantError, match="share one dtype"):
        Int4Weight(q.packed, q.scales, q.mins.half(), 32)
