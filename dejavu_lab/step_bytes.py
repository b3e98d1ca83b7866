"""The bytes one batch-1 decode step reads: the one count behind every speed and equal-bytes figure.

Generating one token at batch size 1 is bound by memory bandwidth (Deja Vu §2.2): its time is,
to first order, the bytes read divided by the bandwidth. Contextual sparsity cuts those bytes
(§4.4), and methods that sparsify different matrices are compared at equal bytes, not at equal
"sparsity". A kept unit of each site reads, per decoder layer:

===========  ==========================================  =====================================
site         what a kept unit reads                      elements at full keep
===========  ==========================================  =====================================
attn_in      a column of W_Q, W_K and W_V (TEAL, WINA)   d · (h·dh + 2·kv·dh)
o_in         a column of W_O                             h·dh · d
mlp_in       a column of W_gate and W_up (or W1)         (1 or 2) · n · d
down_in      a column of W_down (W2)                     n · d
gate         CATS: a row of W_up and column of W_down    2 · n · d (ReLU MLPs: n · d)
             (W_gate is always read in full)
mlp          a neuron: rows of W_gate/W_up, col of W2    (2 or 3) · n · d
heads        a query head: rows of W_Q, cols of W_O      2 · h·dh · d
kv           a key/value head: rows of W_K and W_V       2 · kv·dh · d
kv_cache     a key/value head's cached keys and values   2 · kv·dh · context
===========  ==========================================  =====================================

Each part (attention, MLP, KV cache) reads its dense bytes less what its sites skip:
``Σ_layers (dense − Σ_sites elements · (1 − kept))`` times the element size, with ``kept`` the
share of units a site kept — one number for every layer (``{"mlp": 0.15}``) or one per layer
(``{(3, "mlp"): 0.15}``), averaged over tokens where a threshold keeps a different number for
each (bytes are linear in it). The unembedding (``vocab × d``) and the predictors are read in
full; the embedding row and the norms and biases are left out (under 0.1% of a layer).

Methods that read weights besides the kept columns add them as extra elements per token (the
``predictors`` bytes here; :func:`bytes_per_token_fraction`'s ``extra_elements``): DejaVu's
predictors, LaRoSA's residual-stream rotation where its basis changes between layers (one
d × d matrix per turn; :mod:`dejavu_lab.sparsify.larosa`), R-Sparse's low-rank factors
(``r · (d_in + d_out)`` per site; :mod:`dejavu_lab.sparsify.rsparse`). Their kept columns are
columns of the folded weights (``W Q``), the same size as ``W``'s, so the table holds for them.

Three readings of a sparse step use this one count:

- what our engine (:class:`dejavu_lab.engine.Decoder`) reads — :func:`step_bytes`'s
  ``mlp_kept``/``head_kept`` (DejaVu: under multi-head attention deferred KV reads the kept
  heads' W_K/W_V rows, under GQA every K/V head; every head's KV cache) or ``site_kept``
  (TEAL, WINA, CATS), and fp32 predictors with their biases (:func:`predictor_bytes`);
- the paper's ideal (:mod:`dejavu_lab.bytes_model`): a skipped head saves its share of the KV
  cache too, under GQA a K/V head is skipped when no query head of its group is kept (in
  expectation over random choices), predictors count at the weights' width without biases.
  A little below the engine's: OPT-6.7B at 85% MLP and 50% head sparsity, context 512,
  predictors of rank 64 and 32, reads 4.30 GB per token in the engine's reading and 4.07 GB in
  the paper's;
- quality at equal bytes (:func:`dejavu_lab.sparsify.sparse_eval`): the decoder-layer weights
  only, against dense, from the kept fractions each site realised
  (:func:`bytes_per_token_fraction`).

**4-bit weights** (:mod:`dejavu_lab.quant.int4`, ``int4_group=g``): a weight costs half a byte
of code, and each group of ``g`` input channels of each output adds a scale and a min
(``2 · scale_esize`` bytes). A kept unit reads its codes; the scales travel differently by the
way a site reads its matrix:

- *rows* (a neuron's or head's output rows: W_gate/W_up under DejaVu and CATS, W_Q, W_K, W_V)
  own their scales: a kept row reads ``g`` codes and one (scale, min) per group — skipping it
  skips both;
- *columns* (input channels: every threshold site, W_down's and W_O's columns) share them: a
  group's scales are read when **any** of its channels is kept. With channels kept
  independently at rate ``f`` that is ``1 − (1 − f)^(g/u)`` of the groups (``u`` channels per
  unit: 1, or ``d_head`` for a head's W_O columns, a head being whole groups when ``g ≤ u``) —
  at 50% kept and ``g = 128`` every group; pass ``touched`` (:func:`groups_touched` of the real
  masks) for the exact count.

So 4-bit plus sparsity does not multiply quite as the payload does: at ``g = 128`` and fp16
scales the scales are 1/16 of the codes, read in full as soon as the channels' sparsity is
unstructured. The KV cache and the unembedding stay at ``esize``.

``arch`` is anything with ``n_layers``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``d_head``,
``d_mlp`` and ``gated`` (:class:`dejavu_lab.arch.Arch`, the engine weights' ``arch``).
"""

