"""DejaVu's lookahead predictors around a decode step's layers (Deja Vu §4.3).

Layer i's input predicts layer i + 1's kept sets: before layer i computes, :meth:`Lookahead.
before` launches that prediction — on a side stream when there is one, so it runs beside layer
i's kernels — and :meth:`Lookahead.after` joins it before layer i + 1 reads its sets. The plain
step (:meth:`~dejavu_lab.engine.Decoder._layers`) and the fused one
(:func:`~dejavu_lab.engine.fused_step.fused_layers`) share it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Lookahead"]


class Lookahead:
    """``predict(i, x)`` fills layer i's kept sets from x; ``side``: a CUDA stream, or None to
    predict inline. ``start(x)`` predicts layer 0 from the step's input.

    >>> calls = []
    >>> look = Lookahead(lambda i, x: calls.append((i, x)), n_layers=2, side=None)
    >>> look.start("x0"); look.before(0, "x0"); look.after(); look.before(1, "x1"); look.after()
    >>> calls  # layer 0 from the step's input, layer 1 from layer 0's: the last predicts nothing
    [(0, 'x0'), (1, 'x0')]
    """

    def __init__(self, predict: Callable, n_layers: int, side: torch.cuda.Stream | None):
        self.predict, self.n, self.side = predict, n_layers, side
        self.keep: list = []  # inputs read on the side stream stay allocated until the step ends

    def start(self, x: torch.Tensor) -> None:
        self.predict(0, x)

    def before(self, i: int, x: torch.Tensor) -> None:
        """Launch layer i + 1's prediction from layer i's input x."""
        if i + 1 >= self.n:
            return
        if self.side is None:
            self.predict(i + 1, x)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.predict(i + 1, x)
        self.keep.append(x)

    def after(self) -> None:
        """Join the side stream: the next layer reads the sets it wrote."""
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
