"""DejaVu's sparsity predictors: low-rank two-layer classifiers per layer (§4.1–4.3).

For every layer ``l`` two small networks score the units of the block from a hidden state:
``SP_M^l: d → r → n_neurons`` and ``SP_A^l: d → r → n_heads`` (DejaVu's ``Linear(d, r)`` then
``Linear(r, n)``; we RMS-normalise the input first, so one learning rate fits every layer).
At inference the top-k scores at the budget are the kept set (:mod:`dejavu_lab.sparsify`).

Two modes (§4.3):

- ``"same"`` — heads of layer ``l`` from its input ``resid_pre[l]``, neurons from the MLP input
  ``resid_mid[l]``: the most informed choice, but on the critical path.
- ``"lookahead"`` — both from the previous layer's input ``resid_pre[l-1]`` (layer 0 uses its
  own input), so the prediction can run while layer ``l-1`` computes; it works because hidden
  states change slowly across layers (§3.3, §4.3).

One module each; every name below is importable from ``dejavu_lab.predictors``:

- :mod:`~dejavu_lab.predictors.model` — :class:`~dejavu_lab.predictors.model.PredictorConfig`,
  the networks (:class:`~dejavu_lab.predictors.model.LowRank`,
  :class:`~dejavu_lab.predictors.model.Predictors`) and their files
  (:func:`~dejavu_lab.predictors.model.load_predictors`);
- :mod:`~dejavu_lab.predictors.train` — :func:`~dejavu_lab.predictors.train.train_predictors`
  on a collection (§4.1);
- :mod:`~dejavu_lab.predictors.quality` — :func:`~dejavu_lab.predictors.quality.evaluate`
  (recall, precision and activation mass kept, per layer) and
  :func:`~dejavu_lab.predictors.quality.cost` (parameters and FLOPs beside each block);
- :mod:`~dejavu_lab.predictors.cache` — :func:`~dejavu_lab.predictors.cache.get_or_train`:
  collected and trained once per model and configs, then loaded.
"""

from ..errors import PredictorError
from .cache import default_path, get_or_train
from .model import MODES, LowRank, PredictorConfig, Predictors, load_predictors
from .quality import cost, evaluate
from .train import train_predictors

__all__ = [
    "default_path",
    "get_or_train",
    "MODES",
    "LowRank",
    "PredictorConfig",
    "PredictorError",
    "Predictors",
    "cost",
    "evaluate",
    "load_predictors",
    "train_predictors",
]
