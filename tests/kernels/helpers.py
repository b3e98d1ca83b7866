"""Helpers shared by the kernel tests (tests/kernels/): where tensors live, fresh seeds, error
checks, the MLP problem that the fused and the CATS MLP tests both run, and the int4 weights,
outputs and refusals of the two int4 kernel tests (columns and rows layouts).

Import this module before ``dejavu_lab.kernels`` (it sets ``TRITON_INTERPRET=1`` unless set, so
the Triton kernels run through the CPU interpreter). ``DEJAVU_TEST_DEVICE=cuda`` puts every
test tensor on the GPU (and ``TRITON_INTERPRET=0`` runs the compiled kernels there). Test
modules import the fixtures ``on_device`` (autouse) and ``seed`` by name.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest
import torch

from dejavu_lab.bench.timing import relerr
from dejavu_lab.quant import quantize, quantize_rows

DEVICE = os.environ.get("DEJAVU_TEST_DEVICE", "cpu")  # where every test tensor is created
DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 3e-3, torch.bfloat16: 3e-2}  # relative Frobenius error
ON_GPU = DEVICE != "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> bool:
    """Whether this Triton ships the CUDA backend's ptxas (compiling for a GPU needs no GPU)."""
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


#: skip a test that compiles for a GPU where Triton ships no ptxas (a non-CUDA build)
needs_ptxas = pytest.mark.skipif(
    not _ptxas(), reason="this Triton ships no ptxas (a non-CUDA build)"
)


def assert_compiles(script: str, timeout: int = 600) -> None:
    """Run ``script`` in a subprocess with the interpreter off (the kernels must be JIT
    functions): it hands kernels to ``triton.compile`` for an sm_90 target and prints
    ``compiled``. The interpreter runs the Python, not Triton's compiler, so this catches what
    only the compiled path rejects."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.fixture(autouse=True)
def on_device():
    """Create each test's tensors on DEVICE (torch's default-device context)."""
    if ON_GPU and not torch.cuda.is_available():
        pytest.skip(f"DEJAVU_TEST_DEVICE={DEVICE} but torch sees no CUDA GPU; unset it on a CPU")
    with torch.device(DEVICE):
        yield


@pytest.fixture
def seed():
    """A fresh random seed per test, set in torch and named in every failure message."""
    s = random.randrange(2**31)
    torch.manual_seed(s)
    return s


def assert_close(out, ref, dtype, seed):
    """Same shape, every element written (no NaN), relative error under TOL[dtype]; exact
    zeros where the reference is all zeros."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), f"unwritten (NaN) output elements; seed={seed}"
    if ref.abs().max() == 0:
        assert (out == 0).all(), f"nonzero output where the reference is zero; seed={seed}"
        return
    err = relerr(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e}; seed={seed}"


def poisoned(batch, n, dtype):
    """[batch, n] of NaN: an output element a kernel leaves unwritten fails assert_close."""
    return torch.full((batch, n), float("nan"), dtype=dtype)


def assert_refused_in_one_sentence(calls):
    """Each ``(call, exception type, pattern)``: ``call()`` raises that type, its message
    matching the pattern and one sentence (ends with a period, none inside)."""
    for call, exc, match in calls:
        with pytest.raises(exc, match=match) as info:
            call()
        msg = str(info.value)
        assert msg.endswith(".") and msg.count(". ") == 0, msg


def pick(n, frac):
    """round(frac * n) distinct indices in random (unsorted) order, int32."""
    return odd_index(n, round(frac * n))


def odd_index(n, k):
    """k distinct indices below n in random (unsorted) order, int32: across groups and tiles."""
    return torch.randperm(n)[:k].to(torch.int32)


def int4_weight(dtype, d_in, d_out, group, layout="columns"):
    """A random weight of ``d_in`` inputs and ``d_out`` outputs (entries of size ``d_in**-0.25``)
    in int4 with ``dtype`` scales: an Int4Weight of ``w_t`` [d_in, d_out] (``layout="columns"``)
    or an Int4Rows of ``W`` [d_out, d_in] (``"rows"``)."""
    if layout == "columns":
        return quantize(torch.randn(d_in, d_out) / d_in**0.25, group=group, dtype=dtype)
    return quantize_rows(torch.randn(d_out, d_in) / d_in**0.25, group=group, dtype=dtype)


# The MLP problem that test_mlp.py (the fused sparse MLP) and test_cats_mlp.py (the CATS MLP)
# both run.
N, D = 96, 80  # neurons, model width (not multiples of the tiles: masked tails)
CASES = {  # (activation, gated, biases)
    "relu-bias": ("relu", False, True),
    "gelu": ("gelu", False, False),
    "swiglu": ("silu", True, False),
    "geglu-tanh-bias": ("gelu_tanh", True, True),
}


def small(batch, **extra):
    cfg = {"BLOCK_N": 4 if batch == 1 else 16, "BLOCK_K": 32, "BLOCK_C": 32, "num_warps": 4}
    cfg["down"] = {"BLOCK_R": 16, "BLOCK_D": 32, "num_warps": 4, "programs": 8}
    return {**cfg, **extra}


def mlp(dtype, batch, case):
    act, gated, biased = CASES[case]
    x = torch.randn(batch, D, dtype=dtype)
    w_in = (torch.randn(2 * N if gated else N, D) / D**0.5).to(dtype)
    w_down_t = (torch.randn(N, D) / N**0.5).to(dtype)
    b_in = (torch.randn(w_in.shape[0]) / 2).to(dtype) if biased else None
    b_down = torch.randn(D, dtype=dtype) if biased else None
    out = torch.full((batch, D), float("nan"), dtype=dtype)
    kw = dict(activation=act, b_in=b_in, b_down=b_down)
    return x, w_in, w_down_t, out, gated, kw
