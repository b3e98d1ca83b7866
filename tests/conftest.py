"""Shared fixtures: the real demo model is loaded once per test session (per worker)."""

import os

import pytest
import torch

# make test runs one pytest-xdist worker per core: each gets its share of the cores, so two
# workers' matmuls do not fight over the same two cores
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )

from dejavu_lab.models import load_model, random_model


@pytest.fixture(scope="session")
def demo():
    """(model, tokenizer, arch) of the real demo model (fetched and cached on first use)."""
    return load_model("demo")


@pytest.fixture(params=["tiny-opt", "tiny-opt-postln", "tiny-llama"])
def tiny(request):
    """Each tiny random architecture the adapters support (OPT pre-LN, OPT post-LN, Llama)."""
    return random_model(request.param, seed=torch.seed() % 2**31)


# the files that take longest on a 2-core CPU (fresh clone, --durations), longest first
LONG_FILES = (
    "tests/test_book.py",  # the quick book build, about 7.5 minutes: first, on its own worker
    "tests/test_cli.py",
    "tests/test_gemma_lm_eval.py",
    "tests/test_bad_inputs.py",
    "tests/test_gemma_gguf.py",
    "dejavu_lab/lm_eval_tasks.py",
    "tests/test_engine_methods.py",
    "tests/test_kernels_fused.py",
    "tests/test_kernels_threshold.py",
    "tests/test_kernels.py",
    "tests/test_engine_tp.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first, the book build before all: ``make test`` runs pytest-xdist with
    ``--dist loadfile --no-loadscope-reorder``, which hands out whole files in this order, so
    one worker starts the book at once and the other works through the rest beside it, with
    the short files last to even out the end."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
