"""The kept fractions a sparse forward realised, per (layer, site): what the bytes are counted from.

A threshold keeps a different number of entries for every token, so the bytes a sparse step
reads are counted from the share of units each site kept, averaged over the evaluated tokens
(bytes are linear in that number): :class:`Kept` collects it from the sparsity hooks, and
:func:`dejavu_lab.step_bytes.bytes_per_token_fraction` turns it into decoder-layer bytes per
token against dense.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["Kept"]


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
        # (layer, what) -> weight elements read per token besides the kept columns: an online
        # rotation, a low-rank term (dejavu_lab.sparsify.larosa, .rsparse)
        self.extra: dict[tuple[int, str], float] = {}
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

    def add_extra(self, layer: int, what: str, elements: float) -> None:
        """Record that every token of ``layer`` reads ``elements`` weights besides its sites'
        kept columns (set, not summed: the same for every token and batch).

        >>> k = Kept()
        >>> k.add_extra(0, "rotation", 4096); k.add_extra(0, "rotation", 4096)
        >>> k.extra_elements()
        4096.0
        """
        self.extra[(layer, what)] = float(elements)

    def extra_elements(self) -> float:
        """Weight elements read per token besides the kept columns, over every layer."""
        return float(sum(self.extra.values()))

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
