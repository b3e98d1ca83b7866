"""Weights of a decoder, rearranged once at load time for batch-1 decoding (Deja Vu §4.4).

:func:`decoder_weights` reads a Hugging Face OPT or Llama-family model through its
:class:`~dejavu_lab.arch.Arch` adapter and returns plain tensors laid out for the kernels:

- ``w_qkv`` — ``cat(W_q, W_k, W_v)`` rows, one GEMV (dense) or one gather-GEMV (sparse) per step;
- ``w_o_t`` and ``w_down_t`` — ``o_proj.weight.T`` and ``fc2/down_proj.weight.T`` made
  contiguous, so the rows of one head / one neuron are contiguous (coalesced loads, §4.4);
- ``w_in`` — ``fc1.weight`` (ReLU MLPs) or ``cat(gate, up)`` (SwiGLU): the sparse kernel reads
  the two halves as views, the dense path reads it as one matrix.

That is the ``"rows"`` layout: a kept head or neuron is a block of contiguous rows (DejaVu's
gather-GEMVs, CATS). TEAL and WINA skip input *columns* instead (:func:`~dejavu_lab.kernels.
threshold_gemv` reads row i of ``W^T`` iff input entry i passes), so the ``"columns"`` layout
stores ``w_qkv_t`` and ``w_in_t`` (the transposes, contiguous) in their place; ``W_O^T`` and
``W2^T`` serve both. ``"both"`` keeps the two, for dense, DejaVu and TEAL decoders sharing one
copy.

Tensors that need no new layout (norms, ``fc1``, embeddings, ``lm_head``) are shared with the
HF model, not copied, so building an engine next to a 60 GB model costs the copies only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Arch, get_arch
from ..kernels import use_triton
from ..kernels.int4 import int4_gemv, int4_kept_up
from ..quant import Int4Rows, Int4Weight
from ..vocab import METHODS
from .config import EngineError

__all__ = ["DecoderWeights", "LayerWeights", "check_layout", "decoder_weights", "layout_for",
           "linear_rows", "linear_t"]  # fmt: skip

ENGINE_TYPES = ("opt", "llama", "mistral", "qwen2")  # Arch tables whose blocks the engine runs


@dataclass
class LayerWeights:
    """One block. Shapes: d = d_model, H/Hkv = query/KV heads, dh = d_head, n = MLP neurons.

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model  # d = 64, 4 heads of 16, 256 neurons
    >>> lw = decoder_weights(m).layers[0]
    >>> tuple(lw.w_qkv.shape), tuple(lw.w_down_t.shape)
    ((192, 64), (256, 64))
    >>> torch.equal(lw.w_down_t, m.model.decoder.layers[0].fc2.weight.T)  # one row per neuron
    True
    >>> x = torch.randn(1, 64)
    >>> q = m.model.decoder.layers[0].self_attn.q_proj(x)  # the first 64 outputs of W_QKV
    >>> torch.allclose(lw.qkv(x)[:, :64], q, atol=1e-6)
    True
    """

    ln_attn: tuple  # (weight [d], bias [d] or None, eps)
    ln_mlp: tuple
    w_qkv: torch.Tensor | None  # [(H + 2 Hkv) dh, d]  (rows layout)
    w_qkv_t: torch.Tensor | None  # [d, (H + 2 Hkv) dh]  (columns layout: w_qkv.T, contiguous)
    b_qkv: torch.Tensor | None  # [(H + 2 Hkv) dh]
    w_o_t: torch.Tensor  # [H dh, d]  (o_proj.weight.T, contiguous)
    b_o: torch.Tensor | None  # [d]
    w_in: torch.Tensor | None  # [n, d] (fc1) or [2n, d] (gate rows, then up rows)
    w_in_t: torch.Tensor | None  # [d, n] or [d, 2n]  (columns layout: w_in.T, contiguous)
    b_in: torch.Tensor | None  # [n] or [2n]
    w_down_t: torch.Tensor  # [n, d]  (fc2/down_proj.weight.T, contiguous)
    b_down: torch.Tensor | None  # [d]

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """Dense ``x @ W_QKV^T + b`` (cuBLAS) from whichever layout is stored; x [S, d]."""
        if self.w_qkv is not None:
            return linear_rows(x, self.w_qkv, self.b_qkv)
        return linear_t(x, self.w_qkv_t, self.b_qkv)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        """Dense ``x @ W_in^T + b`` (fc1, or gate then up), either layout; x [S, d]."""
        if self.w_in is not None:
            return linear_rows(x, self.w_in, self.b_in)
        return linear_t(x, self.w_in_t, self.b_in)


def linear_t(x: torch.Tensor, w_t, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w_t + b`` for a weight stored transposed ([d_in, d_out], the columns layout); an
    :class:`~dejavu_lab.quant.Int4Weight` runs :func:`~dejavu_lab.kernels.int4.int4_gemv` for
    1-32 rows on a GPU (or the CPU under ``TRITON_INTERPRET=1``), else the dequantised matrix.

    >>> x, w_t = torch.ones(1, 2), torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    >>> linear_t(x, w_t, torch.ones(3))
    tensor([[ 6.,  8., 10.]])
    """
    if isinstance(w_t, Int4Weight):
        if x.shape[0] <= 32 and use_triton(x.device):
            return int4_gemv(x, w_t, bias=b)
        w_t = w_t.dequantize(x.dtype)
    return x @ w_t if b is None else torch.addmm(b, x, w_t)


