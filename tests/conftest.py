"""Shared fixtures: the real demo model is loaded once per test session."""

import pytest
import torch

from dejavu_lab.models import load_model, random_model


@pytest.fixture(scope="session")
def demo():
    """(model, tokenizer, arch) of the real demo model (fetched and cached on first use)."""
    return load_model("demo")


@pytest.fixture(params=["tiny-opt", "tiny-opt-postln", "tiny-llama"])
def tiny(request):
    """Each tiny random architecture the adapters support (OPT pre-LN, OPT post-LN, Llama)."""
    return random_model(request.param, seed=torch.seed() % 2**31)
