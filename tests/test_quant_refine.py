"""The MSE-refined int4 (dejavu_lab.quant.refine): never more error than round-to-nearest, in
every group; exact where the weights are exactly 4-bit; the same format the kernels read."""

import pytest
import torch

from dejavu_lab.measure.quant_quality import format_weights, input_moments
from dejavu_lab.models import random_model
from dejavu_lab.quant import Int4Weight, QuantError, quantize, quantize_mse


def _group_err(q, w, group):
    e = (q.dequantize(torch.float32) - w).pow(2)  # the codes x scales, no output rounding
    return e.reshape(w.shape[0] // group, group, -1).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_no_group_has_more_error_than_round_to_nearest(dtype, group):
    torch.manual_seed(0)
    w = torch.randn(256, 48) * torch.rand(1, 48) * 0.1
    w[::29] *= 8  # outlier rows
    rtn, mse = quantize(w, group=group, dtype=dtype), quantize_mse(w, group=group, dtype=dtype)
    assert isinstance(mse, Int4Weight) and mse.dtype == dtype and mse.group == group
    assert mse.packed.shape == rtn.packed.shape and mse.scales.shape == rtn.scales.shape
    # the scales and mins are what the kernels read: the error is measured in their dtype
    e_rtn, e_mse = _group_err(rtn, w, group), _group_err(mse, w, group)
    assert (e_mse <= e_rtn * (1 + 1e-6) + 1e-12).all()
    assert e_mse.sum() < 0.9 * e_rtn.sum()


def test_exactly_four_bit_weights_come_back_exactly():
    torch.manual_seed(1)
    q = torch.randint(0, 16, (64, 8)).float()
    q[0], q[1] = 0, 15  # every group spans the whole code range
    w = q * 0.25 - 1.0
    assert torch.equal(quantize_mse(w, group=32).dequantize(), w)


def test_bad_input_is_refused_like_round_to_nearest():
    with pytest.raises(QuantError, match="groups of 128"):
        quantize_mse(torch.randn(96, 8), group=128)


def test_the_mse_formats_of_the_quality_study():
    model = random_model("tiny-llama").model
    rtn, info = format_weights(model, "rtn-g64")
    mse, info_mse = format_weights(model, "mse-g64")
    assert info == info_mse and rtn.keys() == mse.keys()
    mods = dict(model.named_modules())
    err = {k: sum(float((q[n].dequantize().float() - mods[n].weight.detach().T.float()).pow(2).sum())
                  for n in q) for k, q in (("rtn", rtn), ("mse", mse))}  # fmt: skip
    assert err["mse"] < err["rtn"]


def test_importance_weighs_the_error_of_each_input_channel():
    torch.manual_seed(2)
    w = torch.randn(128, 32)
    h = torch.rand(128) ** 4 * 100  # a few channels carry most of the activations' energy
    rtn, plain, act = quantize(w, 64), quantize_mse(w, 64), quantize_mse(w, 64, importance=h)

    def weighted(q):
        return float((h[:, None] * (q.dequantize(torch.float32) - w).pow(2)).sum())

    assert weighted(act) <= weighted(rtn) and weighted(act) < weighted(plain)
    with pytest.raises(QuantError, match="importance must be 128 finite, non-negative"):
        quantize_mse(w, 64, importance=-h)


def test_the_activation_weighted_format_needs_calibration_text():
    model = random_model("tiny-llama").model
    with pytest.raises(QuantError, match="pass calibration="):
        format_weights(model, "act-g64")
    ids = torch.randint(0, 100, (2, 16))
    act, info = format_weights(model, "act-g64", calibration=ids)
    h = input_moments(model, ids)
    assert info["groups"] == "64" and act.keys() == h.keys()
    # what the format minimises: each matrix's output error on those inputs, channel by channel
    mods = dict(model.named_modules())
    rtn, _ = format_weights(model, "rtn-g64")

    def out_err(q):
        return sum(float((h[n][:, None] * (q[n].dequantize(torch.float32)
                                          - mods[n].weight.detach().T.float()).pow(2)).sum())
                   for n in q)  # fmt: skip

    assert out_err(act) < out_err(rtn)
