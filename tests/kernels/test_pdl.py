"""Programmatic dependent launch is safe only if every kernel launched with it waits for the
grid before it at its first statement: a launch site with ``**pdl_args(...)`` whose kernel
reads or writes memory before ``await_inputs(PDL)`` would race with its predecessor. The one
exception, the int4 GEMV, reads its weights first (no kernel writes them): before its wait it
may only load, and only through the pointers it names in ``READ_AHEAD``."""

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
        "int4_half2_kernel",
    } <= names
    for module, name in launches:
        fn = getattr(importlib.import_module(f"dejavu_lab.kernels.{module}"), name).fn
        tree = ast.parse(inspect.getsource(fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        want = "if PDL:\n    await_inputs(PDL)"  # guarded: the interpreter pays for the call
        waits = [i for i, st in enumerate(body) if ast.unparse(st) == want]
        assert waits, f"{module}.{name} never waits"
        ahead = getattr(importlib.import_module(f"dejavu_lab.kernels.{module}"), "READ_AHEAD", ())
        if not ahead:
            assert waits[0] == 0, f"{module}.{name} starts with {ast.unparse(body[0])!r}"
        _only_reads_ahead(module, body[: waits[0]], set(ahead))
        assert "PDL" in inspect.signature(fn).parameters


def _only_reads_ahead(module, stmts, allowed):
    """Statements before the wait: no store or atomic (also inside the jit helpers they
    call), and no pointer argument but ``allowed``."""
    mod = importlib.import_module(f"dejavu_lab.kernels.{module}")
    seen, todo = set(), list(stmts)
    while todo:
        node = todo.pop()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in ("store", "atomic_add", "atomic_cas",
                                                                  "atomic_xchg", "atomic_max"):  # fmt: skip
                raise AssertionError(f"{module}: {ast.unparse(node)!r} writes before the wait")
            if isinstance(sub, ast.Name) and sub.id.endswith("_ptr") and sub.id not in allowed:
                raise AssertionError(
                    f"{module}: {ast.unparse(node)!r} reads {sub.id} before the wait"
                )
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and sub.func.id not in seen
            ):
                helper = getattr(getattr(mod, sub.func.id, None), "fn", None)
                if helper is not None:
                    seen.add(sub.func.id)
                    todo.extend(ast.parse(inspect.getsource(helper)).body[0].body)


def test_the_read_ahead_check_catches_a_read_of_the_input():
    tree = ast.parse("s = tl.load(s_ptr + 1)\nx = tl.load(x_ptr + 1)")
    _only_reads_ahead("int4.half2", tree.body[:1], {"s_ptr"})
    try:
        _only_reads_ahead("int4.half2", tree.body, {"s_ptr"})
    except AssertionError as e:
        assert "x_ptr" in str(e)
    else:
        raise AssertionError("a read of x before the wait went through")


def test_pdl_args_only_on_a_hopper_gpu():
    assert pdl.pdl_args(torch.device("cpu")) == {}
    on = pdl.PDL
    try:
        pdl.PDL = False
        assert pdl.pdl_args(torch.device("cuda", 0)) == {}  # off: no CUDA call at all
    finally:
        pdl.PDL = on
