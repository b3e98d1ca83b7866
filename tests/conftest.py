"""Shared fixtures: the real demo model is loaded once per test session (per worker)."""

import os

import pytest
import torch

# make test runs one pytest-xdist worker per core: each gets its share of the cores, so two
# workers' matmuls do not fight over the same two cores. The processes a test starts get the
# same share (OMP_NUM_THREADS): the book build's notebook kernels, beside the other worker, ran
# two OpenMP threads on a core that worker held, several times slower than one (chapter 40 in
# quick mode, one core busy elsewhere: 138 s with two threads, 24 s with one)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))

from _bad_inputs import shared
from _interpreter import install

from dejavu_lab.models import load_model, random_model

install()  # Triton's interpreter patches triton.language once per launch (see _interpreter.py)


@pytest.fixture(scope="session")
def demo():
    """(model, tokenizer, arch) of the real demo model (fetched and cached on first use)."""
    return load_model("demo")


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """The objects the bad-input cases through the API are made from (``tests/_bad_inputs.py``),
    built once per test file."""
    return shared(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(params=["tiny-opt", "tiny-opt-postln", "tiny-llama"])
def tiny(request):
    """Each tiny random architecture the adapters support (OPT pre-LN, OPT post-LN, Llama)."""
    return random_model(request.param, seed=torch.seed() % 2**31)


def pytest_collection_modifyitems(config, items):
    """The book build (tests/test_book.py, the longest file) first: under pytest-xdist its worker
    starts on it at once and the other worker runs the rest of the suite beside it."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_book.py")
