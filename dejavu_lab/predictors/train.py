"""Training DejaVu's predictors on a collection (§4.1): :func:`train_predictors`.

Every layer's MLP and head predictor is fitted on the hidden states and labels of a
:class:`~dejavu_lab.collect.Collection`: BCE with each output's positives weighted by its
negative/positive ratio, Adam, early stopping on validation recall at the budget.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..budgets import n_keep, topk_mask
from ..collect import Collection
from ..errors import PredictorError
from .model import LowRank, PredictorConfig, Predictors

__all__ = ["train_predictors"]


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
        from ..collect import open_collection

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
