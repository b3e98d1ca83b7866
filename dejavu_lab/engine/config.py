"""What a user asks of the engine, and the one error it raises when it cannot (Deja Vu §5.1).

:class:`SparseConfig` says what the sparse decode step keeps per token; :class:`EngineError`
is raised, with one sentence saying what to do, for any model or request the engine cannot
run. Both sit below every other engine module, so the arrows between them run one way:
``config -> weights -> sets -> decoder``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sparsify import budgets

__all__ = ["EngineError", "SparseConfig"]


class EngineError(ValueError):
    """The engine cannot run this model or this request; the message says what to do.

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> Decoder(random_model("tiny-opt").model, max_seq_len=4096)
    Traceback (most recent call last):
    ...
    dejavu_lab.engine.config.EngineError: max_seq_len=4096 exceeds the model's 2048 positions.
    """


@dataclass(frozen=True)
class SparseConfig:
    """What the sparse path keeps per token (sparsity = fraction removed, as in the paper).

    >>> import torch
    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt", dtype=torch.float16).model  # 256 neurons, 4 heads
    >>> dec = Decoder(m, max_seq_len=16, sparse=SparseConfig(mlp_sparsity=0.75, head_sparsity=0.5))
    >>> dec.k_mlp, dec.k_heads, dec.window  # kept per token; deferred-KV window
    (64, 2, 16)
    >>> dec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).shape  # the sparse kernels
    torch.Size([1, 6])
    """

    mlp_sparsity: float = 0.0  # MLP neurons removed (OPT-175B in §5.1: 0.85)
    head_sparsity: float = 0.0  # query heads removed (§5.1: 0.5)
    kv_window: int = 16  # deferred KV window (1-32 tokens); 0 computes every head's K/V each step
    side_stream: bool = True  # lookahead predictors on a second CUDA stream (else inline)

    def __post_init__(self):
        budgets(self.mlp_sparsity, 1, "mlp_sparsity")
        budgets(self.head_sparsity, 1, "head_sparsity")
        if not 0 <= self.kv_window <= 32:
            raise EngineError(f"kv_window={self.kv_window} must lie in [0, 32] tokens.")
