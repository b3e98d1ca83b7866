"""The int4 kernel compiles for Hopper (sm_90) on a machine without a GPU: the interpreter runs
the Python, not Triton's compiler, so this catches what only the compiled path rejects.

A subprocess (``TRITON_INTERPRET=0``: the kernels must be JIT functions) hands four
representative specialisations to ``triton.compile`` for an sm_90 target, through the ``ptxas``
that Triton's CUDA backend ships: batch 1 dense and threshold (the [rows, words, nibbles]
tile), a union batch on tensor cores, the kept-row path with per-output word loads; and the
rows-layout kernel (every row, listed rows, CATS's gate-then-up) at batch 1 and on tensor cores;
and the one-token tile kernel, dense and threshold; and the half2 kernel's inline PTX (dense,
threshold, bf16, the kept-row list; under programmatic dependent launch,
with the dense walk's rows read before the wait) and of the rows-layout half2 kernel (every
row, listed gated rows in bf16, CATS), which the interpreter never runs.
"""

from helpers import assert_compiles, needs_ptxas

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_lab.kernels.int4.kernel import int4_gemv_kernel as k

def sig(dt):
    ptr = {"x_ptr": dt, "s_ptr": dt, "m_ptr": dt, "b_ptr": dt, "out_ptr": dt, "p_ptr": "i32",
           "thr_ptr": "fp32", "idx_ptr": "i32", "ws_ptr": "fp32", "count_ptr": "i32"}
    s = {a: "*" + t for a, t in ptr.items()}
    s["thr_value"] = "fp32"
    for a in ("B", "N", "D", "stride_xb", "stride_p", "stride_ob", "rows_per_split", "n_split"):
        s[a] = "i32"
    return {a: s[a] for a in k.arg_names if a in s}

for mode, bb, unpack, br, bd, dt in [(0, 1, 0, 64, 256, "fp16"), (1, 1, 0, 32, 256, "bf16"),
                                     (1, 16, 0, 32, 128, "fp16"), (2, 1, 1, 16, 256, "fp16")]:
    c = dict(MODE=mode, THR_SCALAR=True, HAS_BIAS=True, REDUCE=1, GROUP=128, NPE=8,
             UNPACK=unpack, BLOCK_B=bb, BLOCK_R=br, BLOCK_D=bd, UPCAST=False, CHUNK=8, RPI=1)
    triton.compile(ASTSource(k, sig(dt), constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 2})

from dejavu_lab.kernels.int4.up import int4_up_kernel as up

ptr = {"x_ptr": "fp16", "p_ptr": "i32", "s_ptr": "fp16", "m_ptr": "fp16", "idx_ptr": "i32",
       "thr_ptr": "fp32", "b_ptr": "fp16", "out_ptr": "fp16"}
s = {a: "*" + t for a, t in ptr.items()}
for a in ("B", "K", "D", "UP", "stride_xb", "stride_p", "stride_s", "stride_ob"):
    s[a] = "i32"
for mode, bb in [(0, 1), (1, 1), (2, 1), (2, 16)]:
    c = dict(MODE=mode, RPI=1, GATED=mode == 2, ACT="silu", HAS_BIAS=mode == 0, GROUP=128,
             BLOCK_B=bb, BLOCK_N=32, BLOCK_K=256, UPCAST=False)
    triton.compile(ASTSource(up, {a: s[a] for a in up.arg_names if a in s}, constexprs=c),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
from dejavu_lab.kernels.int4.tile import int4_tile_kernel as tile

s = {"x_ptr": "*fp16", "p_ptr": "*i32", "s_ptr": "*fp16", "m_ptr": "*fp16", "thr_ptr": "*fp32",
     "thr_value": "fp32", "ws_ptr": "*fp32", "D": "i32", "stride_p": "i32"}
for mode, scalar, even in [(0, True, True), (1, True, False), (1, False, True)]:
    c = dict(MODE=mode, THR_SCALAR=scalar, EVEN_D=even, GROUP=128, BLOCK_R=32, BLOCK_D=256)
    triton.compile(ASTSource(tile, {a: s[a] for a in tile.arg_names if a in s}, constexprs=c),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 1})
from dejavu_lab.kernels.int4.half2 import int4_half2_kernel as half2

s.update(list_ptr="*i32", count_ptr="*i32", b_ptr="*fp16", out_ptr="*fp16", xb_ptr="*fp16", K="i32",
         meta_ptr="*i32")
