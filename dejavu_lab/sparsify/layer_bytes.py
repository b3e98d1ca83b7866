"""Bytes per token: which weight columns and rows a sparse decoder layer reads.

Methods sparsify different matrices, so they are compared at equal *bytes*, not only at equal
"sparsity". At batch size 1 a decoding step reads, per decoder layer,

==========  =========================================  ==================================
site        what a kept unit reads                     elements at full keep
==========  =========================================  ==================================
attn_in     a column of W_Q, W_K and W_V (TEAL, WINA)  d · (h·dh + 2·kv·dh)
o_in        a column of W_O                            h·dh · d
mlp_in      a column of W_gate and W_up (or W1)        (1 or 2) · n · d
down_in     a column of W_down (W2)                    n · d
gate        CATS: a row of W_up and column of W_down   2 · n · d (ReLU MLPs: n · d)
            (W_gate is always read in full)
mlp         a neuron: rows of W_gate/W_up, col of W2   (2 or 3) · n · d
heads       a query head: rows of W_Q, cols of W_O     2 · h·dh · d
kv          a key/value head: rows of W_K and W_V      2 · kv·dh · d
==========  =========================================  ==================================

The fraction read is ``Σ_layers (dense − Σ_sites elements · (1 − kept)) / (layers · dense)``
with ``kept`` the share of units each site kept, averaged over the evaluated tokens (a
threshold keeps a different number per token; bytes are linear in that number). Norms and
biases are left out (under 0.1% of a layer); the embedding, unembedding and KV cache are not
decoder-layer weights (:mod:`dejavu_lab.bytes_model` counts those for speed predictions).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..arch import Arch

__all__ = ["Kept", "bytes_per_token_fraction", "layer_elements", "site_elements"]


class Kept:
    """Running counts of kept units per (layer, site), filled by the sparsity hooks.

    ``per_token=True`` also keeps each token's kept fraction (a threshold keeps a different
    number of entries for every token; :meth:`per_token` tabulates them).

    >>> k = Kept(per_token=True)
    >>> k.add(0, "mlp_in", torch.tensor([[True, False], [True, True]]))  # 2 tokens
    >>> k.fractions(), k.by_site()
    ({(0, 'mlp_in'): 0.75}, {'mlp_in': 0.75})
    >>> k.per_token()["kept"].tolist()
    [0.5, 1.0]
    """

    def __init__(self, per_token: bool = False):
        self.counts: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.tokens: dict[tuple[int, str], list[torch.Tensor]] | None = (
            defaultdict(list) if per_token else None
        )

    def add(self, layer: int, site: str, keep: torch.Tensor) -> None:
        """Count a bool mask [..., units] of what one site kept for a batch of tokens."""
        c = self.counts[(layer, site)]
        c[0] += float(keep.sum())
        c[1] += keep.numel()
        if self.tokens is not None:
            self.tokens[(layer, site)].append(keep.float().mean(-1).flatten().cpu())

    def per_token(self):
        """A pandas table: layer, site, token (in order seen), kept fraction."""
        import pandas as pd

        rows = []
        for (layer, site), parts in sorted((self.tokens or {}).items()):
            for j, f in enumerate(torch.cat(parts).tolist()):
                rows.append({"layer": layer, "site": site, "token": j, "kept": f})
        return pd.DataFrame(rows, columns=["layer", "site", "token", "kept"])

    def fractions(self) -> dict[tuple[int, str], float]:
        """(layer, site) -> kept fraction over everything seen."""
        return {k: c[0] / c[1] for k, c in sorted(self.counts.items()) if c[1]}

    def by_site(self) -> dict[str, float]:
        """site -> kept fraction averaged over the layers where the site ran sparse."""
        out: dict[str, list[float]] = defaultdict(list)
        for (_, site), f in self.fractions().items():
            out[site].append(f)
        return {s: round(sum(v) / len(v), 6) for s, v in sorted(out.items())}


def site_elements(arch: Arch) -> dict[str, int]:
    """Weight elements a layer reads for each site at full keep (the table above).

    >>> from dejavu_lab.models import random_model
    >>> site_elements(random_model("tiny-llama").arch)["attn_in"]  # 64 · (64 + 2·32)
    8192
    """
    d, n, dh = arch.d_model, arch.d_mlp, arch.d_head
    q, kv = arch.n_heads * dh, arch.n_kv_heads * dh
    n_in = 2 if arch.gated else 1
    return {
        "attn_in": d * (q + 2 * kv),
        "o_in": q * d,
        "mlp_in": n_in * n * d,
        "down_in": n * d,
        "gate": 2 * n * d if arch.gated else n * d,  # W_up rows + W_down cols, or W2 cols
        "mlp": (n_in + 1) * n * d,
        "heads": 2 * q * d,
        "kv": 2 * kv * d,
    }


def layer_elements(arch: Arch) -> int:
    """Weight elements of one dense decoder layer (attention + MLP matrices).

    >>> from dejavu_lab.models import random_model
    >>> layer_elements(random_model("tiny-llama").arch)  # 8192 + 4096 + 3 · 192 · 64
    49152
    """
    e = site_elements(arch)
    return e["attn_in"] + e["o_in"] + e["mlp"]


def bytes_per_token_fraction(
    arch: Arch, kept: dict[tuple[int, str], float], extra_elements: float = 0.0
) -> float:
    """Decoder-layer weight bytes read per token against dense, from kept fractions per site.

    ``kept``: ``{(layer, site): fraction kept}`` (sites missing read in full).
    ``extra_elements``: weights read besides the layers' (e.g. DejaVu's predictors), per token.

    >>> from dejavu_lab.models import random_model
    >>> arch = random_model("tiny-llama").arch
    >>> round(bytes_per_token_fraction(arch, {(0, "mlp"): 0.5, (1, "mlp"): 0.5}), 4)  # MLP 3/4
    0.625
    """
    e, dense = site_elements(arch), layer_elements(arch)
    saved = sum(e[site] * (1.0 - f) for (_, site), f in kept.items())
    total = arch.n_layers * dense
    return (total - saved + extra_elements) / total
