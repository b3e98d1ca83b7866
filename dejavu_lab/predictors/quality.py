"""How good and how costly the predictors are, per layer: :func:`evaluate` and :func:`cost`.

Evaluation per layer (:func:`evaluate`): recall and precision of the oracle's set at the
budget, the share of activation mass the predicted set keeps, and the predictor's cost in
parameters and FLOPs beside its block (:func:`cost`).
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..arch import Arch, get_arch
from ..budgets import budgets, head_gram, head_output_norms, n_keep, topk_mask
from ..checks import tokens as check_tokens
from ..errors import PredictorError
from ..hooks import hooks
from .model import Predictors

__all__ = ["cost", "evaluate"]


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
    >>> from dejavu_lab.predictors import PredictorConfig
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
    >>> from dejavu_lab.predictors import PredictorConfig
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
