"""4-bit weights in the decode engine: group-wise int4 matrices, and the dense and TEAL / WINA steps over them.

:func:`quantize_weights` turns the four matrices of every layer into group-wise int4,
round-to-nearest with one (scale, min) per output and ``group`` input channels; norms,
embeddings and ``lm_head`` stay in the model's dtype. ``W_O^T`` and ``W2^T`` are
:class:`~dejavu_lab.quant.Int4Weight` s (one row per input channel: TEAL's dropped inputs and
Deja Vu's kept heads and neurons are rows of them); ``W_QKV`` and ``W_in`` take the layout the
method reads (:data:`LAYOUTS`): the columns (``W_QKV^T``, ``W_in^T`` as Int4Weights) for dense,
TEAL and WINA, the rows (``W_QKV``, ``W_in`` as :class:`~dejavu_lab.quant.Int4Rows`, one row per
output) for the kept heads and neurons of DejaVu and the kept up rows of CATS. Both hold the
same numbers (the groups run along the inputs either way), so a method's choice of layout
changes which bytes it can skip, never the weights. The blocks then
run the int4 kernels (:mod:`dejavu_lab.kernels.int4`): :class:`Int4Attention` and
:class:`Int4MLP` are the dense blocks with each product an :func:`~dejavu_lab.kernels.int4.
int4_gemv`, or an :func:`~dejavu_lab.kernels.int4.int4_threshold_gemv` at the sites with a
threshold — the input channels below it skip their code bytes. In the fused one-token step
(:mod:`~dejavu_lab.engine.fused_step`) the products of ``W_QKV``, ``W_O`` and ``W2`` leave
their fp32 sums (:func:`~dejavu_lab.kernels.int4.sums.int4_sums`) for the rotation and the
residual add + norm to finish, as the fp16 threshold GEMV's are, and the down projection
finishes the gate/up sums as it loads them (``Decoder.fuse_hidden``): no finishing launch at
all. The dense prefill multiplies by the dequantised matrices
(:func:`~dejavu_lab.engine.weights.linear_t`).

``Decoder(model, ..., weights="int4", group=...)`` builds this for every method; DejaVu's and
CATS's blocks are in :mod:`~dejavu_lab.engine.int4_sparse`.

>>> from dejavu_lab.engine import Decoder
>>> from dejavu_lab.models import random_model
>>> m, ids = random_model("tiny-llama", dtype=torch.float16).model, torch.tensor([[1, 2, 3]])
>>> dec = Decoder(m, max_seq_len=8, weights="int4", group=64)
>>> type(dec.mlp[0]).__name__, type(dec.w.layers[0].w_down_t).__name__
('Int4MLP', 'Int4Weight')
>>> dec.generate(ids, 3).shape
torch.Size([1, 6])
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..kernels import rope_sums
from ..kernels._common import use_triton
from ..kernels.int4 import int4_gemv, int4_threshold_gemv
from ..kernels.int4.dense import activated
from ..kernels.int4.lists import LIST_ROWS, KeptLists
from ..kernels.int4.sums import half2_config, int4_sums
from ..quant import GROUPS, Int4Rows, Int4Weight, quantize, rows_layout
from .attention import DenseAttention
from .config import EngineError
from .mlp import DenseMLP, act
from .weights import DecoderWeights, decoder_weights, linear_rows, linear_t

__all__ = [
    "Int4Attention",
    "Int4MLP",
    "check_int4_layout",
    "is_int4",
    "quantize_head",
    "quantize_weights",
    "random_int4_weights",
]

#: The norm before an int4 TEAL product lists the product's kept rows once per token
#: (:mod:`~dejavu_lab.kernels.int4.lists`), instead of every column tile of the product listing
#: its block's rows again (``DEJAVU_INT4_LISTS=1``). Off by default: on an H100 the product
#: alone runs faster on listed rows (``results/int4_gemv_g128_b1_listed.json``: 0.85-0.92 of
#: the self-listing kernel's time at 50% kept, 0.85-0.94 at 20%, the three Llama MLP shapes),
#: but the step slows with the listing in the norm, whether the norm lists in one program
#: (fdcaec5: TEAL 50% at Llama-3-8B's shape 2.168 -> 2.267 ms per token) or over many
#: (:mod:`~dejavu_lab.kernels.int4.norm_lists`, 846af36: 2.190 -> 2.232 ms, 40% 2.367 ->
#: 2.382, with lm_head in int4 1.926 -> 1.967; ``results/engine_int4_8b_lists0/1.json``).
LISTS = os.environ.get("DEJAVU_INT4_LISTS", "0") == "1"
MATRICES = ("w_qkv_t", "w_o_t", "w_in_t", "w_down_t")  # the columns layout's four matrices
# per method, the layout of W_QKV and of W_in its int4 blocks read (W_O^T, W2^T: always rows of
# the transposes); DejaVu gathers kept heads' and neurons' rows, CATS its kept up rows
LAYOUTS = {"dense": ("columns", "columns"), "teal": ("columns", "columns"),
           "wina": ("columns", "columns"), "dejavu": ("rows", "rows"),
           "cats": ("columns", "rows")}  # fmt: skip


def is_int4(w: DecoderWeights) -> bool:
    """Whether ``w``'s layer matrices are int4 (:func:`quantize_weights`).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama", dtype=torch.float16).model, layout="columns")
    >>> is_int4(w), is_int4(quantize_weights(w, group=64))
    (False, True)
    """
    return isinstance(w.layers[0].w_down_t, Int4Weight)


def quantize_weights(w: DecoderWeights, group: int = 128, method: str = "dense") -> DecoderWeights:
    """A copy of ``w`` (any layout, fp16/bf16) whose layer matrices are int4 with ``group`` input
    channels per (scale, min), ``W_QKV`` and ``W_in`` in the layout ``method``'s blocks read
    (:data:`LAYOUTS`: columns for dense/TEAL/WINA, rows for DejaVu, W_in's rows for CATS).
    Int4 weights are laid out anew, exactly (the same codes, scales and mins; ``group`` unused).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> w4 = quantize_weights(decoder_weights(m, layout="columns"), group=64)
    >>> lw = w4.layers[0]
    >>> lw.w_qkv_t.shape, lw.w_qkv_t.group, lw.w_qkv is None, is_int4(w4)
    ((64, 128), 64, True, True)
    >>> lw = quantize_weights(decoder_weights(m), group=64, method="cats").layers[0]
    >>> type(lw.w_qkv_t).__name__, type(lw.w_in).__name__, lw.w_in.shape  # gate, then up rows
    ('Int4Weight', 'Int4Rows', (384, 64))
    """
    if method not in LAYOUTS:
        raise EngineError(f"method={method!r} must be one of {', '.join(LAYOUTS)}.")
    pairs = (("w_qkv", "w_qkv_t"), ("w_in", "w_in_t"))
    if is_int4(w):
        layers = []
        for lw in w.layers:
            new = {}
            for (rows, cols), layout in zip(pairs, LAYOUTS[method], strict=True):
                r, c = getattr(lw, rows), getattr(lw, cols)
                if layout == "rows":
                    new[rows], new[cols] = (r if r is not None else rows_layout(c)), None
                else:
                    new[rows], new[cols] = None, (c if c is not None else r.columns())
            layers.append(dataclasses.replace(lw, **new))
        return dataclasses.replace(w, layers=layers)
    if w.dtype not in (torch.float16, torch.bfloat16):
        raise EngineError(
            f"int4 weights pair with fp16/bf16 activations but the model is {w.dtype}; load it "
            "with dtype=torch.float16 (or bfloat16)."
        )
    if group not in GROUPS:
        raise EngineError(f"group={group!r} is not supported; pick one of {GROUPS}.")
    layers = []
    for lw in w.layers:
        new = {}
        for (rows, cols), layout in zip(pairs, LAYOUTS[method], strict=True):
            t = getattr(lw, cols)
            q = _quantize(cols, t if t is not None else getattr(lw, rows).T, group, w.dtype)
            new[rows], new[cols] = (rows_layout(q), None) if layout == "rows" else (None, q)
        for name in ("w_o_t", "w_down_t"):
            new[name] = _quantize(name, getattr(lw, name), group, w.dtype)
        layers.append(dataclasses.replace(lw, **new))
    return dataclasses.replace(w, layers=layers)


def quantize_head(w: DecoderWeights, group: int = 128) -> DecoderWeights:
    """A copy of ``w`` whose output projection (``lm_head`` [V, d]) is int4 too, as an
    :class:`~dejavu_lab.quant.Int4Weight` of its transpose (round-to-nearest, ``group`` input
    channels per scale and min; a tied one leaves the input embeddings as they are). The
    engine keeps ``lm_head`` in the model's dtype unless asked: it is about a fifth of what an
    int4 Llama-3-8B step reads, and rounding it costs perplexity of its own
    (:func:`dejavu_lab.report.int4_rounding.head_sentence`).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> w = decoder_weights(random_model("tiny-llama", dtype=torch.float16).model)
    >>> h = quantize_head(w, group=64)
    >>> type(h.lm_head).__name__, h.lm_head.shape, h.embed is w.embed
    ('Int4Weight', (64, 128), True)
    """
    if isinstance(w.lm_head, Int4Weight):
        return w
    if w.dtype not in (torch.float16, torch.bfloat16):
        raise EngineError(f"an int4 lm_head pairs with fp16/bf16 activations but the model is "
                          f"{w.dtype}; load it with dtype=torch.float16 (or bfloat16).")  # fmt: skip
    return dataclasses.replace(w, lm_head=_quantize("lm_head", w.lm_head.T, group, w.dtype))


def _quantize(name: str, t: torch.Tensor, group: int, dtype) -> Int4Weight:
    """``t`` ([d_in, d_out]) in int4, or one sentence when its inputs do not split into groups."""
    if t.shape[0] % group:
        raise EngineError(
            f"{name} has {t.shape[0]} input channels, not a multiple of group={group}; "
            f"pick a group that divides every layer's inputs (one of {GROUPS})."
        )
    return quantize(t, group=group, dtype=dtype)


def check_int4_layout(w: DecoderWeights, method: str, sparse=None) -> None:
    """Raise :class:`EngineError` when int4 weights ``w`` lack a layout ``method`` reads: DejaVu
    the rows of ``W_QKV`` and ``W_in``, CATS the rows of ``W_in``, TEAL / WINA the columns of the
    matrices whose input they threshold (``sparse``: the :class:`~dejavu_lab.engine.SparseConfig`);
    a dense product runs on either layout.

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> check_int4_layout(quantize_weights(decoder_weights(m), 64, "dejavu"), "dejavu")  # fine
    >>> check_int4_layout(quantize_weights(decoder_weights(m), 64, "dejavu"), "dense")  # fine
    """
    lw, need = w.layers[0], []
    pairs = (("w_qkv", "w_qkv_t", "attn_in"), ("w_in", "w_in_t", "mlp_in"))
    if method in ("dejavu", "cats"):
        need = [(rows, "rows") for (rows, _, _), lay in zip(pairs, LAYOUTS[method], strict=True)
                if lay == "rows"]  # fmt: skip
    elif method in ("teal", "wina"):
        sites = {site for _, site in sparse.thresholds}
        need = [(cols, "columns") for _, cols, site in pairs if site in sites]
    for name, layout in need:
        if getattr(lw, name) is None:
            raise EngineError(
                f"method {method!r} reads the {layout} layout of {name.removesuffix('_t')} but "
                f"these int4 weights do not hold it; build them with quantize_weights(w, group, "
                f"method={method!r})."
            )


def random_int4_weights(preset: str, *, group: int = 128, dtype=torch.float16,
                        device="cpu", seed: int = 0, head: bool = False) -> DecoderWeights:  # fmt: skip
    """Int4 decoder weights at a preset shape, random, built without the fp16 model (Llama-3-70B
    in 4 bits fits one H200; in fp16 it does not): uniform codes with the scale and min of a
    weight of standard deviation 0.02, unit norms, N(0, 0.02) embeddings (``head``: an int4
    ``lm_head`` of the same kind, :func:`quantize_head`). For speed runs.

    >>> w = random_int4_weights("tiny-llama", group=64)
    >>> lw = w.layers[0]
    >>> type(lw.w_in_t).__name__, lw.w_in_t.shape, w.embed.device.type, is_int4(w)
    ('Int4Weight', (64, 384), 'cpu', True)
    >>> 0.015 < float(lw.w_down_t.dequantize(torch.float32).std()) < 0.025
    True
    """
    from ..models import random_model

    m = random_model(preset, device="meta", dtype=dtype)
    meta = decoder_weights(m.model, m.arch, layout="columns")  # shapes only: nothing allocated
    g = torch.Generator(device=device).manual_seed(seed)
    step = 0.02 / (255 / 12) ** 0.5  # uniform codes 0..15 times step: standard deviation 0.02

    def real(t, ones=False):
        if t is None:
            return None
        if ones:
            return torch.ones(t.shape, dtype=dtype, device=device)
        return (torch.randn(t.shape, generator=g, device=device) * 0.02).to(dtype)

    def norm(p):
        w_, b, eps = p
        return (real(w_, ones=True), None if b is None else torch.zeros_like(real(b)), eps)

    def int4(t):
        n_in, n_out = t.shape
        packed = torch.randint(0, 256, (n_in, n_out // 2), generator=g, device=device,
                               dtype=torch.uint8)  # fmt: skip
        scales = torch.full((n_in // group, n_out), step, dtype=dtype, device=device)
        return Int4Weight(packed, scales, -7.5 * scales, group)

    layers = [
        dataclasses.replace(
            lw,
            ln_attn=norm(lw.ln_attn),
            ln_mlp=norm(lw.ln_mlp),
            w_qkv=None,
            w_in=None,
            b_qkv=real(lw.b_qkv),
            b_o=real(lw.b_o),
            b_in=real(lw.b_in),
            b_down=real(lw.b_down),
            **{name: int4(getattr(lw, name)) for name in MATRICES},
        )  # fmt: skip
        for lw in meta.layers
    ]
    embed = real(meta.embed)
    tied = meta.lm_head is meta.embed and not head
    rotary = meta.rotary
    if rotary is not None:  # its inv_freq buffer lives on meta: a new one on the device
        rotary = type(rotary)(config=m.model.config).to(device)
    return dataclasses.replace(
        meta, layers=layers, embed=embed,
        lm_head=int4(meta.lm_head.T) if head else embed if tied else real(meta.lm_head),
        pos_embed=real(meta.pos_embed), project_in=real(meta.project_in),
        project_out=real(meta.project_out),
        final_norm=None if meta.final_norm is None else norm(meta.final_norm), rotary=rotary,
    )  # fmt: skip


def _product(x: torch.Tensor, w4: Int4Weight | Int4Rows, b, t, activation: str = "none",
             gated: bool = False) -> torch.Tensor:  # fmt: skip
    """``act(x @ dequant(w4) + b)`` (``gated``: ``act(gate) * up`` of its halves; ``"none"``:
    the product), thresholded at ``t`` (a Threshold, or None: dense); a rows-layout ``w4``
    (``W`` itself) is dense. The int4 GEMVs apply the activation in their finishing launch."""
    if isinstance(w4, Int4Rows):
        y = linear_rows(x, w4, b)
    elif t is not None and x.shape[0] <= 32:
        return int4_threshold_gemv(x, w4, t.at(x), bias=b, activation=activation, gated=gated)
    elif x.shape[0] <= 32 and use_triton(x.device):
        return int4_gemv(x, w4, bias=b, activation=activation, gated=gated)
    else:
        y = linear_t(x, w4, b)
    return y if activation == "none" and not gated else activated(y, activation, gated)


def _sums(x: torch.Tensor, w4, t, kind: str = "sums", lists=None) -> torch.Tensor | None:
    """One token's product over the columns layout left as fp32 sums (:func:`int4_sums`),
    thresholded at ``t`` (a Threshold, or None: dense; ``lists``: x's kept rows, listed by its
    producer); None where it does not run (a rows-layout ``w4`` included)."""
    if not isinstance(w4, Int4Weight):
        return None
    return int4_sums(x, w4, None if t is None else t.at(x), kind=kind, lists=lists)


class _Listed:
    """The kept lists an int4 threshold block asks its input's producer for (:data:`LISTS`):
    one buffer per block, handed out by :meth:`ask` and taken by the next product."""

    def __init__(self):
        self.buf, self.pending = None, None

    def ask(self, t, w4) -> tuple | None:
        """``(thr, kept)`` for a one-token threshold product over ``w4`` at ``t`` where the
        half2 kernel runs it, else None."""
        self.pending = None
        if not LISTS or t is None or not isinstance(w4, Int4Weight):
            return None
        d_in, dev = w4.shape[0], w4.packed.device
        if d_in % LIST_ROWS or w4.group % LIST_ROWS:
            return None
        if half2_config(w4, "int4_threshold_gemv", dev) is None:  # int4_sums would not run
            return None
        if self.buf is None:
            self.buf = KeptLists.empty(d_in, dev)
        self.pending = self.buf
        return (t.value if t.value is not None else t.vector), self.buf

    def take(self):
        """The lists asked for, once (then None until asked again)."""
        out, self.pending = self.pending, None
        return out


class Int4Attention(DenseAttention):
    """Every head over int4 ``W_QKV^T`` and ``W_O^T``, thresholded at ``t_in`` (attn_in) and
    ``t_o`` (o_in) where given (TEAL / WINA), else dense.

    >>> from dejavu_lab.engine import Decoder, SparseConfig, keep_all
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama", dtype=torch.float16).model
    >>> teal = SparseConfig(method="teal", thresholds={(0, "attn_in"): 0.5})
    >>> dec = Decoder(m, max_seq_len=8, sparse=teal, weights="int4", group=64)
    >>> type(dec.attn[0]).__name__, dec.attn[0].t_in.value, dec.attn[1].t_in
    ('Int4Attention', 0.5, None)
    """

    def __init__(self, lw, kv: torch.Tensor, st, t_in=None, t_o=None):
        super().__init__(lw, kv, st)
        self.t_in, self.t_o = t_in, t_o
        self.listed = _Listed()

    def lists_for(self) -> tuple | None:
        """``(thr, kept)`` for the norm that makes the next input to list its kept rows in
        (:data:`LISTS`), or None."""
        if self.st.cos is None:  # no rotation to finish the sums in: the plain product
            return None
        return self.listed.ask(self.t_in, self.lw.w_qkv_t)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        return _product(x, lw.w_qkv if lw.w_qkv_t is None else lw.w_qkv_t, lw.b_qkv, self.t_in)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return _product(o, self.lw.w_o_t, self.lw.b_o, self.t_o)

    def qkv_rot(self, x: torch.Tensor) -> torch.Tensor:
        """One token's q/k/v sums finished inside the rotation (:func:`rope_sums`)."""
        st, lw = self.st, self.lw
        lists = self.listed.take()
        ws = _sums(x, lw.w_qkv_t, self.t_in, lists=lists) if st.cos is not None else None
        if ws is None:
            return super().qkv_rot(x)
        out = torch.empty((1, ws.numel()), dtype=x.dtype, device=x.device)
        return rope_sums(ws, lw.b_qkv, out, st.cos, st.sin, st.positions, n_rot=st.H + st.Hkv)

    def o_src(self, o: torch.Tensor) -> tuple:
        """``W_O`` 's sums, finished in the residual add and norm of the fused step."""
        ws = _sums(o, self.lw.w_o_t, self.t_o)
        return (self.out(o), None, False) if ws is None else (ws, self.lw.b_o, True)


class Int4MLP(DenseMLP):
    """The MLP over int4 ``W_in^T`` and ``W2^T``, thresholded at ``t_in`` (mlp_in) and
    ``t_down`` (down_in) where given (TEAL / WINA), else dense (``W_in`` in the rows layout, as
    CATS's weights hold it, is dense).

    >>> from dejavu_lab.engine import Decoder
    >>> from dejavu_lab.models import random_model
    >>> dec = Decoder(random_model("tiny-llama", dtype=torch.float16).model, max_seq_len=8,
    ...               weights="int4", group=64)
    >>> x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half()
    >>> lw = dec.w.layers[0]  # the same MLP over the dequantised matrices
    >>> a = x.float() @ lw.w_in_t.dequantize(torch.float32)
    >>> h = (torch.nn.functional.silu(a[:, :192]) * a[:, 192:]).half()
    >>> ref = h.float() @ lw.w_down_t.dequantize(torch.float32)
    >>> torch.allclose(dec.mlp[0](x).float(), ref, atol=2e-2)
    True
    """

    def __init__(self, lw, w, t_in=None, t_down=None):
        super().__init__(lw, w)
        self.t_in, self.t_down = t_in, t_down
        self.listed = _Listed()

    def lists_for(self) -> tuple | None:
        """As :meth:`Int4Attention.lists_for`, for the gate/up product (``fuse_hidden`` only)."""
        return self.listed.ask(self.t_in, self.lw.w_in_t)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _product(self.hidden(x), self.lw.w_down_t, self.lw.b_down, self.t_down)

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def src(self, x: torch.Tensor, fuse_hidden: bool) -> tuple:
        """The down projection's sums, finished in the residual add and norm of the fused step;
        with ``fuse_hidden`` the down GEMV also finishes the gate/up sums as it loads them,
        act(gate) * up, so the hidden activations cost no launch (the residual epilogue then
        zeroes those sums)."""
        lw = self.lw
        lists = self.listed.take()
        gu = _sums(x, lw.w_in_t, self.t_in, kind="hidden", lists=lists) if fuse_hidden else None
        if gu is not None:
            t = self.t_down
            ws = int4_sums(gu, lw.w_down_t, None if t is None else t.at(x), x_act=self.activation,
                           x_gated=self.gated, x_bias=lw.b_in)  # fmt: skip
            if ws is not None:
                return ws, lw.b_down, True, gu
            gu.zero_()  # a tuned table picked another kernel for the down shape: finish apart
        h = self.hidden(x)
        ws = _sums(h, self.lw.w_down_t, self.t_down)
        if ws is None:
            return _product(h, self.lw.w_down_t, self.lw.b_down, self.t_down), None, False, None
        return ws, self.lw.b_down, True, None

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.lw
        if lw.w_in_t is not None:  # columns: the activation in the GEMV's finishing launch
            return _product(x, lw.w_in_t, lw.b_in, self.t_in, self.activation, self.gated)
        return act(linear_rows(x, lw.w_in, lw.b_in), self.activation, self.gated, self.n)
