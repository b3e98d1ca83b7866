"""The two-stage greedy argmax returns torch's index, ties and odd vocabularies included."""

import pytest
import torch

from dejavu_lab.engine.greedy import argmax_rows, chunks


@pytest.mark.parametrize("V", [128256, 32000, 50272, 1001, 512])
def test_argmax_rows_matches_torch(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randint(0, 4, (3, V), generator=g).to(torch.float16)  # many ties
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    y = torch.randn(2, V, generator=g)
    assert torch.equal(argmax_rows(y), y.argmax(-1))


def test_first_maximum_across_chunks():
    V = 128256
    x = torch.zeros(1, V)
    x[0, [V - 1, 700, 12345]] = 5.0  # equal maxima in three chunks: the lowest index wins
    assert argmax_rows(x).item() == 700


def test_chunks_split_evenly():
    for V in (128256, 151936, 256000, 131072):
        k = chunks(V)
        assert k > 1 and V % k == 0 and V // k >= 256 and k & (k - 1) == 0
    assert chunks(32000) == chunks(50272) == chunks(131071) == 1
    assert chunks(32000, split_from=0) == 64
    x = torch.randn(2, 131072)  # split into 256 chunks of 512
    assert torch.equal(argmax_rows(x), x.argmax(-1))