from __future__ import annotations

from collections.abc import Mapping

from .vocab import site_width

__all__ = [
    "bytes_per_token_fraction",
    "groups_touched",
    "int4_site_split",
    "layer_elements",
    "predictor_bytes",
    "site_elements",
    "step_bytes",
]

# the part of a step each site's units belong to
_PART = {
    "attn_in": "attention",
    "o_in": "attention",
    "heads": "attention",
    "kv": "attention",
    "mlp_in": "mlp",
    "down_in": "mlp",
    "gate": "mlp",
    "mlp": "mlp",
    "kv_cache": "kv_cache",
}


def site_elements(arch) -> dict[str, int]:
    """Weight elements a layer reads for each site at full keep (the table above).

    >>> from dejavu_lab.models import random_model
    >>> site_elements(random_model("tiny-llama").arch)["attn_in"]  # 64 · (64 + 2·32)
    8192
    """
    d, n, dh = arch.d_model, arch.d_mlp, arch.d_head
    q, kv = arch.n_heads * dh, arch.n_kv_heads * dh
    n_in = 2 if arch.gated else 1  # matrices reading the MLP input: gate + up, or W1

    def width(site: str) -> int:  # one column per entry of the site's input vector
        return site_width(arch, site)

    return {
        "attn_in": width("attn_in") * (q + 2 * kv),
        "o_in": width("o_in") * d,
        "mlp_in": width("mlp_in") * n_in * n,
        "down_in": width("down_in") * d,
        "gate": width("gate") * (2 * d if arch.gated else d),  # W_up rows + W_down cols, or W2 cols
        "mlp": (n_in + 1) * n * d,
        "heads": 2 * q * d,
        "kv": 2 * kv * d,
    }


def int4_site_split(arch) -> dict[str, tuple[int, int, int]]:
    """Per site: (elements read as output rows, as input columns, input channels per unit).

    Rows and columns add up to :func:`site_elements`; the split decides where a 4-bit format's
    scales are read (the module docstring).

    >>> from dejavu_lab.models import random_model
    >>> arch = random_model("tiny-llama").arch
    >>> split = int4_site_split(arch)
    >>> split["heads"], split["attn_in"]  # W_Q rows + W_O columns (16 channels per head)
    ((4096, 4096, 16), (0, 8192, 1))
    >>> all(r + c == site_elements(arch)[s] for s, (r, c, _) in split.items())
    True
    """
    d, n, dh = arch.d_model, arch.d_mlp, arch.d_head
    q, kv = arch.n_heads * dh, arch.n_kv_heads * dh
    e = site_elements(arch)
    gate_rows = site_width(arch, "gate") * d if arch.gated else 0  # W_up's rows; W_down's columns
    return {
        "attn_in": (0, e["attn_in"], 1),
        "o_in": (0, e["o_in"], 1),
        "mlp_in": (0, e["mlp_in"], 1),
        "down_in": (0, e["down_in"], 1),
        "gate": (gate_rows, e["gate"] - gate_rows, 1),
        "mlp": (e["mlp"] - n * d, n * d, 1),
        "heads": (q * d, q * d, dh),
        "kv": (2 * kv * d, 0, dh),
    }


