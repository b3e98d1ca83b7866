"""DejaVu's predictor scores in two launches (:mod:`dejavu_lab.kernels.predict`) against the
PyTorch modules' function, run through TRITON_INTERPRET=1 (or compiled on a GPU:
``DEJAVU_TEST_DEVICE=cuda TRITON_INTERPRET=0``), and compiled for sm_90 without a GPU.

Fresh random inputs every run (the seed is in each failure message): OPT-13B's and Qwen's
widths at the default ranks, odd sizes that leave partial tiles, one token and a batch's,
fp16/bf16/fp32 inputs at large scale (the RMS norm must cancel it).
"""

import pytest
import torch
from helpers import assert_compiles, needs_ptxas, on_device, seed

from dejavu_lab.kernels.predict import predictor_scores, predictor_scores_ref
from dejavu_lab.predictors import PredictorConfig, Predictors

FIXTURES = (on_device, seed)  # pytest finds fixtures by name in this module


def weights(d, r_n, r_h, n, h):
    return (torch.randn(r_n + r_h, d) / d**0.5, torch.randn(n, r_n), torch.randn(n),
            torch.randn(h, r_h), torch.randn(h))  # fmt: skip


@pytest.mark.parametrize("B,d,r_n,r_h,n,h,dtype", [
    (1, 5120, 64, 32, 20480, 40, torch.float16), (3, 896, 64, 32, 4864, 14, torch.bfloat16),
    (2, 100, 5, 3, 77, 5, torch.float32), (1, 7168, 64, 32, 28672, 56, torch.float16)])  # fmt: skip
def test_scores_match_the_modules(B, d, r_n, r_h, n, h, dtype, seed):
    x = (torch.randn(B, d) * 40).to(dtype)
    w = weights(d, r_n, r_h, n, h)
    z, out = torch.full((B, r_n + r_h), float("nan")), (torch.full((B, n), float("nan")),
                                                       torch.full((B, h), float("nan")))  # fmt: skip
    got = predictor_scores(x, *w, z=z, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(got, predictor_scores_ref(x, *w), strict=True):
        assert not a.isnan().any(), f"unwritten scores; seed={seed}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")


def test_same_function_as_the_predictor_modules(seed):
    """Stacked as the engine stacks them, the kernels give LowRank's scores."""
    fp = {"d_model": 64, "d_mlp": 192, "n_heads": 4, "n_layers": 1}
    p = Predictors(fp, PredictorConfig(mlp_rank=8, head_rank=4))
    m, hd = p.mlp[0], p.heads[0]
    with torch.no_grad():
        for t in (m.up.bias, hd.up.bias):
            t.normal_()
        x = torch.randn(2, 64).half()
        down = torch.cat((m.down.weight, hd.down.weight)).contiguous()
        sn, sh = predictor_scores(x, down, m.up.weight, m.up.bias, hd.up.weight, hd.up.bias)
        torch.testing.assert_close(sn, p.mlp_scores(0, x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sh, p.head_scores(0, x), rtol=1e-4, atol=1e-5)


def test_clear_errors():
    w = weights(16, 4, 2, 10, 3)
    with pytest.raises(ValueError, match=r"pass \[B, d\]"):
        predictor_scores(torch.randn(16), *w)
    with pytest.raises(
        ValueError, match=r"down must be a contiguous float32 tensor of shape \(6, 16\)"
    ):
        predictor_scores(torch.randn(1, 16), w[0].half(), *w[1:])
    with pytest.raises(ValueError, match=r"wn must be .* shape \(10, 4\)"):
        predictor_scores(torch.randn(1, 16), w[0], torch.randn(4, 10).t(), *w[2:])


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_lab.kernels.predict import predictor_down_kernel as down, predictor_up_kernel as up

target = GPUTarget("cuda", 90, 32)
for dt in ("fp16", "bf16"):
    sig = {"x_ptr": "*" + dt, "w_ptr": "*fp32", "z_ptr": "*fp32", "R": "i32", "d": "i32",
           "stride_xb": "i32", "stride_zb": "i32", "eps": "fp32"}
    triton.compile(ASTSource(down, sig, constexprs={"BLOCK_R": 4, "BLOCK_D": 512}), target=target,
                   options={"num_warps": 4})
sig = {a: "*fp32" for a in ("z_ptr", "wn_ptr", "bn_ptr", "wh_ptr", "bh_ptr", "sn_ptr", "sh_ptr")}
sig.update({a: "i32" for a in ("n", "H", "r_n", "r_h", "stride_zb", "stride_snb", "stride_shb")})
triton.compile(ASTSource(up, sig, constexprs={"PROGS_N": 160, "BLOCK_N": 128, "BLOCK_RN": 64,
                                              "BLOCK_RH": 32}), target=target,
               options={"num_warps": 4})
print("compiled")
"""


@needs_ptxas
def test_the_kernels_compile_for_sm90():
    assert_compiles(COMPILE, timeout=300)
