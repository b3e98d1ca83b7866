"""One tensor-parallel rank's share of a decoder's weights, Megatron layout (Deja Vu §5.1).

The paper times OPT-175B on 8 A100s with tensor parallelism (Megatron-LM: Shoeybi et al. 2019,
§3; apex in DejaVu's code). Rank ``r`` of ``W`` holds:

- attention: query heads ``[r H/W, (r+1) H/W)`` and KV heads ``[r Hkv/W, (r+1) Hkv/W)`` — whole
  GQA groups, since query head ``h`` reads KV head ``h // (H/Hkv)`` — as the rows of ``W_QKV``
  (column-parallel: ``[q_local; k_local; v_local]``, the layout :mod:`.weights` uses) and of
  ``W_O^T`` (row-parallel); its KV cache holds its KV heads only;
- MLP: neurons ``[r n/W, (r+1) n/W)`` as rows of ``fc1`` (or of gate and of up: ``[gate_local;
  up_local]``) and of ``W2^T``;
- the row-parallel biases (``o_proj``, ``fc2``/``down``) on rank 0 only, so the all-reduce of
  the ranks' partial outputs adds them once;
- norms, token and position embeddings replicated (a lookup reads one row: nothing to share);
- ``lm_head`` vocab-parallel by default: rows ``[r V_l, (r+1) V_l)``, ``V_l = ceil(V/W)`` (the
  last shard padded with zero rows), the logits all-gathered. At OPT-175B on 8 ranks the
  replicated ``lm_head`` is 1.24 GB per rank, ~0.3 ms of a sparse step of ~3 ms at 4.2 TB/s,
  against one all-gather of 100 KB (~15-25 µs over NVLink); ``vocab_parallel=False`` replicates
  it (the benchmark times both).

The arch of a :class:`ShardedWeights` reports the *local* head and neuron counts, so the
single-GPU :class:`~dejavu_lab.engine.Decoder` code runs unchanged on a shard; only the block
outputs and logits need collectives (:class:`~dejavu_lab.engine.tp.TPDecoder`).
:func:`random_shard` builds a rank's shard at a preset shape directly on its device (OPT-66B,
OPT-175B: never the whole model on one device, nor on the host).

>>> from dejavu_lab.engine import decoder_weights
>>> from dejavu_lab.models import random_model
>>> full = decoder_weights(random_model("tiny-llama").model)  # 4 heads, 2 KV heads, 192 neurons
>>> w = shard_weights(full, rank=1, world_size=2)  # computed locally: no process group needed
>>> w.arch.n_heads, w.arch.n_kv_heads, w.arch.d_mlp, tuple(w.lm_head.shape)
(2, 1, 96, (64, 64))
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from ..arch import Arch, get_arch
from .config import EngineError
from .weights import ENGINE_TYPES, DecoderWeights, LayerWeights, _activation

__all__ = ["ShardedWeights", "TPShard", "random_shard", "shard_weights", "tp_shard"]

INIT_STD = 0.02  # OPT's init_std and Llama's initializer_range: random weights for timing


@dataclass(frozen=True)
class TPShard:
    """What rank ``rank`` of ``world_size`` holds: ``[start, stop)`` of each sharded dimension.

    >>> from dejavu_lab.models import PRESETS
    >>> s = tp_shard(get_arch(PRESETS["opt-175b"].config()), 7, 8, vocab=50272)
    >>> s.heads, s.kv_heads, s.neurons, s.vocab, s.vocab_rows  # of 96 heads, 49152 neurons
    ((84, 96), (84, 96), (43008, 49152), (43988, 50272), 6284)
    """

    rank: int
    world_size: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # key/value heads (== heads without GQA)
    neurons: tuple[int, int]  # MLP neurons
    vocab: tuple[int, int]  # lm_head rows held (vocab-parallel); the shard has vocab_rows rows
    vocab_rows: int  # ceil(V / world_size): rows of every lm_head shard (zero rows pad the last)


def _and(items: list[str], word: str = "and") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {word} {items[-1]}"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_shard(arch: Arch, rank: int, world_size: int, *, vocab: int) -> TPShard:
    """The ranges rank ``rank`` of ``world_size`` holds (full ``arch``); :class:`EngineError`
    when ``world_size`` does not divide the heads, KV heads or neurons.

    >>> from dejavu_lab.models import random_model
    >>> tp_shard(random_model("tiny-llama").arch, 0, 2, vocab=128).kv_heads
    (0, 1)
    >>> tp_shard(random_model("tiny-llama").arch, 0, 4, vocab=128)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: tensor parallelism over 4 ranks splits the heads and MLP neurons evenly, but 4 does not divide the 2 KV heads; run on 2 ranks.
    """
    W = world_size
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise EngineError(
            f"world_size must be a whole number of ranks >= 1, got {W!r}; pass e.g. 2."
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < W:
        raise EngineError(
            f"rank must be a whole number in [0, {W - 1}], got {rank!r}; pass "
            "torch.distributed.get_rank()."
        )
    H, Hkv, n = arch.n_heads, arch.n_kv_heads, arch.d_mlp
    bad = [f"the {k} {what}{'s' if k != 1 else ''}" for k, what in
           ((H, "query head"), (Hkv, "KV head"), (n, "MLP neuron")) if k % W]  # fmt: skip
    if bad:
        ok = [str(k) for k in _divisors(math.gcd(H, Hkv, n)) if 1 < k <= 64]
        fix = f"run on {_and(ok, 'or')} ranks" if ok else "run it on one process (Decoder)"
        raise EngineError(
            f"tensor parallelism over {W} ranks splits the heads and MLP neurons evenly, but "
            f"{W} does not divide {_and(bad)}; {fix}."
        )

    def part(k: int) -> tuple[int, int]:
        return (rank * k // W, (rank + 1) * k // W)

    rows = -(-vocab // W)
    return TPShard(rank, W, part(H), part(Hkv), part(n),
                   (min(rank * rows, vocab), min((rank + 1) * rows, vocab)), rows)  # fmt: skip


@dataclass
class ShardedWeights(DecoderWeights):
    """A rank's :class:`DecoderWeights`: ``arch`` reports the local heads and neurons,
    ``full_arch`` the model's; ``lm_head`` is ``[vocab_rows, d_embed]`` when vocab-parallel.

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> w = shard_weights(decoder_weights(random_model("tiny-opt").model), rank=1, world_size=2)
    >>> w.full_arch.n_heads, w.arch.n_heads, w.shard.heads, w.layers[0].b_o is None  # bias: rank 0
    (4, 2, (2, 4), True)
    """

    full_arch: Arch  # the whole model's shape
    shard: TPShard  # the ranges this rank holds
    vocab: int  # the model's vocabulary (logits columns)
    vocab_parallel: bool  # lm_head sharded by vocabulary rows (else replicated)


def _local_arch(arch: Arch, s: TPShard) -> Arch:
    W = s.world_size
    return dataclasses.replace(
        arch, n_heads=arch.n_heads // W, n_kv_heads=arch.n_kv_heads // W, d_mlp=arch.d_mlp // W
    )


def _blocks(t, dim: int, spans, device) -> torch.Tensor | None:
    """``cat`` of the ``(start, length)`` spans of ``t`` along ``dim``, on ``device``."""
    if t is None:
        return None
    parts = [t.narrow(dim, a, k).to(device) for a, k in spans]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)


def shard_weights(w: DecoderWeights, rank: int, world_size: int, *, vocab_parallel: bool = True,
                  device: str | torch.device | None = None) -> ShardedWeights:  # fmt: skip
    """Rank ``rank``'s share of the full weights ``w`` (see module doc), on ``device`` (default:
    where ``w`` is; row blocks there are views of ``w``).

    >>> from dejavu_lab.engine import decoder_weights
    >>> from dejavu_lab.models import random_model
    >>> full = decoder_weights(random_model("tiny-opt").model)  # 4 heads of 16, 256 neurons
    >>> ws = [shard_weights(full, r, 2) for r in range(2)]
    >>> tuple(ws[0].layers[0].w_qkv.shape), tuple(ws[0].layers[0].w_down_t.shape)
    ((96, 64), (128, 64))
    >>> x = torch.randn(1, 256)  # the MLP's hidden activations: row-parallel W2 sums the shares
    >>> parts = [x[:, 128 * r : 128 * (r + 1)] @ ws[r].layers[0].w_down_t for r in range(2)]
    >>> torch.allclose(sum(parts), x @ full.layers[0].w_down_t, atol=1e-5)
    True
    """
    if isinstance(w, ShardedWeights):
        raise EngineError(
            "these weights are already one rank's shard; pass the full weights "
            "(decoder_weights(model))."
        )
    a, V = w.arch, w.lm_head.shape[0]
    s = tp_shard(a, rank, world_size, vocab=V)
    dev = torch.device(device) if device is not None else w.device
    dh, H, Hkv, n = a.d_head, a.n_heads, a.n_kv_heads, a.d_mlp
    (h0, h1), (k0, k1), (n0, n1) = s.heads, s.kv_heads, s.neurons
    qkv = [(h0 * dh, (h1 - h0) * dh), ((H + k0) * dh, (k1 - k0) * dh),
           ((H + Hkv + k0) * dh, (k1 - k0) * dh)]  # fmt: skip
    mlp = [(n0, n1 - n0)] + ([(n + n0, n1 - n0)] if a.gated else [])

    def move(t):
        return None if t is None else t.to(dev)

    def norm(p):
        return None if p is None else (move(p[0]), move(p[1]), p[2])

    first = rank == 0
    layers = [
        LayerWeights(
            ln_attn=norm(lw.ln_attn),
            ln_mlp=norm(lw.ln_mlp),
            w_qkv=_blocks(lw.w_qkv, 0, qkv, dev),
            w_qkv_t=_blocks(lw.w_qkv_t, 1, qkv, dev),
            b_qkv=_blocks(lw.b_qkv, 0, qkv, dev),
            w_o_t=_blocks(lw.w_o_t, 0, qkv[:1], dev),
            b_o=move(lw.b_o) if first else None,
            w_in=_blocks(lw.w_in, 0, mlp, dev),
            w_in_t=_blocks(lw.w_in_t, 1, mlp, dev),
            b_in=_blocks(lw.b_in, 0, mlp, dev),
            w_down_t=_blocks(lw.w_down_t, 0, [(n0, n1 - n0)], dev),
            b_down=move(lw.b_down) if first else None,
        )  # fmt: skip
        for lw in w.layers
    ]
    lm_head = w.lm_head.to(dev)
    if vocab_parallel:
        v0, v1 = s.vocab
        lm_head = torch.zeros(s.vocab_rows, lm_head.shape[1], dtype=w.dtype, device=dev)
        lm_head[: v1 - v0] = w.lm_head[v0:v1]
    rotary = w.rotary
    if rotary is not None and dev != w.device:
        rotary = copy.deepcopy(rotary).to(dev)  # nn.Module.to moves in place: not the HF model's
    return ShardedWeights(
        arch=_local_arch(a, s), layers=layers, embed=move(w.embed), pos_embed=move(w.pos_embed),
        pos_offset=w.pos_offset, project_in=move(w.project_in), project_out=move(w.project_out),
        final_norm=norm(w.final_norm), lm_head=lm_head, norm=w.norm, activation=w.activation,
        rotary=rotary, max_positions=w.max_positions, full_arch=a, shard=s, vocab=V,
        vocab_parallel=vocab_parallel,
    )  # fmt: skip


def random_shard(preset, rank: int, world_size: int, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float16, seed: int = 0, vocab_parallel: bool = True,
                 layout: str = "rows", **overrides) -> ShardedWeights:  # fmt: skip
    """Rank ``rank``'s shard of a random-weight model at a preset shape (or a config), built on
    ``device`` tensor by tensor (N(0, 0.02) weights, unit norms): the whole model never exists.

    Replicated tensors (embeddings, norms) are drawn from ``seed`` alone, so every rank holds the
    same; the sharded ones from ``(seed, rank)``. For timing: these are not the shards of one
    :func:`~dejavu_lab.models.random_model`.

    >>> w = random_shard("tiny-llama", 1, 2, dtype=torch.float32)
    >>> w.arch.n_heads, tuple(w.layers[0].w_qkv.shape), tuple(w.layers[0].w_in.shape)
    (2, (64, 64), (192, 64))
    >>> random_shard("opt-175b", 0, 5, device="meta")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.EngineError: tensor parallelism over 5 ranks splits the heads and MLP neurons evenly, but 5 does not divide the 96 query heads, the 96 KV heads and the 49152 MLP neurons; run on 2, 3, 4, 6, 8, 12, 16, 24, 32 or 48 ranks.
    """
    from ..models import PRESETS, ModelNotFoundError

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ModelNotFoundError(
                f"Unknown preset {preset!r}; choose one of {', '.join(PRESETS)}."
            )
        cfg = PRESETS[preset].config(**overrides)
    else:
        cfg = preset
    a = get_arch(cfg)
    if a.model_type not in ENGINE_TYPES:
        raise EngineError(
            f"the engine runs {', '.join(ENGINE_TYPES)} blocks; {a.model_type!r} is not one of "
            "them: use an OPT or Llama preset."
        )
    V, d = cfg.vocab_size, a.d_model
    s = tp_shard(a, rank, world_size, vocab=V)
    dev, opt = torch.device(device), a.family == "opt"
    g_all = torch.Generator(device=dev if dev.type != "meta" else "cpu").manual_seed(seed)
    g_own = torch.Generator(device=g_all.device).manual_seed(seed * 10007 + 1 + rank)

    def rnd(*shape, g=g_own, std=INIT_STD):
        t = torch.empty(shape, dtype=dtype, device=dev)
        return t if dev.type == "meta" else t.normal_(0.0, std, generator=g)

    def full(value, *shape):
        return torch.full(shape, value, dtype=dtype, device=dev)

    eps = 1e-5 if opt else float(getattr(cfg, "rms_norm_eps", 1e-6))
    bias = (
        bool(getattr(cfg, "enable_bias", True))
        if opt
        else bool(getattr(cfg, "attention_bias", False))
    )
    mlp_bias = bias if opt else bool(getattr(cfg, "mlp_bias", False))

    def ln():
        return (full(1.0, d), full(0.0, d) if opt else None, eps)

    la = _local_arch(a, s)
    hl, kvl, nl, dh = la.n_heads, la.n_kv_heads, la.d_mlp, a.d_head
    n_in = (2 if a.gated else 1) * nl
    layers = [
        LayerWeights(
            ln_attn=ln(),
            ln_mlp=ln(),
            w_qkv=rnd((hl + 2 * kvl) * dh, d),
            w_qkv_t=None,
            b_qkv=rnd((hl + 2 * kvl) * dh) if bias else None,
            w_o_t=rnd(hl * dh, d),
            b_o=rnd(d) if bias and rank == 0 else None,
            w_in=rnd(n_in, d),
            w_in_t=None,
            b_in=rnd(n_in) if mlp_bias else None,
            w_down_t=rnd(nl, d),
            b_down=rnd(d) if mlp_bias and rank == 0 else None,
        )  # fmt: skip
        for _ in range(a.n_layers)
    ]
    d_embed = getattr(cfg, "word_embed_proj_dim", None) or d
    lm_head = rnd(
        s.vocab_rows if vocab_parallel else V, d_embed, g=g_own if vocab_parallel else g_all
    )
    if vocab_parallel and s.vocab[1] - s.vocab[0] < s.vocab_rows and dev.type != "meta":
        lm_head[s.vocab[1] - s.vocab[0] :] = 0  # past the vocabulary: zero rows, sliced off
    rotary, P = None, int(getattr(cfg, "sliding_window", None) or 1 << 20)
    if not opt:
        from ..models import random_model

        one = copy.deepcopy(cfg)
        one.num_hidden_layers = 1  # only its rotary module's class is wanted
        rot = random_model(one, device="meta").model.model.rotary_emb
        rotary = type(rot)(config=cfg).to(dev)
    else:
        P = cfg.max_position_embeddings
    w = ShardedWeights(
        arch=la, layers=layers, embed=rnd(V, d_embed, g=g_all),
        pos_embed=rnd(P + 2, d, g=g_all) if opt else None, pos_offset=2 if opt else 0,
        project_in=rnd(d, d_embed, g=g_all) if d_embed != d else None,
        project_out=rnd(d_embed, d, g=g_all) if d_embed != d else None,
        final_norm=ln() if (a.pre_ln or not opt) else None, lm_head=lm_head,
        norm="layer" if opt else "rms", activation=_activation(a), rotary=rotary,
        max_positions=P, full_arch=a, shard=s, vocab=V, vocab_parallel=vocab_parallel,
    )  # fmt: skip
    return w if layout == "rows" else w.set_layout(layout)
