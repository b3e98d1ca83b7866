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

Training (§4.1): BCE with each output's positives weighted by its negative/positive ratio,
Adam, early stopping on validation recall at the budget. Evaluation per layer (:func:`evaluate`):
recall and precision of the oracle's set at the budget, the share of activation mass the
predicted set keeps, and the predictor's cost in parameters and FLOPs beside its block
(:func:`cost`). Files: safetensors with the model fingerprint in the metadata; loading them for
another model, or a truncated file, is a :class:`PredictorError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from . import atomic
from .arch import Arch, get_arch
from .budgets import budgets, head_gram, head_output_norms, n_keep, topk_mask
from .checks import configs as check_configs
from .checks import files as check_files
from .checks import tokens as check_tokens
from .collect import Collection, fingerprint, fingerprint_id, note_stale
from .errors import PredictorError
from .hooks import hooks

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


# ---------------------------------------------------------------------------------------------
# training


def _recall_at_k(scores: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Share of the labelled-active units that the top-k scores recover, over all tokens."""
    hit = (topk_mask(scores, k) & labels).sum().item()
    return hit / max(labels.sum().item(), 1)


def _fit(
    x: torch.Tensor, y: torch.Tensor, net: LowRank, k: int, cfg: PredictorConfig, n_val: int
) -> dict:
    """Train ``net`` on x [N, d] -> y bool [N, n]; keep the state with the best val recall."""
    xt, yt, xv, yv = x[:-n_val], y[:-n_val], x[-n_val:], y[-n_val:]
    pos = yt.float().mean(0).clamp(1e-4, 1 - 1e-4)
    pos_weight = ((1 - pos) / pos).clamp(max=cfg.max_pos_weight)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed)
    best, best_state, bad, epochs = -1.0, None, 0, 0
    for _ in range(cfg.epochs):
        epochs += 1
        net.train()
        for idx in torch.randperm(len(xt), generator=g).split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(xt[idx]), yt[idx].float())
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            rec = _recall_at_k(net(xv), yv, k)
        if rec > best + 1e-4:
            best, bad = rec, 0
            best_state = {n: p.detach().clone() for n, p in net.state_dict().items()}
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    net.load_state_dict(best_state)
    return {"epochs": epochs, "val_recall": best}


def train_predictors(
    collection: Collection | str | os.PathLike,
    config: PredictorConfig = PredictorConfig(),
    *,
    progress: bool = True,
) -> Predictors:
    """Train every layer's MLP and head predictor on a collection (:func:`collect.collect`, or
    the path of its folder).

    >>> import tempfile
    >>> from dejavu_lab.collect import CollectConfig, collect
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> col = collect(m.model, None, CollectConfig(window=8, max_tokens=32), tempfile.mkdtemp(),
    ...               windows=torch.randint(0, 128, (4, 8)), progress=False)
    >>> pred = train_predictors(col, PredictorConfig(mlp_rank=8, epochs=2), progress=False)
    >>> [(h["layer"], h["kind"], h["epochs"]) for h in pred.history]
    [(0, 'mlp', 2), (0, 'heads', 2), (1, 'mlp', 2), (1, 'heads', 2)]
    """
    if isinstance(collection, str | os.PathLike):
        from .collect import open_collection

        collection = open_collection(collection)
    if not isinstance(collection, Collection):
        raise PredictorError(
            f"train_predictors needs a Collection or its folder, got a "
            f"{type(collection).__name__}; pass what collect(...) or open_collection(path) "
            "returns, or the folder's path."
        )
    if not isinstance(config, PredictorConfig):
        raise PredictorError(
            f"config must be a PredictorConfig, got a {type(config).__name__}; pass "
            "PredictorConfig(...) (a dict d: PredictorConfig(**d))."
        )
    fp = collection.manifest["fingerprint"]
    threads = torch.get_num_threads()
    # these networks are small: one thread avoids OpenMP barrier stalls on busy machines
    # (measured 25x faster per epoch than two threads on a loaded 2-core box)
    torch.set_num_threads(1)
    try:
        return _train(collection, config, fp, progress)
    finally:
        torch.set_num_threads(threads)


def _train(collection: Collection, config: PredictorConfig, fp: dict, progress: bool):
    torch.manual_seed(config.seed)
    pred = Predictors(fp, config)
    pred.collection = {
        "key": collection.key(),
        "config": collection.manifest["config"],
        "path": str(collection.path),
    }
    n_tokens = collection.n_tokens
    n_val = max(1, int(n_tokens * config.val_fraction))
    if n_tokens - n_val < 1:
        raise PredictorError(
            f"The collection has {n_tokens} tokens and val_fraction={config.val_fraction} holds "
            f"out {n_val}, leaving none to train on; collect more tokens or lower val_fraction."
        )
    k_mlp = n_keep(config.mlp_sparsity, fp["d_mlp"])
    k_head = n_keep(config.head_sparsity, fp["n_heads"])
    relu = not fp["gated"]
    label_s = collection.manifest["config"]["mlp_label_sparsity"]
    prev_pre = None
    bar = tqdm(range(fp["n_layers"]), desc=f"train ({config.mode})", disable=not progress)
    for i in bar:
        t0 = time.perf_counter()
        data = collection.layer(i)
        pre = data["pre"].float()
        if config.mode == "lookahead":
            x_heads = x_mlp = pre if prev_pre is None else prev_pre
        else:
            x_heads, x_mlp = pre, data["mid"].float()
        head_labels = topk_mask(data["head"].float(), k_head)
        # gated MLPs: labels were taken at mlp_label_sparsity; recall is measured on them
        k_eval = k_mlp if relu else max(k_mlp, n_keep(label_s, fp["d_mlp"]))
        rm = _fit(x_mlp, data["mlp"], pred.mlp[i], k_eval, config, n_val)
        rh = _fit(x_heads, head_labels, pred.heads[i], k_head, config, n_val)
        pred.history += [
            {"layer": i, "kind": "mlp", **rm, "seconds": None},
            {"layer": i, "kind": "heads", **rh, "seconds": round(time.perf_counter() - t0, 2)},
        ]
        prev_pre = pre
        bar.set_postfix(mlp=f"{rm['val_recall']:.2f}", heads=f"{rh['val_recall']:.2f}")
    return pred.eval()


# ---------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(
    model,
    windows: torch.Tensor,
    predictors: Predictors | list[Predictors],
    *,
    mlp_sparsity: float = 0.5,
    head_sparsity: float = 0.3,
    arch: Arch | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Per-layer quality of the predicted sets on held-out ``windows`` [n, window].

    The model runs dense; at every layer the predicted top-k set is compared with the oracle's
    (top-k by true ``|activation|`` or head output norm; for ReLU MLPs, only neurons that are > 0
    count as oracle-active). Columns: mode, layer, kind, recall, precision, mass_kept (share of
    ``sum |act|`` in the predicted set), oracle_mass (the same for the oracle set).

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> pred = Predictors(fingerprint(m.model), PredictorConfig())  # untrained, for the shape
    >>> df = evaluate(m.model, torch.randint(0, 128, (2, 8)), pred, progress=False)
    >>> df[["mode", "layer", "kind", "sparsity"]]
            mode  layer   kind  sparsity
    0  lookahead      0  heads       0.3
    1  lookahead      1  heads       0.3
    2  lookahead      0    mlp       0.5
    3  lookahead      1    mlp       0.5
    """
    arch = arch or get_arch(model)
    windows = check_tokens.windows(windows, model)
    preds = predictors if isinstance(predictors, list) else [predictors]
    for p in preds:
        if not isinstance(p, Predictors):
            raise PredictorError(
                f"predictors must be Predictors, got a {type(p).__name__}; load a file with "
                "load_predictors(path) or train them with train_predictors(collection)."
            )
        p.check_model(model, arch)
    ms = budgets(mlp_sparsity, 1, "mlp_sparsity")[0]
    hs = budgets(head_sparsity, 1, "head_sparsity")[0]
    k_mlp, k_head = n_keep(ms, arch.d_mlp), n_keep(hs, arch.n_heads)
    relu = not arch.gated and arch.activation == "relu"
    grams = [head_gram(model, arch, i) for i in range(arch.n_layers)]
    sums: dict[tuple, list[float]] = {}  # (mode, layer, kind) -> [hit, n_oracle, n_pred, m, om]
    seen: dict[str, torch.Tensor] = {}

    def acc(key, mag: torch.Tensor, scores: torch.Tensor, k: int, exact_zero: bool):
        oracle = topk_mask(mag, k)
        if exact_zero:
            oracle &= mag > 0
        pred = topk_mask(scores, k)
        total = mag.sum(-1).clamp_min(1e-12)
        s = sums.setdefault(key, [0.0] * 5)
        s[0] += (pred & oracle).sum().item()
        s[1] += oracle.sum().item()
        s[2] += pred.sum().item()
        s[3] += ((mag * pred).sum(-1) / total).sum().item()
        s[4] += ((mag * oracle).sum(-1) / total).sum().item()
        s.append(mag.shape[0])

    def x_for(p: Predictors, i: int, kind: str) -> torch.Tensor:
        if p.mode == "lookahead":
            return seen[f"pre{max(i - 1, 0)}"]
        return seen[f"pre{i}"] if kind == "heads" else seen[f"mid{i}"]

    def on(t: torch.Tensor, name: str) -> None:
        _, i, point = name.split(".", 2)
        i = int(i)
        if point == "hook_resid_pre":
            seen[f"pre{i}"] = t.flatten(0, -2)
        elif point == "hook_resid_mid":
            seen[f"mid{i}"] = t.flatten(0, -2)
        elif point == "mlp.hook_post":
            mag = t.flatten(0, -2).abs().float()
            for p in preds:
                acc((p.mode, i, "mlp"), mag, p.mlp_scores(i, x_for(p, i, "mlp")), k_mlp, relu)
        else:
            mag = head_output_norms(t.flatten(0, 1), grams[i].to(t.device))
            for p in preds:
                sc = p.head_scores(i, x_for(p, i, "heads"))
                acc((p.mode, i, "heads"), mag, sc, k_head, False)

    device = next(model.parameters()).device
    points = ["hook_resid_pre", "hook_resid_mid", "mlp.hook_post", "attn.hook_z"]
    with hooks(model, [(f"blocks.*.{p}", on) for p in points], arch):
        for w in tqdm(windows, desc="evaluate", disable=not progress, leave=False):
            model(input_ids=w[None].to(device))
    rows = []
    for (mode, i, kind), s in sums.items():
        n_tok = sum(s[5:])
        rows.append(
            {
                "mode": mode,
                "layer": i,
                "kind": kind,
                "sparsity": ms if kind == "mlp" else hs,
                "recall": s[0] / max(s[1], 1),
                "precision": s[0] / max(s[2], 1),
                "mass_kept": s[3] / n_tok,
                "oracle_mass": s[4] / n_tok,
            }
        )
    return pd.DataFrame(rows).sort_values(["mode", "kind", "layer"]).reset_index(drop=True)


def cost(predictors: Predictors, arch: Arch) -> pd.DataFrame:
    """Parameters and FLOPs per token of each predictor beside the block it gates (dense).

    >>> from dejavu_lab.collect import fingerprint
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> pred = Predictors(fingerprint(m.model), PredictorConfig(mlp_rank=8, head_rank=4))
    >>> cost(pred, m.arch)[["layer", "kind", "predictor_params", "block_params"]].head(2)
       layer   kind  predictor_params  block_params
    0      0    mlp              2240         36864
    1      0  heads               276         12288
    """
    d, n, h, kv, dh = arch.d_model, arch.d_mlp, arch.n_heads, arch.n_kv_heads, arch.d_head
    mlp_block = d * n * (3 if arch.gated else 2)
    attn_block = 2 * d * h * dh + 2 * d * kv * dh
    rows = []
    for i in range(arch.n_layers):
        for kind, net, block in (
            ("mlp", predictors.mlp[i], mlp_block),
            ("heads", predictors.heads[i], attn_block),
        ):
            rows.append(
                {
                    "layer": i,
                    "kind": kind,
                    "predictor_params": net.n_params(),
                    "block_params": block,
                    "param_ratio": net.n_params() / block,
                    "predictor_flops": net.flops(),
                    "block_flops": 2 * block,
                    "flop_ratio": net.flops() / (2 * block),
                }
            )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# cached end to end


def default_path(fp: dict, collect_config, config: PredictorConfig) -> Path:
    """The cache file :func:`get_or_train` uses for these configs (nothing is created).

    ``collect_config`` is the :class:`~dejavu_lab.collect.CollectConfig` collected with, or the
    :class:`~dejavu_lab.collect.Collection` itself: the name holds its key, so predictors
    trained on one collection are never found under another's name.

    >>> from dejavu_lab.collect import CollectConfig, fingerprint
    >>> from dejavu_lab.models import random_model
    >>> fp = fingerprint(random_model("tiny-llama").model)
    >>> default_path(fp, CollectConfig(), PredictorConfig(mode="same")).name
    'llama-L2-d64-...-same.safetensors'
    """
    from .assets import cache_dir

    name = f"{fingerprint_id(fp)}-{collect_config.key()}-{config.key()}-{config.mode}.safetensors"
    return cache_dir() / "predictors" / name


def get_or_train(
    model,
    tokenizer,
    config: PredictorConfig = PredictorConfig(),
    collect_config=None,
    *,
    arch: Arch | None = None,
    progress: bool = True,
) -> Predictors:
    """Cached predictors for ``model``: load them, or collect (resumably) and train them once.

    The cache key is the model fingerprint plus both configs, under
    :func:`dejavu_lab.assets.cache_dir`; ``info["seconds"]`` on the result says what this
    call spent (0 when it loaded).

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from dejavu_lab.collect import CollectConfig
    >>> from dejavu_lab.models import load_model
    >>> model, tok, _ = load_model("demo")
    >>> cfgs = PredictorConfig(epochs=1, mlp_rank=8), CollectConfig(window=8, max_tokens=8)
    >>> with mock.patch.dict(os.environ, DEJAVU_LAB_CACHE=tempfile.mkdtemp()):  # not ~/.cache
    ...     runs = [get_or_train(model, tok, *cfgs, progress=False) for _ in range(2)]
    >>> [p.info["trained_now"] for p in runs]  # trained once, then loaded
    [True, False]
    """
    from .collect import CollectConfig

    collect_config = collect_config or CollectConfig()
    arch = arch or get_arch(model)
    fp = fingerprint(model, arch)
    path = default_path(fp, collect_config, config)
    t0 = time.perf_counter()
    if (pred := _cached(path, collect_config, model, arch)) is not None:
        return pred
    note_stale(path, fp, "predictors")
    lock = path.with_name(f".{path.name}.lock")
    with atomic.locked(lock, what="training these predictors", hint=_HINT):
        if (pred := _cached(path, collect_config, model, arch)) is not None:
            return pred  # another process trained them while we waited
        return _collect_and_train(
            model, tokenizer, config, collect_config, arch, path, t0, progress
        )


_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space"


def _cached(path: Path, collect_config, model, arch) -> Predictors | None:
    """The cache entry at ``path`` if it holds predictors trained on ``collect_config``."""
    if not path.exists():
        return None
    pred = load_predictors(path, model, arch)
    if pred.collection.get("key") != collect_config.key():
        return None  # written under a wrong key (older versions): train again and replace it
    pred.info = {"path": str(path), "trained_now": False, "collect_s": 0.0, "train_s": 0.0}
    return pred


def _collect_and_train(model, tokenizer, config, collect_config, arch, path, t0, progress):
    from .collect import collect

    col = collect(model, tokenizer, collect_config, arch=arch, progress=progress)
    t1 = time.perf_counter()
    pred = train_predictors(col, config, progress=progress)
    t2 = time.perf_counter()
    pred.save(path)
    pred.info = {
        "path": str(path),
        "trained_now": True,
        "collect_s": round(t1 - t0, 1),
        "train_s": round(t2 - t1, 1),
    }
    return pred
