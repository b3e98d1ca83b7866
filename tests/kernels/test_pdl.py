"""Programmatic dependent launch is safe only if every kernel launched with it waits for the
grid before it at its first statement: a launch site with ``**pdl_args(...)`` whose kernel
reads or writes memory before ``await_inputs(PDL)`` would race with its predecessor."""

import ast
import importlib
import inspect
import pathlib

import torch

import dejavu_lab.kernels as K
from dejavu_lab.kernels import pdl

SRC = pathlib.Path(K.__file__).parent


def pdl_launches():
    """(module, kernel name) of every launch that passes ``**pdl_args(...)``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Subscript):
                continue
            star = [k.value for k in node.keywords if k.arg is None]
            if any(
                isinstance(v, ast.Call) and getattr(v.func, "id", "") == "pdl_args" for v in star
            ):
                module = ".".join(path.relative_to(SRC).with_suffix("").parts)
                found.append((module, node.func.value.id))
    return found


def test_every_pdl_launch_waits_first():
    launches = pdl_launches()
    names = {n for _, n in launches}
    # the decode step's kernels: the tile GEMV and its finalize, both epilogues, RoPE,
    # attention and its combine, CATS's up rows
    assert {
        "threshold_tile_kernel",
        "threshold_finalize_kernel",
        "rope_sums_kernel",
        "residual_norm_kernel",
        "rope_kernel",
        "sparse_attention_kernel",
        "sparse_attention_combine_kernel",
        "cats_up_kernel",
    } <= names
    for module, name in launches:
        fn = getattr(importlib.import_module(f"dejavu_lab.kernels.{module}"), name).fn
        tree = ast.parse(inspect.getsource(fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        want = "if PDL:\n    await_inputs(PDL)"  # guarded: the interpreter pays for the call
        assert first == want, f"{module}.{name} starts with {first!r}"
        assert "PDL" in inspect.signature(fn).parameters


def test_pdl_args_only_on_a_hopper_gpu():
    assert pdl.pdl_args(torch.device("cpu")) == {}
    on = pdl.PDL
    try:
        pdl.PDL = False
        assert pdl.pdl_args(torch.device("cuda", 0)) == {}  # off: no CUDA call at all
    finally:
        pdl.PDL = on
