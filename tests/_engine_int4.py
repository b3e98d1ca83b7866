"""Builders shared by the engine's 4-bit tests (test_engine_int4.py: dense, TEAL and WINA;
test_engine_int4_sparse.py: DejaVu and CATS): the tiny fp16 models, prompts, decoded logits and
the dequantised twin of a set of int4 decoder weights.

Test modules import the fixture ``model`` by name (pytest finds fixtures in the module's
namespace).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dejavu_lab.models import random_model
from dejavu_lab.quant import Int4Rows, Int4Weight

GROUP = 64  # divides every input width of the tiny models (64, 192, 256)


def ids_of(n, seed=0):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_logits(dec, ids, n_prompt):
    out = [dec.prefill(ids[:, :n_prompt])]
    out += [dec.step(int(t)) for t in ids[0, n_prompt:]]
    return torch.cat(out)


def dequantised(w4):
    """The same decoder weights with each int4 matrix replaced by its dequantisation, in the
    same layout (an Int4Rows gives ``W``, an Int4Weight ``Wᵀ``), in the scales' dtype."""

    def layer(lw):
        fields = {f.name: getattr(lw, f.name) for f in dataclasses.fields(lw)}
        return {
            n: w.dequantize() for n, w in fields.items() if isinstance(w, Int4Weight | Int4Rows)
        }

    layers = [dataclasses.replace(lw, **layer(lw)) for lw in w4.layers]
    return dataclasses.replace(w4, layers=layers)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt"])
def model(request):
    """Each tiny random architecture in fp16 (one fixed seed), once per test module."""
    return random_model(request.param, dtype=torch.float16, seed=3).model