def linear_rows(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` for a weight stored as rows ([d_out, d_in], ``nn.Linear.weight``); an
    :class:`~dejavu_lab.quant.Int4Rows` runs :func:`~dejavu_lab.kernels.int4.int4_kept_up` over
    every row for 1-32 rows on a GPU (or the CPU under ``TRITON_INTERPRET=1``), else the
    dequantised matrix.

    >>> linear_rows(torch.ones(1, 2), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), None)
    tensor([[3., 7.]])
    """
    if isinstance(w, Int4Rows):
        if x.shape[0] <= 32 and use_triton(x.device):
            return int4_kept_up(x, w, bias=b)
        w = w.dequantize(x.dtype)
    return F.linear(x, w, b)


@dataclass
class DecoderWeights:
    """Everything a decode step reads, plus the model's shape (from its :class:`Arch`).

    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-opt").model)
    >>> w.norm, w.activation, w.max_positions, w.dtype
    ('layer', 'relu', 2048, torch.float32)
    >>> w.nbytes("lm_head")  # vocab 128 x d 64 x 4 bytes
    32768
    """

    arch: Arch
    layers: list[LayerWeights]
    embed: torch.Tensor  # [V, d_embed] token embeddings
    pos_embed: torch.Tensor | None  # [P, d] learned positions (OPT), indexed at pos + pos_offset
    pos_offset: int  # OPT's learned positions start at 2
    project_in: torch.Tensor | None  # [d, d_embed] (OPT-350m) or None
    project_out: torch.Tensor | None  # [d_embed, d] or None
    final_norm: tuple | None  # (weight, bias, eps) or None (post-LN OPT)
    lm_head: torch.Tensor  # [V, d_embed]
    norm: str  # "layer" (LayerNorm) or "rms" (RMSNorm)
    activation: str  # "relu", "gelu" or "silu" (the MLP's, gated or not)
    rotary: nn.Module | None  # HF rotary embedding module (Llama-family), None for OPT
    max_positions: int  # longest sequence the position scheme supports
    # {(layer, site): threshold} masked in the prefill too: a folded refit (engine.refit) reads
    # W R, which holds for thresholded inputs only
    prefill_masks: dict = field(default_factory=dict, repr=False, kw_only=True)

    @property
    def layout(self) -> str:
        """``"rows"``, ``"columns"`` or ``"both"``: the stored layouts of W_QKV (see module doc)."""
        lw = self.layers[0]
        return {(True, False): "rows", (False, True): "columns", (True, True): "both"}[
            (lw.w_qkv is not None, lw.w_qkv_t is not None)
        ]

    def set_layout(self, layout: str) -> DecoderWeights:
        """Convert in place to ``layout`` one matrix at a time (peak: one extra matrix), e.g.
        after timing DejaVu on a model too large for ``"both"``; returns self.

        >>> from dejavu_lab.models import random_model
        >>> w = decoder_weights(random_model("tiny-llama").model)
        >>> w.set_layout("columns").layout, w.layers[0].w_in is None
        ('columns', True)
        >>> w.set_layout("both").layout
        'both'
        """
        if layout not in ("rows", "columns", "both"):
            raise EngineError(f"layout={layout!r} must be 'rows', 'columns' or 'both'.")
        rows, cols = layout != "columns", layout != "rows"
        for lw in self.layers:
            for r, c in (("w_qkv", "w_qkv_t"), ("w_in", "w_in_t")):
                if cols and getattr(lw, c) is None:
                    setattr(lw, c, getattr(lw, r).T.contiguous())
                if rows and getattr(lw, r) is None:
                    setattr(lw, r, getattr(lw, c).T.contiguous())
                if not rows and not (r == "w_in" and self.arch.family == "opt"):
                    setattr(lw, r, None)  # (OPT's fc1 is the HF model's own tensor: kept)
                if not cols:
                    setattr(lw, c, None)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def nbytes(self, part: str = "all") -> int:
        """Bytes a dense decode step reads: "layers", "lm_head" or "all" (both); a matrix
        stored in both layouts is read once."""
        layer = sum(
            t.nbytes  # an Int4Weight's: codes, scales and mins
            for lw in self.layers
            for t in (
                lw.w_qkv if lw.w_qkv is not None else lw.w_qkv_t,
                lw.b_qkv,
                lw.w_o_t,
                lw.b_o,
                lw.w_in if lw.w_in is not None else lw.w_in_t,
                lw.b_in,
                lw.w_down_t,
                lw.b_down,
            )
            if t is not None
        )
        head = self.lm_head.numel() * self.lm_head.element_size()
        return {"layers": layer, "lm_head": head, "all": layer + head}[part]


def _norm(module: nn.Module) -> tuple:
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-6)
    return (module.weight.detach(), getattr(module, "bias", None), float(eps))


def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise EngineError("some projections have a bias and others not; the engine needs both.")
    return torch.cat([t.detach() for t in ts])


def _check_layer(lw: LayerWeights, arch: Arch, rows: bool) -> None:
    n_qkv = (lw.w_qkv if rows else lw.w_qkv_t.T).shape[0]
    if n_qkv != (arch.n_heads + 2 * arch.n_kv_heads) * arch.d_head:
        raise EngineError("q/k/v projections do not match the model's head counts.")
    if lw.w_down_t.shape != (arch.d_mlp, arch.d_model):
        raise EngineError("the MLP's down projection does not match d_mlp x d_model.")


def _cat_t(ws) -> torch.Tensor:
    """``cat(ws).T`` made contiguous, written block by block (no second full-size temporary)."""
    ws = [w.detach() for w in ws]
    out = torch.empty(
        ws[0].shape[1], sum(w.shape[0] for w in ws), dtype=ws[0].dtype, device=ws[0].device
    )
    col = 0
    for w in ws:
        out[:, col : col + w.shape[0]].copy_(w.T)
        col += w.shape[0]
    return out


def _activation(arch: Arch) -> str:
    act = {"relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}.get(arch.activation)
    if act is None:
        raise EngineError(
            f"activation {arch.activation!r} is not supported by the engine; it runs relu, gelu "
            "(erf form) and silu."
        )
    return act


def decoder_weights(
    model: nn.Module, arch: Arch | None = None, *, layout: str = "rows", release: bool = False
) -> DecoderWeights:
    """Rearrange ``model``'s weights for :class:`dejavu_lab.engine.Decoder` (see module doc).

    ``layout``: ``"rows"`` (dense, DejaVu, CATS), ``"columns"`` (TEAL, WINA: W_QKV and the MLP
    input stored transposed instead) or ``"both"``. The rearranged projections are copies, so
    the model and the engine together hold about 1.6x the weights (OPT-30B in fp16: 100 GB).
    ``release=True`` frees each layer's copied projections in ``model`` as soon as the engine
    has its own, so the two together never hold more than the weights and one layer's copies;
    ``model`` can then no longer run (its embeddings, norms, biases and any tensor the engine
    shares stay).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-opt").model
    >>> w = decoder_weights(m, release=True)
    >>> m.model.decoder.layers[0].fc2.weight.numel(), tuple(w.layers[0].w_down_t.shape)
    (0, (256, 64))

    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama").model)  # 4 query heads, 2 KV heads of 16
    >>> lw = w.layers[0]
    >>> tuple(lw.w_qkv.shape), tuple(lw.w_in.shape)  # (4 + 2 + 2) x 16 rows; gate then up rows
    ((128, 64), (384, 64))
    >>> lw = decoder_weights(random_model("tiny-llama").model, layout="columns").layers[0]
    >>> lw.w_qkv is None, tuple(lw.w_qkv_t.shape), tuple(lw.w_in_t.shape)
    (True, (64, 128), (64, 384))
    """
    if layout not in ("rows", "columns", "both"):
        raise EngineError(f"layout={layout!r} must be 'rows', 'columns' or 'both'.")
    rows, cols = layout != "columns", layout != "rows"
    arch = arch or get_arch(model)
    if arch.model_type not in ENGINE_TYPES:
        raise EngineError(
            f"the engine runs {', '.join(ENGINE_TYPES)} blocks; {arch.model_type!r} is not one "
            "of them (use dejavu_lab.sparsify for quality runs on this model)."
        )
    cfg = model.config
    if getattr(cfg, "use_qk_norm", False) or hasattr(arch.part(model, 0, "attn"), "q_norm"):
        raise EngineError("models with per-head q/k norms are not supported by the engine.")
    layers = []
    with torch.no_grad():
        for i in range(arch.n_layers):
            q, k, v, o = (arch.part(model, i, p) for p in "qkvo")
            w_in = arch.mlp_in(model, i)
            down = arch.part(model, i, "mlp_out")
            qkv = (q.weight, k.weight, v.weight)
            # fc1 alone is HF's own tensor (shared, free); gate/up are concatenated (a copy)
            w1 = w_in[0].weight.detach() if len(w_in) == 1 else None
            layers.append(
                LayerWeights(
                    ln_attn=_norm(arch.part(model, i, "ln_attn")),
                    ln_mlp=_norm(arch.part(model, i, "ln_mlp")),
                    w_qkv=_cat(*qkv) if rows else None,
                    w_qkv_t=_cat_t(qkv) if cols else None,
                    b_qkv=_cat(q.bias, k.bias, v.bias),
                    w_o_t=o.weight.detach().T.contiguous(),
                    b_o=None if o.bias is None else o.bias.detach(),
                    w_in=w1
                    if w1 is not None
                    else (_cat(*(m.weight for m in w_in)) if rows else None),
                    w_in_t=_cat_t([m.weight for m in w_in]) if cols else None,
                    b_in=_cat(*(m.bias for m in w_in)),
                    w_down_t=down.weight.detach().T.contiguous(),
                    b_down=None if down.bias is None else down.bias.detach(),
                )
            )
            if i == 0:  # the shapes, checked before any tensor of the model is released
                _check_layer(layers[0], arch, rows)
            if release:
                copied = [q, k, v, o, down] + (list(w_in) if w1 is None else [])
                for module in copied:  # only the copied weights: shared tensors stay
                    module.weight.data = module.weight.data.new_empty(0)
    final = None
    try:
        fn = arch.final_norm(model)
        final = None if fn is None else _norm(fn)
    except AttributeError:
        final = None
    lm_head = model.get_output_embeddings().weight.detach()
    if arch.family == "opt":
        dec = model.model.decoder
        pos = dec.embed_positions
        return DecoderWeights(
            arch=arch,
            layers=layers,
            embed=dec.embed_tokens.weight.detach(),
            pos_embed=pos.weight.detach(),
            pos_offset=int(getattr(pos, "offset", 2)),
            project_in=None if dec.project_in is None else dec.project_in.weight.detach(),
            project_out=None if dec.project_out is None else dec.project_out.weight.detach(),
            final_norm=final,
            lm_head=lm_head,
            norm="layer",
            activation=_activation(arch),
            rotary=None,
            max_positions=pos.weight.shape[0] - int(getattr(pos, "offset", 2)),
        )
    return DecoderWeights(
        arch=arch,
        layers=layers,
        embed=model.get_input_embeddings().weight.detach(),
        pos_embed=None,
        pos_offset=0,
        project_in=None,
        project_out=None,
        final_norm=final,
        lm_head=lm_head,
        norm="rms",
        activation=_activation(arch),
        rotary=model.model.rotary_emb,
        max_positions=int(getattr(cfg, "sliding_window", None) or 1 << 20),
    )


def _reads_columns(method: str) -> bool:
    """TEAL/WINA, and LaRoSA/R-Sparse (TEAL's rule on their transformed inputs)."""
    m = METHODS.get(method)
    return m is not None and (m.input_sparse or m.family == "topk")


def layout_for(method: str) -> str:
    """The weights layout a method reads: TEAL/WINA (and LaRoSA, R-Sparse) threshold W_QKV's
    and W_in's columns.

    >>> layout_for("teal"), layout_for("rsparse"), layout_for("dejavu")
    ('columns', 'columns', 'rows')
    """
    return "columns" if _reads_columns(method) else "rows"


def check_layout(w: DecoderWeights, method: str, thresholds) -> None:
    """Raise :class:`EngineError` when ``w`` lacks a layout that ``method`` reads
    (``thresholds``: its ``{(layer, site): ...}``, whose sites decide for TEAL/WINA/LaRoSA/R-Sparse).

    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama").model, layout="rows")
    >>> check_layout(w, "cats", None)  # CATS reads the rows layout: fine
    """
    lw, need = w.layers[0], []
    if method in ("dejavu", "cats"):
        need = [("w_in", "rows")] + ([("w_qkv", "rows")] if method == "dejavu" else [])
    elif _reads_columns(method):
        sites = {site for _, site in thresholds}
        need = [
            (m, "columns") for m, s in (("w_qkv_t", "attn_in"), ("w_in_t", "mlp_in")) if s in sites
        ]
    for name, layout in need:
        if getattr(lw, name) is None:
            raise EngineError(
                f"method {method!r} reads the {layout} layout of the weights but these were built "
                f"with layout={w.layout!r}; build them with decoder_weights(model, "
                f"layout={layout!r}) (or 'both', to share them between methods)."
            )
