"""Each layer's thresholds as the decode step's kernels take them (TEAL §3, WINA, CATS §3).

:class:`~dejavu_lab.engine.SparseConfig` maps ``(layer, site)`` to one number or to fp32
``[d_in]`` (one per input column). A number stays a number: one-token kernels take it as a
float argument (no threshold loads, and a captured graph keeps its value); a union batch and
CATS's kernels read a vector, made once here. Sites with no threshold run dense; the dense ops
chosen ``"triton"`` over the ``"columns"`` layout run the threshold kernels with every column
kept (threshold -1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import EngineError

__all__ = ["Threshold", "keep_sites", "layer_thresholds", "site_widths"]

_WHAT = {"attn_in": "d_model", "o_in": "n_heads x d_head", "mlp_in": "d_model",
         "down_in": "d_mlp", "gate": "d_mlp (one per neuron)"}  # fmt: skip


class Threshold(NamedTuple):
    """One site's threshold: ``value`` (a float, or None for per-column thresholds) and
    ``vector`` (fp32 [d_in] on the weights' device, what union batches and CATS read).

    >>> t = Threshold(0.5, torch.full((4,), 0.5))
    >>> t.at(torch.zeros(1, 4)), tuple(t.at(torch.zeros(2, 4)).shape)  # one token: the float
    (0.5, (4,))
    """

    value: float | None
    vector: torch.Tensor

    def at(self, x: torch.Tensor):
        """What a kernel takes for input x [B, d_in]: the float for one token, else the vector."""
        return self.value if self.value is not None and x.shape[0] == 1 else self.vector


def site_widths(arch) -> dict[str, int]:
    """Entries of each site's input for a model of shape ``arch`` (a rank's, under TP).

    >>> from dejavu_lab.models import random_model
    >>> site_widths(random_model("tiny-llama").arch)
    {'attn_in': 64, 'o_in': 64, 'mlp_in': 64, 'down_in': 192, 'gate': 192}
    """
    return {"attn_in": arch.d_model, "o_in": arch.n_heads * arch.d_head, "mlp_in": arch.d_model,
            "down_in": arch.d_mlp, "gate": arch.d_mlp}  # fmt: skip


def keep_sites(ops: dict, rows: bool) -> tuple[str, ...]:
    """The sites whose dense op runs through the threshold kernels with every column kept: the
    ops chosen "triton" on the columns layout; on the rows layout (``rows``) our row-gather
    kernels read every row instead, but for ``o`` (``W_O^T`` serves both layouts).

    >>> keep_sites({"qkv": "triton", "attn": "torch", "o": "triton", "mlp": "torch"}, rows=True)
    ('o_in',)
    """
    sites = {"qkv": ("attn_in",), "o": ("o_in",), "mlp": ("mlp_in", "down_in")}
    return tuple(s for op, of in sites.items() if ops[op] == "triton" and not (rows and op != "o")
                 for s in of)  # fmt: skip


def layer_thresholds(given: dict, arch, device, keep_sites=()) -> list[dict]:
    """Per layer, ``{site: Threshold or None}`` from ``given`` (``SparseConfig.thresholds``),
    checked against the model's shape; ``keep_sites`` (dense ops run through the threshold
    kernels) get -1 where nothing is given.

    >>> from types import SimpleNamespace
    >>> a = SimpleNamespace(n_layers=2, d_model=4, n_heads=2, d_head=2, d_mlp=8)
    >>> thr = layer_thresholds({(0, "mlp_in"): 0.25}, a, "cpu", keep_sites=("o_in",))
    >>> thr[0]["mlp_in"].value, thr[1]["mlp_in"], thr[1]["o_in"].value
    (0.25, None, -1.0)
    """
    width = site_widths(arch)
    for (layer, site), thr in given.items():
        if not 0 <= layer < arch.n_layers:
            raise EngineError(
                f"thresholds has layer {layer} but the model has layers 0..{arch.n_layers - 1}."
            )
        if isinstance(thr, torch.Tensor) and thr.numel() != width[site]:
            raise EngineError(
                f"thresholds[({layer}, {site!r})] has {thr.numel()} entries but site {site} "
                f"of this model takes {width[site]} ({_WHAT[site]})."
            )
    made = {}  # one vector per (number, width), shared by the layers

    def number(v: float, n: int) -> Threshold:
        if (v, n) not in made:
            made[(v, n)] = Threshold(v, torch.full((n,), v, device=device))
        return made[(v, n)]

    out = []
    for i in range(arch.n_layers):
        sites = {}
        for s, n in width.items():
            t = given.get((i, s))
            if isinstance(t, torch.Tensor):
                sites[s] = Threshold(None, t.detach().to(device, torch.float32).contiguous())
            elif t is not None:
                sites[s] = number(float(t), n)
            else:
                sites[s] = number(-1.0, n) if s in keep_sites else None
        out.append(sites)
    return out