def groups_touched(kept, group: int, unit: int = 1):
    """Share of a matrix's scale groups read when input channels are kept.

    ``kept``: a kept fraction (float; channels kept independently — the expectation
    ``1 − (1 − kept)^(group / unit)``), or a bool mask ``[..., channels]`` (per token; the exact
    share of groups with a kept channel, averaged over the leading dims). ``unit``: channels
    per kept unit (``d_head`` for a head's W_O columns; 1 for a channel).

    >>> round(groups_touched(0.5, 128), 6), round(groups_touched(0.05, 32), 3)
    (1.0, 0.806)
    >>> import torch
    >>> mask = torch.zeros(2, 256, dtype=torch.bool)
    >>> mask[0, 0] = mask[1, 200] = mask[1, 201] = True  # one group in token 0, one in token 1
    >>> groups_touched(mask, 128)
    0.5
    """
    if isinstance(kept, (int, float)):
        if not 0 <= kept <= 1:
            raise ValueError(f"kept must be a fraction in [0, 1], got {kept!r}.")
        return 1 - (1 - kept) ** max(1.0, group / unit)
    n = kept.shape[-1]
    if n % group:
        raise ValueError(f"{n} channels do not split into groups of {group}.")
    any_kept = kept.reshape(*kept.shape[:-1], n // group, group).any(dim=-1)
    return float(any_kept.double().mean())


def layer_elements(arch) -> int:
    """Weight elements of one dense decoder layer (attention + MLP matrices).

    >>> from dejavu_lab.models import random_model
    >>> layer_elements(random_model("tiny-llama").arch)  # 8192 + 4096 + 3 · 192 · 64
    49152
    """
    e = site_elements(arch)
    return e["attn_in"] + e["o_in"] + e["mlp"]


def predictor_bytes(
    arch,
    mlp_rank: int,
    head_rank: int,
    esize: int = 4,
    *,
    biases: bool = True,
    mlp_layers: int | None = None,
    head_layers: int | None = None,
) -> int:
    """Weights of DejaVu's low-rank predictors (d -> r -> n, plus the output bias).

    ``esize`` 4: our predictors are fp32 (:mod:`dejavu_lab.predictors`). ``mlp_layers`` and
    ``head_layers``: how many layers run each predictor (every layer by default).

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> arch = get_arch(PRESETS["opt-6.7b"].config())
    >>> round(predictor_bytes(arch, mlp_rank=64, head_rank=32) / 1e6, 1)  # MB, fp32
    186.8
    """
    d, n, h = arch.d_model, arch.d_mlp, arch.n_heads
    b = 1 if biases else 0
    mlp = d * mlp_rank + mlp_rank * n + b * n
    heads = d * head_rank + head_rank * h + b * h
    if mlp_layers is None and head_layers is None:
        return arch.n_layers * (mlp + heads) * esize
    mlp_layers = arch.n_layers if mlp_layers is None else mlp_layers
    head_layers = arch.n_layers if head_layers is None else head_layers
    return (mlp_layers * mlp + head_layers * heads) * esize


def step_bytes(
    arch,
    kept: Mapping | None = None,
    *,
    vocab: int,
    context: int,
    mlp_kept: float = 1.0,
    head_kept: float = 1.0,
    site_kept: Mapping[str, float] | None = None,
    predictors: float = 0,
    esize: int = 2,
    d_embed: int | None = None,
    int4_group: int | None = None,
    scale_esize: int = 2,
    touched: Mapping | None = None,
) -> dict[str, float]:
    """Bytes per decode step by part: attention, mlp, kv_cache, lm_head, predictors, total.

    ``kept``: the kept fraction per site of the table above, for every layer (``{"mlp": 0.15}``)
    or per layer (``{(0, "mlp"): 0.15}``); sites not named are read in full. ``context``: the
    cached positions attended. ``predictors``: bytes (:func:`predictor_bytes`; 0 for dense).
    ``esize``: bytes per weight (2 for fp16/bf16). ``d_embed``: the unembedding's width when it
    is not ``d_model`` (OPT-350m).

    ``int4_group``: the decoder layers' weights in group-wise int4 with groups of this many input
    channels and ``scale_esize``-byte scales and mins (the module docstring); ``touched``: the
    share of scale groups a column site reads, keyed as ``kept`` (default: the independence
    estimate, :func:`groups_touched`). The KV cache and the unembedding stay at ``esize``.

    What our engine keeps, added to ``kept``: ``mlp_kept``/``head_kept`` — DejaVu's kept
    neurons and query heads (with multi-head attention, deferred KV keeps the K/V heads of the
    kept query heads; under GQA it reads every K/V head); or ``site_kept`` — TEAL/WINA
    (``attn_in``, ``o_in``, ``mlp_in``, ``down_in``) or CATS (``gate``), which replaces
    ``mlp_kept``/``head_kept``. Name one site per matrix (``mlp`` or ``mlp_in`` + ``down_in``,
    not both): overlapping sites would each count the same skipped bytes.

    >>> from dejavu_lab.arch import get_arch
    >>> from dejavu_lab.models import PRESETS
    >>> arch = get_arch(PRESETS["opt-6.7b"].config())
    >>> dense = step_bytes(arch, vocab=50272, context=512)
    >>> sparse = step_bytes(arch, vocab=50272, context=512, mlp_kept=0.15, head_kept=0.5,
    ...                     predictors=predictor_bytes(arch, 64, 32))
    >>> round(dense["total"] / 1e9, 1), round(sparse["total"] / 1e9, 1)  # GB per token
    (13.6, 4.3)
    >>> llama = get_arch(PRESETS["llama-2-13b"].config())
    >>> half = dict.fromkeys(("attn_in", "o_in", "mlp_in", "down_in"), 0.5)
    >>> teal = step_bytes(llama, vocab=32000, context=512, site_kept=half)
    >>> cats = step_bytes(llama, vocab=32000, context=512, site_kept={"gate": 0.5})
    >>> [round(b["mlp"] / step_bytes(llama, vocab=32000, context=512)["mlp"], 3)
    ...  for b in (teal, cats)]  # CATS reads the gate densely
    [0.5, 0.667]
    >>> step_bytes(arch, {(0, "mlp"): 0.5}, vocab=0, context=0)["mlp"] / dense["mlp"]
    0.984375
    >>> from types import SimpleNamespace  # any object with the shape's fields
    >>> shape = SimpleNamespace(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_head=16,
    ...                         d_mlp=192, gated=True)
    >>> step_bytes(shape, vocab=128, context=8).values()  # parts in the order of the first line
    dict_values([49152.0, 147456.0, 2048, 16384, 0.0, 215040.0])

    4-bit (group 128, fp16 scales): the layers read 0.5 + 4/128 bytes per weight, a quarter of
    fp16 and a bit more; TEAL at 50% halves the codes but not the scales:

    >>> q4 = step_bytes(llama, vocab=32000, context=512, int4_group=128)
    >>> q4_teal = step_bytes(llama, vocab=32000, context=512, int4_group=128, site_kept=half)
    >>> fp = step_bytes(llama, vocab=32000, context=512)
    >>> [round(b["mlp"] / fp["mlp"], 4) for b in (q4, q4_teal)]
    [0.2656, 0.1406]
    """
    L = arch.n_layers
    e = site_elements(arch)
    e["kv_cache"] = 2 * arch.n_kv_heads * arch.d_head * context
    items = list((kept or {}).items())
    if site_kept is not None:
        items += site_kept.items()
    else:
        mha = arch.n_heads == arch.n_kv_heads
        items += [("mlp", mlp_kept), ("heads", head_kept), ("kv", head_kept if mha else 1.0)]
    touched = dict(touched or {})
    split = int4_site_split(arch) if int4_group else {}
    # Each part: its elements no site names, read in full (an exact integer), plus each named
    # site's elements times its kept fraction. Summing what is read rather than subtracting
    # what is skipped keeps small kept fractions accurate to the last digit.
    whole = {"attention": L * (e["attn_in"] + e["o_in"]), "mlp": L * e["mlp"]}
    whole["kv_cache"] = L * e["kv_cache"]
    kept_read = {"attention": 0.0, "mlp": 0.0, "kv_cache": 0}  # a full cache: an int, as recorded
    scale_read = {"attention": 0.0, "mlp": 0.0}  # int4: weight elements whose scales are read
    scale_whole = {"attention": whole["attention"], "mlp": whole["mlp"]}
    for key, f in items:
        layers, site = (1, key[1]) if isinstance(key, tuple) else (L, key)
        if site not in _PART:
            raise KeyError(f"unknown site {site!r}; sites are {', '.join(_PART)}")
        part = _PART[site]
        whole[part] -= e[site] * layers
        kept_read[part] += e[site] * f * layers
        if split and part in scale_read:
            rows, cols, unit = split[site]
            t = touched.get(key, touched.get(site))
            t = groups_touched(f, int4_group, unit) if t is None else t
            scale_whole[part] -= e[site] * layers
            scale_read[part] += (rows * f + cols * t) * layers
    parts = {p: (whole[p] + kept_read[p]) * esize for p in ("attention", "mlp", "kv_cache")}
    if split:
        per_element = 2 * scale_esize / int4_group  # a scale and a min per group of weights
        for p in ("attention", "mlp"):
            parts[p] = (whole[p] + kept_read[p]) * 0.5 + (
                scale_whole[p] + scale_read[p]
            ) * per_element
    parts |= {
        "lm_head": vocab * (d_embed or arch.d_model) * esize,
        "predictors": float(predictors),
    }
    parts["total"] = sum(parts.values())
    return parts


def bytes_per_token_fraction(
    arch, kept: Mapping[tuple[int, str], float], extra_elements: float = 0.0
) -> float:
    """Decoder-layer weight bytes read per token against dense, from kept fractions per site.

    ``kept``: ``{(layer, site): fraction kept}`` (sites missing read in full).
    ``extra_elements``: weights read besides the layers' (e.g. DejaVu's predictors), per token.

    >>> from dejavu_lab.models import random_model
    >>> arch = random_model("tiny-llama").arch
    >>> round(bytes_per_token_fraction(arch, {(0, "mlp"): 0.5, (1, "mlp"): 0.5}), 4)  # MLP 3/4
    0.625
    """
    b = step_bytes(arch, kept, vocab=0, context=0, predictors=extra_elements, esize=1)
    return (b["attention"] + b["mlp"] + b["predictors"]) / (arch.n_layers * layer_elements(arch))
