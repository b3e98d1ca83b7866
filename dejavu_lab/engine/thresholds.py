"""Thresholds for a target sparsity from one dense prefill's activations (TEAL §3, WINA, CATS §3).

The methods helper calibrates thresholds on real text (:mod:`dejavu_lab.sparsify`, streamed
quantile sketches, cached). Speed benchmarks run random-weight models at real shapes, where
only the *fraction* of columns each step reads matters; :func:`calibrate_thresholds` gets it
from the activations of one dense prefill of the prompt (its last eighth of positions, those
the decode steps resemble), per layer and site:

- TEAL: ``thr = q_s(|x|)`` over every token and entry of the site (one number per site);
- WINA: ``t = q_s(|x_i| * ||W[:, i]||)`` and ``thr_i = t / ||W[:, i]||`` (the site's
  concatenated weight: ``[Wq; Wk; Wv]``, ``W_O``, ``[W_gate; W_up]`` or ``fc1``, ``W_down``;
  where ``t = 0``, the number 0);
- CATS: ``thr = q_s(|act(gate)|)`` per layer (``|relu(fc1 x)|`` for ReLU OPT), one number.

The result is the dict :class:`~dejavu_lab.engine.SparseConfig` takes: a float per site for
TEAL and CATS, fp32 [d_in] for WINA (one number where it is 0 for every column).
"""

from __future__ import annotations

import torch

from ..vocab import METHODS
from .config import SITES, EngineError
from .decoder import Decoder
from .weights import DecoderWeights, decoder_weights

__all__ = ["calibrate_thresholds", "column_norms", "keep_all"]

_MAX_SAMPLE = 1 << 24  # torch.quantile's input limit; larger sites are subsampled


def column_norms(w: DecoderWeights, layer: int, site: str) -> torch.Tensor:
    """``||W[:, i]||_2`` of the site's weight, per input column i (fp32), either layout.

    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama").model)
    >>> [tuple(column_norms(w, 0, s).shape) for s in ("attn_in", "o_in", "mlp_in", "down_in")]
    [(64,), (64,), (64,), (192,)]
    """
    lw = w.layers[layer]
    if site == "attn_in":
        return (
            lw.w_qkv.float().norm(dim=0) if lw.w_qkv is not None else lw.w_qkv_t.float().norm(dim=1)
        )
    if site == "mlp_in":
        return lw.w_in.float().norm(dim=0) if lw.w_in is not None else lw.w_in_t.float().norm(dim=1)
    if site == "o_in":
        return lw.w_o_t.float().norm(dim=1)
    if site == "down_in":
        return lw.w_down_t.float().norm(dim=1)
    raise EngineError(f"site {site!r} has no weight columns; use attn_in, o_in, mlp_in, down_in.")


def keep_all(model_or_weights, method: str = "teal") -> dict:
    """Thresholds that keep every column (-1 at every site): the method's path, all kept.

    >>> from dejavu_lab.models import random_model
    >>> thr = keep_all(random_model("tiny-opt").model, "cats")
    >>> sorted(thr)[:2], thr[(0, "gate")]
    ([(0, 'gate'), (1, 'gate')], -1.0)
    """
    w = _weights(model_or_weights)
    return {(i, s): -1.0 for i in range(w.arch.n_layers) for s in _sites(method)}


def calibrate_thresholds(model_or_weights, ids: torch.Tensor, sparsity: float, *,
                         method: str = "teal", sites=None, seed: int = 0) -> dict:  # fmt: skip
    """``{(layer, site): threshold}`` that drop a fraction ``sparsity`` of each site's entries
    (scores, for WINA) at the last ``S // 8`` positions of the dense prefill of ``ids`` [1, S]
    (at least one): a float (TEAL, CATS) or fp32
    [d_in] (WINA; see module doc).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    >>> thr = calibrate_thresholds(m, ids, 0.5, method="teal")
    >>> len(thr), type(thr[(0, "attn_in")]).__name__  # 2 layers x 4 sites; one number each
    (8, 'float')
    >>> tuple(calibrate_thresholds(m, ids, 0.5, method="wina")[(0, "attn_in")].shape)  # per column
    (64,)
    >>> from dejavu_lab.engine import Decoder, SparseConfig
    >>> dec = Decoder(m, max_seq_len=48, sparse=SparseConfig(method="teal", thresholds=thr))
    >>> dec.generate(ids, 4).shape
    torch.Size([1, 36])
    """
    if not 0 <= sparsity < 1:
        raise EngineError(f"sparsity={sparsity} must lie in [0, 1) (the fraction removed).")
    wanted = set(sites or _sites(method))
    if wanted - set(SITES[method]):
        raise EngineError(
            f"method {method!r} thresholds the sites {', '.join(SITES[method])}; "
            f"got {sorted(wanted - set(SITES[method]))}."
        )
    w = _weights(model_or_weights)
    ids = ids.reshape(-1)
    g = torch.Generator(device="cpu").manual_seed(seed)
    out: dict = {}

    last = max(1, ids.numel() // 8)

    def tap(i, site, x):  # x [S, n] at layer i's site, during the prefill
        if site not in wanted:
            return
        # the last eighth of the positions: the decode steps that follow resemble them, while
        # an early position's attention output averages few values and is larger (over the
        # whole prefill, W_O's input kept 0.31-0.35 of its entries at later positions for 0.5
        # asked; over the last eighth 0.45-0.48), the other sites do not drift with position
        a = x[-last:].detach().float().abs()
        norms = column_norms(w, i, site) if METHODS[method].score == "weighted" else None
        t = _quantile((a * norms if norms is not None else a).flatten(), sparsity, g)
        # WINA's t / ||W[:, i]|| is one number where t = 0 (a ReLU MLP's down_in at 50%: most
        # entries are zero): every column's threshold is 0
        per_column = norms is not None and t != 0
        out[(i, site)] = (t / norms.clamp_min(1e-12)).contiguous() if per_column else t

    dense = Decoder(w, max_seq_len=ids.numel() + 1)
    dense._taps = tap
    with torch.no_grad():
        dense.prefill(ids)
    return out


def _quantile(v: torch.Tensor, q: float, g: torch.Generator) -> float:
    if v.numel() > _MAX_SAMPLE:
        v = v[torch.randperm(v.numel(), generator=g)[:_MAX_SAMPLE].to(v.device)]
    return float(torch.quantile(v, q)) if q > 0 else -1.0


def _sites(method: str) -> tuple[str, ...]:
    if method not in SITES:
        raise EngineError(f"method {method!r} has no thresholds; use one of {', '.join(SITES)}.")
    return SITES[method]


def _weights(model_or_weights) -> DecoderWeights:
    if isinstance(model_or_weights, DecoderWeights):
        return model_or_weights
    if isinstance(model_or_weights, Decoder):
        return model_or_weights.w
    return decoder_weights(model_or_weights)
