"""A loaded model's decoder linears as int4 weights, read from the GGUF file it was loaded from.

GGUF names a layer's weights ``blk.{i}.attn_q.weight``, ``attn_k``, ``attn_v``, ``attn_output``,
``ffn_gate``, ``ffn_up``, ``ffn_down`` (llama, qwen2, mistral and gemma3 files alike); each maps
to the module of :func:`~dejavu_lab.quant.swap.decoder_linears`. Tensors in Q4_0 / Q4_1 / Q4_K
blocks import exactly (:mod:`~dejavu_lab.quant.gguf_blocks`). Files mix types — the demo's
layers are all Q4_1 (its embedding Q8_0); the Qwen2.5-0.5B "Q4_K_M" file keeps half its
``ffn_down`` in Q4_K and the rest in Q6_K, and every 896-wide row (not a multiple of the K-quants'
256) in Q5_0 or Q8_0 — so any other type is dequantised by gguf and re-quantised to int4 with
round-to-nearest (:func:`~dejavu_lab.quant.int4.quantize`, group 32): not exact, and
:attr:`GGUFImport.types` says which tensors took that road.

llama files store W_Q and W_K with the rows of each head interleaved for their rotary layout;
transformers un-permutes them on load, and so does :func:`import_gguf` (rows = outputs, so the
permutation moves whole columns of ``w_t``: still exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..arch import Arch, get_arch
from ..errors import QuantError
from .gguf_blocks import FOUR_BIT, int4_from_blocks
from .gguf_file import GGUFFile, read_gguf
from .int4 import Int4Weight, quantize
from .swap import decoder_linears

__all__ = ["GGUF_PARTS", "GGUFImport", "gguf_names", "import_gguf"]

# canonical part -> GGUF's name inside a block
GGUF_PARTS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


@dataclass
class GGUFImport:
    """What :func:`import_gguf` read: the weights and the GGUF type each came from.

    >>> from dejavu_lab.quant import quantize
    >>> imp = GGUFImport({"a": quantize(torch.ones(32, 2), group=32)}, {"a": "Q6_K"})
    >>> imp.exact, imp.type_counts()  # Q6_K is re-quantised, not imported as it is
    ([], {'Q6_K': 1})
    """

    weights: dict[str, Int4Weight]  # module name -> int4 weight (w_t, [in, out], group 32)
    types: dict[str, str] = field(default_factory=dict)  # module name -> GGUF type, e.g. "Q4_K"

    @property
    def exact(self) -> list[str]:
        """Modules imported from 4-bit blocks as they are (the rest were re-quantised)."""
        return [n for n, t in self.types.items() if t in FOUR_BIT]

    def type_counts(self) -> dict[str, int]:
        """How many modules came from each GGUF type."""
        out: dict[str, int] = {}
        for t in self.types.values():
            out[t] = out.get(t, 0) + 1
        return dict(sorted(out.items()))


def gguf_names(model: nn.Module, arch: Arch | None = None) -> dict[str, str]:
    """GGUF tensor name -> module name, for every decoder-layer linear of a gated model.

    >>> from dejavu_lab.models import random_model
    >>> names = gguf_names(random_model("tiny-llama").model)
    >>> names["blk.1.ffn_gate.weight"], len(names)
    ('model.layers.1.mlp.gate_proj', 14)
    """
    arch = arch or get_arch(model)
    if not arch.gated:
        raise QuantError(
            f"GGUF import maps gated (Llama-family) layers and {arch.model_type!r} is not one; "
            "use rtn_weights for its weights."
        )
    return {
        f"blk.{i}.{GGUF_PARTS[part]}.weight": name
        for name, (i, part) in decoder_linears(model, arch).items()
    }


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order transformers' llama reader applies to W_Q / W_K (undoing llama.cpp's)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def import_gguf(
    model: nn.Module,
    path,
    *,
    dtype: torch.dtype = torch.float32,
    arch: Arch | None = None,
    modules: Sequence[str] | None = None,
) -> GGUFImport:
    """Every decoder linear of ``model`` as an :class:`Int4Weight` (group 32) from its GGUF file.

    ``path``: the ``.gguf`` file, or a :class:`~dejavu_lab.quant.gguf_file.GGUFFile` already
    read from it (:func:`~dejavu_lab.quant.gguf_file.read_gguf`). ``model`` is the one transformers loaded from it (:func:`dejavu_lab.models.load_model`),
    which names the modules and checks the shapes. ``dtype``: of the scales and mins — fp32
    keeps every 4-bit block exact; fp16 keeps Q4_0/Q4_1 exact and rounds Q4_K's scales
    (:mod:`~dejavu_lab.quant.gguf_blocks`). ``modules``: import only these (module names).

    >>> from dejavu_lab import assets
    >>> from dejavu_lab.models import DEMO_ASSET, load_model
    >>> model = load_model("demo").model
    >>> name = "model.layers.0.self_attn.k_proj"
    >>> imp = import_gguf(model, assets.fetch(DEMO_ASSET), modules=[name])
    >>> imp.types, torch.equal(imp.weights[name].dequantize().T, model.get_submodule(name).weight)
    ({'model.layers.0.self_attn.k_proj': 'Q4_1'}, True)
    """
    from gguf.quants import dequantize

    arch = arch or get_arch(model)
    names = gguf_names(model, arch)
    if modules is not None:
        unknown = sorted(set(modules) - set(names.values()))
        if unknown:
            raise QuantError(
                f"{unknown[0]!r} is not a decoder linear of this model; pass names from decoder_linears(model)."
            )
        names = {g: m for g, m in names.items() if m in set(modules)}
    gf = path if isinstance(path, GGUFFile) else read_gguf(path)
    where, tensors = gf.path, gf.tensors
    file_arch = str(gf.metadata.get("general.architecture", ""))
    missing = [n for n in names if n not in tensors]
    if missing:
        raise QuantError(
            f"{where!r} lacks {len(missing)} of the model's linears (first "
            f"{missing[0]!r}); pass the GGUF file this model was loaded from."
        )
    mods = dict(model.named_modules())
    parts = decoder_linears(model, arch)
    out = GGUFImport({})
    for gname, mname in names.items():
        t = tensors[gname]
        n_in, n_out = (int(x) for x in t.shape[:2])  # ggml order: ne[0] is the input width
        m = mods[mname]
        if (n_in, n_out) != (m.in_features, m.out_features):
            raise QuantError(
                f"{gname} is [{n_out}, {n_in}] but {mname} is [{m.out_features}, "
                f"{m.in_features}]; pass the GGUF file this model was loaded from."
            )
        rows, part = None, parts[mname][1]
        if file_arch == "llama" and part in ("q", "k"):
            rows = _unpermute_rows(n_out, arch.n_heads if part == "q" else arch.n_kv_heads)
        kind = t.tensor_type.name
        if kind in FOUR_BIT:
            q = int4_from_blocks(t.data, kind, n_in, dtype=dtype, rows=rows)
        else:
            w = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
            w = w.reshape(n_out, n_in)
            if rows is not None:
                w = w[rows]
            q = quantize(w.T, group=32, dtype=dtype)
        out.weights[mname] = q
        out.types[mname] = kind
    return out
