"""The predictors themselves: their config, their networks and their files.

:class:`PredictorConfig` says how to build and train them (every field enters the cache key);
:class:`LowRank` is one predictor (RMS-normalise, then ``d → r → n``, as DejaVu's
``Linear(d, r)`` then ``Linear(r, n)``); :class:`Predictors` holds one MLP and one head
predictor per layer for one model and mode. Files: safetensors with the model fingerprint in the
metadata (:meth:`Predictors.save`, :func:`load_predictors`); loading them for another model, or a
truncated file, is a :class:`PredictorError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .. import atomic
from ..arch import Arch
from ..checks import configs as check_configs
from ..checks import files as check_files
from ..collect import fingerprint, fingerprint_id
from ..errors import PredictorError

__all__ = ["MODES", "LowRank", "PredictorConfig", "Predictors", "load_predictors"]

MODES = ("same", "lookahead")


@dataclass(frozen=True)
class PredictorConfig:
    """How to build and train the predictors. Every field enters the cache key.

    >>> cfg = PredictorConfig(mode="same", mlp_rank=8)
    >>> cfg.head_rank, cfg.mlp_sparsity, cfg.key()
    (32, 0.5, '...')
    """

    mode: str = "lookahead"  # "same" (layer input) or "lookahead" (previous layer's input)
    mlp_rank: int = 64  # r of the MLP predictor d → r → n (DejaVu: 1000 at d = 12288)
    head_rank: int = 32  # r of the head predictor d → r → h
    mlp_sparsity: float = 0.5  # budget used for early stopping and reported recall
    head_sparsity: float = 0.3
    epochs: int = 8  # at most
    patience: int = 2  # epochs without a better validation recall before stopping
    batch_size: int = 512
    lr: float = 3e-3  # Adam
    val_fraction: float = 0.1  # last share of the collected tokens held out
    max_pos_weight: float = 50.0  # cap on the class weight of rare positives
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise PredictorError(
                f"mode must be 'same' or 'lookahead', got {self.mode!r}; pass one of them "
                "(lookahead predicts from the previous layer, so it can run ahead)."
            )
        check_configs.predictor_config(self)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


class LowRank(nn.Module):
    """RMS-normalise, then d → r → n (no nonlinearity in between, as DejaVu).

    >>> net = LowRank(64, 8, 192)  # d = 64, rank 8, 192 neurons
    >>> net(torch.randn(5, 64)).shape
    torch.Size([5, 192])
    >>> net.n_params(), net.flops()  # 64·8 + 8·192 + 192 bias; 2 FLOPs per weight
    (2240, 4096)
    """

    def __init__(self, d: int, r: int, n: int):
        super().__init__()
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, n, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., d] -> scores [..., n]
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.up(self.down(x))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops(self) -> int:  # per token, multiply-add = 2
        return 2 * (self.down.in_features * self.down.out_features + self.up.weight.numel())


class Predictors(nn.Module):
    """One MLP and one head predictor per layer, for one model (``fingerprint``) and mode.

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> pred = Predictors(fingerprint(random_model("tiny-llama").model), PredictorConfig())
    >>> len(pred.mlp), pred.mode
    (2, 'lookahead')
    >>> pred.head_scores(0, torch.randn(3, 64)).shape  # 3 tokens, 4 heads
    torch.Size([3, 4])
    """

    def __init__(self, fp: dict, config: PredictorConfig, history: list | None = None):
        super().__init__()
        self.fingerprint = fp
        self.config = config
        self.mode = config.mode
        d, n, h = fp["d_model"], fp["d_mlp"], fp["n_heads"]
        self.mlp = nn.ModuleList(LowRank(d, config.mlp_rank, n) for _ in range(fp["n_layers"]))
        self.heads = nn.ModuleList(LowRank(d, config.head_rank, h) for _ in range(fp["n_layers"]))
        self.history = history or []  # per layer and kind: epochs, best val recall, seconds
        self.info: dict = {}  # how this object was obtained (see get_or_train)
        self.collection: dict = {}  # what they were trained on: {"key", "config", "path"}

    @torch.no_grad()
    def mlp_scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.mlp[layer].to(x.device)(x)

    @torch.no_grad()
    def head_scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.heads[layer].to(x.device)(x)

    def check_model(self, model, arch: Arch | None = None) -> None:
        if check_files.older_fingerprint(self.fingerprint):
            raise PredictorError(
                "These predictors carry the older model fingerprint, which saw 8 rows of 3 "
                "weight matrices only and cannot tell this model from another of its shape; "
                "train them again with `dejavu-lab train-predictors`."
            )
        fp = fingerprint(model, arch)
        if fp != self.fingerprint:
            diff = [k for k in fp if fp[k] != self.fingerprint.get(k)]
            raise PredictorError(
                f"These predictors were trained for another model ({fingerprint_id(self.fingerprint)}"
                f", this one is {fingerprint_id(fp)}; differs in {', '.join(diff)}); train "
                "predictors for this model with `dejavu-lab train-predictors`."
            )

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file atomically (a kill leaves the old file or the new one).

        >>> import tempfile
        >>> from dejavu_lab.collect import fingerprint
        >>> from dejavu_lab.models import random_model
        >>> pred = Predictors(fingerprint(random_model("tiny-llama").model), PredictorConfig())
        >>> pred.save(f"{tempfile.mkdtemp()}/p.safetensors").name
        'p.safetensors'
        """
        path = Path(path)
        meta = {
            "format": "dejavu-lab-predictors/1",
            "fingerprint": json.dumps(self.fingerprint),
            "config": json.dumps(asdict(self.config)),
            "history": json.dumps(self.history),
            "collection": json.dumps(self.collection),
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        hint = "pass another --out path, or set DEJAVU_LAB_CACHE to a folder on another disk"
        return atomic.save_tensors(path, tensors, meta, hint=hint)


def load_predictors(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Predictors:
    """Load predictors saved by :meth:`Predictors.save`; with ``model``, check they match it.

    >>> import tempfile
    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> path = Predictors(fingerprint(m.model), PredictorConfig(mlp_rank=8)).save(
    ...     f"{tempfile.mkdtemp()}/p.safetensors")
    >>> load_predictors(path, m.model).config.mlp_rank
    8
    >>> load_predictors(path, random_model("tiny-llama", seed=1).model)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.PredictorError: These predictors were trained for another model ...
    """
    path = Path(path)
    if not path.exists():
        raise PredictorError(
            f"No predictor file at {path}; train with `dejavu-lab train-predictors`."
        )
    if path.is_dir():
        raise PredictorError(
            f"{path} is a folder; pass one of its predictor files (*.safetensors) instead."
        )
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise PredictorError(
            f"{path} is not a readable safetensors file ({str(e).splitlines()[0][:80]}); it is "
            "truncated or damaged: train the predictors again."
        ) from None
    if meta.get("format") != "dejavu-lab-predictors/1":
        raise PredictorError(
            f"{path} is a safetensors file but not dejavu-lab predictors; pass a file written by "
            "`dejavu-lab train-predictors`."
        )
    fp = check_files.metadata_json(meta, "fingerprint", path, PredictorError)
    cfg_dict = check_files.metadata_json(meta, "config", path, PredictorError)
    history = check_files.metadata_json(meta, "history", path, PredictorError, list)
    if any(
        not isinstance(fp.get(k), int) or fp[k] < 1
        for k in ("n_layers", "d_model", "d_mlp", "n_heads")
    ):
        raise PredictorError(
            f"{path} has an incomplete model fingerprint; train the predictors again."
        )
    known = {f.name for f in fields(PredictorConfig)}
    try:
        config = PredictorConfig(**{k: v for k, v in cfg_dict.items() if k in known})
    except PredictorError as e:
        raise PredictorError(
            f"{path} holds a bad config ({e}); train the predictors again."
        ) from None
    pred = Predictors(fp, config, history)
    check_files.state_matches(pred.state_dict(), tensors, path, PredictorError)
    check_files.finite(tensors, path, PredictorError)
    pred.load_state_dict(tensors)
    if "collection" in meta:
        pred.collection = check_files.metadata_json(meta, "collection", path, PredictorError)
    if model is not None:
        pred.check_model(model, arch)
    return pred.eval()
