"""Quality under sparsity: perplexity, and the bytes per token a sparse step would read.

:func:`sparse_perplexity` is the perplexity of ``windows`` with :func:`~.core.sparsified`
applied; :func:`sparse_eval` adds the realised kept fractions and the decoder-layer weight bytes
per token against dense (:func:`~dejavu_lab.step_bytes.bytes_per_token_fraction`), as a :class:`SparseResult`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..arch import Arch, get_arch
from ..corpus import perplexity
from ..step_bytes import bytes_per_token_fraction
from ..vocab import method
from .core import _check_windows, _method_name, sparsified
from .kept import Kept

__all__ = ["SparseResult", "sparse_eval", "sparse_perplexity"]


def sparse_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    progress: bool = True,
    batch_size: int = 1,
    **sparsified_kwargs,
) -> float:
    """Perplexity over ``windows`` [n, window] with :func:`sparsified` applied.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> sparse_perplexity(model, ids, progress=False) == sparse_perplexity(
    ...     model, ids, mlp_sparsity=0.0, progress=False)
    True
    """
    windows = _check_windows(windows)
    with torch.no_grad(), sparsified(model, **sparsified_kwargs):
        return perplexity(model, windows, batch_size=batch_size, progress=progress)


@dataclass
class SparseResult:
    """What :func:`sparse_eval` measured: quality and the bytes a sparse step reads.

    >>> r = SparseResult("teal", 0.5, 31.2, 1022, 0.52, {"attn_in": 0.4})
    >>> r.as_dict()["bytes_per_token_fraction"]
    0.52
    """

    method: str
    sparsity: float | list  # the requested budget
    perplexity: float
    tokens: int  # tokens evaluated (windows × window)
    bytes_per_token_fraction: float  # decoder-layer weight bytes read per token / dense
    kept: dict  # site -> realised kept fraction, averaged over layers that ran sparse

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def sparse_eval(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    progress: bool = True,
    batch_size: int = 1,
    kept: Kept | None = None,
    **sparsified_kwargs,
) -> SparseResult:
    """Perplexity over ``windows`` plus the realised bytes per token against dense.

    Threshold methods keep a varying number of entries per token; the bytes are counted from
    the kept fraction each site realised on these windows (:mod:`dejavu_lab.step_bytes`).
    ``kept``: a :class:`~dejavu_lab.sparsify.kept.Kept` to fill (e.g. with
    ``per_token=True`` for the distribution of kept counts); a fresh one by default.

    >>> from dejavu_lab.models import random_model
    >>> model, _, _ = random_model("tiny-llama")
    >>> r = sparse_eval(model, torch.randint(0, 128, (1, 16)), method="oracle", mlp_sparsity=0.5,
    ...                 progress=False)
    >>> r.tokens, r.kept, r.bytes_per_token_fraction  # the MLP is 3/4 of a layer's weights
    (16, {'mlp': 0.5}, 0.625)
    """
    windows = _check_windows(windows)
    kept = Kept() if kept is None else kept
    arch = sparsified_kwargs.get("arch") or get_arch(model)
    with torch.no_grad(), sparsified(model, kept=kept, **sparsified_kwargs):
        ppl = perplexity(model, windows, batch_size=batch_size, progress=progress)
    name = _method_name(sparsified_kwargs.get("method"), sparsified_kwargs.get("mode"))
    extra = kept.extra_elements()  # online rotations, low-rank terms
    predictors = sparsified_kwargs.get("predictors")
    if method(name).needs == "predictors" and predictors is not None:
        extra += _predictor_elements(predictors, kept, arch)
    frac = bytes_per_token_fraction(arch, kept.fractions(), extra_elements=extra)
    budget = sparsified_kwargs.get("sparsity")
    if budget is None:
        budget = {
            "mlp": sparsified_kwargs.get("mlp_sparsity", 0.0),
            "heads": sparsified_kwargs.get("head_sparsity", 0.0),
        }
    return SparseResult(name, budget, ppl, int(windows.numel()), frac, kept.by_site())


def _predictor_elements(predictors, kept: Kept, arch: Arch) -> float:
    """Weights the predictors read per token (layers where they select something)."""
    total = 0.0
    for i in range(arch.n_layers):
        for kind, nets in (("mlp", predictors.mlp), ("heads", predictors.heads)):
            if (i, kind) in kept.counts:
                net = nets[i]
                total += net.down.weight.numel() + net.up.weight.numel()
    return total