for mode, scalar, even, dt, compact in [(0, True, True, "fp16", False),
                                        (1, True, False, "fp16", False),
                                        (1, False, True, "bf16", False),
                                        (1, True, True, "fp16", True),
                                        (1, False, False, "bf16", True)]:
    sig = {a: s[a] for a in half2.arg_names if a in s}
    if dt == "bf16":
        sig.update(x_ptr="*bf16", s_ptr="*bf16", m_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16")
    c = dict(MODE=mode, THR_SCALAR=scalar, EVEN_D=even, GROUP=128, ROWS=64, SUB=32,
             BLOCK_D=512, ASM=True, COMPACT=compact, FUSED=compact or not even, HAS_BIAS=even,
             STRIDE_P=1792, ACT_X="", GATED_X=False, HAS_XBIAS=False,
             PDL=2 if even else 0, AHEAD=mode == 0 and even,  # the read-ahead before the wait
             LISTED=False)
    triton.compile(ASTSource(half2, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 2, "num_stages": 1})
for mode, compact in [(0, False), (1, True)]:  # x: the previous product's sums, finished here
    sig = {a: s[a] for a in half2.arg_names if a in s}
    sig["x_ptr"] = "*fp32"
    c = dict(MODE=mode, THR_SCALAR=True, EVEN_D=True, GROUP=128, ROWS=64, SUB=32 if mode == 0
             else 16, BLOCK_D=512, ASM=True, COMPACT=compact, FUSED=False, HAS_BIAS=False,
             STRIDE_P=512, ACT_X="silu", GATED_X=True, HAS_XBIAS=True, PDL=2, AHEAD=mode == 0,
             LISTED=False)
    triton.compile(ASTSource(half2, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 2, "num_stages": 1})
sig = {a: s[a] for a in half2.arg_names if a in s}  # kept rows listed once per token
c = dict(MODE=1, THR_SCALAR=True, EVEN_D=True, GROUP=128, ROWS=64, SUB=16, BLOCK_D=512, ASM=True,
         COMPACT=True, FUSED=False, HAS_BIAS=False, STRIDE_P=1792, ACT_X="", GATED_X=False,
         HAS_XBIAS=False, PDL=2, AHEAD=False, LISTED=True)
triton.compile(ASTSource(half2, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": 2, "num_stages": 1})
from dejavu_lab.kernels.int4.norm_lists import norm_lists_kernel as rn

for scalar in (True, False):  # the norm that lists them
    sig = {a: "*fp16" for a in ("b_ptr", "res_ptr", "h_ptr", "w_ptr", "nb_ptr", "y_ptr")}
    sig.update(src_ptr="*fp32", z_ptr="*fp32", n="i32", eps="fp32", n_zero="i32", n_list="i32",
               count_ptr="*i32", thr_ptr="*fp32", thr_value="fp32", entries_ptr="*i32",
               meta_ptr="*i32")
    c = dict(FROM_SUMS=True, HAS_BIAS=scalar, RMS=scalar, HAS_NB=not scalar, BLOCK=4096,
             SLICE=256, PDL=2, THR_SCALAR=scalar, LIST_ROWS=64)
    triton.compile(ASTSource(rn, {a: sig[a] for a in rn.arg_names if a in sig}, constexprs=c),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
from dejavu_lab.kernels.int4.up_half2 import int4_up_half2_kernel as uh
from dejavu_lab.kernels.int4.up_half2 import int4_pairs_kernel as uh_pairs

s = {a: "*" + t for a, t in ptr.items()}
s.update(K="i32", D="i32", UP="i32", stride_s="i32", xp_ptr="*i32", xw_ptr="*fp32", ws_ptr="*fp32",
         inv_ptr="*fp32")
for mode, gated, dt in [(0, False, "fp16"), (1, True, "bf16"), (2, True, "fp16")]:
    sig = {a: s[a] for a in uh.arg_names if a in s}
    if dt == "bf16":
        sig.update(s_ptr="*bf16", m_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16")
    c = dict(MODE=mode, RPI=1, GATED=gated, ACT="silu", HAS_BIAS=mode == 0, GROUP=128,
             BLOCK_N=32, BLOCK_K=128 if mode else 512, ASM=True, STRIDE_P=512,
             SPLIT=4 if mode == 1 else 1)
    triton.compile(ASTSource(uh, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
    pk = uh_pairs
    sig = {"x_ptr": "*" + dt, "xp_ptr": "*i32", "xw_ptr": "*fp32", "inv_ptr": "*fp32", "D": "i32"}
    triton.compile(ASTSource(pk, sig, constexprs={"BLOCK_W": 512}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
print("compiled")
"""


@needs_ptxas
def test_the_kernels_compile_for_sm90():
    assert_compiles(SCRIPT)
