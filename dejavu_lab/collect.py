"""Collect training data for DejaVu's sparsity predictors, streamed to disk (§4.1–4.2).

DejaVu trains one small classifier per layer on (block input, which units were active) pairs
gathered by running the dense model over text (the paper's "500 token sequences"). Here one forward
of ``chunk_windows`` windows writes one chunk file holding, for every layer ``l`` and token:

==========  ===================  ==========================================================
key         shape, dtype         what
==========  ===================  ==========================================================
``l.pre``   [T, d] fp16          ``blocks.l.hook_resid_pre``: layer input (head predictor)
``l.mid``   [T, d] fp16          ``blocks.l.hook_resid_mid``: MLP input (same-layer MLP)
``l.mlp``   [T, ⌈n/8⌉] uint8     packed bits: neuron active (ReLU: > 0; gated: in the top
                                 (1 − ``mlp_label_sparsity``) by ``|act|``, CATS/TEAL-style)
``l.head``  [T, h] fp16          per-head output norm ‖z_h W_O,h‖ (labels at any budget)
==========  ===================  ==========================================================

Chunks and the ``manifest.json`` (naming the model fingerprint and the config) are written
atomically (:mod:`dejavu_lab.atomic`: a temporary name unique to the process, fsync, rename), so a
kill at any instant leaves whole files only; rerunning with the same arguments skips finished
chunks, so an interrupted collection resumes with byte-identical data. A process holds a lock on
the folder while it collects: a second one collecting into the same folder waits for it, then
finds the chunks done. Only one chunk is ever in memory; ``max_tokens`` caps the total.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from . import atomic
from .arch import Arch, get_arch
from .budgets import head_gram, head_output_norms, n_keep, topk_mask
from .checks import configs as check_configs
from .checks import files as check_files
from .checks import tokens as check_tokens
from .checks.scalars import integer
from .corpus import CorpusError, load_text, token_windows
from .errors import CollectionError
from .hooks import hooks
from .vocab import COLLECTION_FORMAT, FINGERPRINT_VERSION, fingerprint_id

__all__ = [
    "default_dir",
    "fingerprint_id",
    "CollectConfig",
    "CollectionError",
    "Collection",
    "collect",
    "fingerprint",
    "note_stale",
    "open_collection",
    "pack_bits",
    "unpack_bits",
]

FORMAT = COLLECTION_FORMAT


@dataclass(frozen=True)
class CollectConfig:
    """What to collect. Every field enters the cache key.

    >>> cfg = CollectConfig(window=64, max_tokens=256)
    >>> cfg.max_tokens // cfg.window, cfg.key()  # windows collected, cache key
    (4, '892ff98b47')
    """

    corpus: str = "demo"  # dejavu_lab.corpus.load_text name
    window: int = 512  # tokens per window (DejaVu: sequences of length ≥ 500)
    max_tokens: int = 8192  # cap on collected tokens (whole windows)
    chunk_windows: int = 1  # windows per forward and per chunk file
    mlp_label_sparsity: float = 0.5  # gated MLPs: label the top (1 - s) by |act| as active
    skip_windows: int = 0  # start after this many windows (keep evaluation text apart)

    def __post_init__(self):
        check_configs.collect_config(self)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


# model -> (what its tensors were when hashed, the fingerprint): hashing every weight takes ~0.3 s
# for the demo model on one core, and every sparsified() block checks its thresholds/predictors
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHUNK = 1 << 24  # bytes hashed per step: a GPU tensor crosses to the host 16 MiB at a time


def fingerprint(
    model, arch: Arch | None = None, *, fresh: bool = False, weights: bool = True
) -> dict:
    """Architecture, shapes and a sha256 of every parameter and buffer: what tells two models
    apart, and the key of every cached file made from a model (collections, calibrations,
    thresholds, predictors).

    The digest covers each tensor's name, dtype, shape and bytes, streamed in 16 MiB slices (a
    GPU tensor is copied to the host one slice at a time; CPU tensors are read in place): one
    weight changed anywhere gives another fingerprint. The result is remembered per model until
    one of its tensors is replaced, moved or changed in place (torch's version counter); a
    write that bypasses the counter (``param.data[...] = ...``, numpy) is not seen: pass
    ``fresh=True`` after one. Tensors on the meta device have no bytes: their names and shapes
    are hashed, and the fingerprint says ``"weights": "meta"``; so does ``weights=False``, for
    what needs the model's shape only (random predictors timed by a speed benchmark, where
    hashing tens of GB would cost half a minute).

    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama").model
    >>> fp = fingerprint(m)
    >>> fp["model_type"], fp["n_layers"], fp["d_mlp"], fp["gated"], fp["version"]
    ('llama', 2, 192, True, 2)
    >>> fingerprint(random_model("tiny-llama", seed=1).model) == fp  # other weights
    False
    >>> with torch.no_grad():
    ...     m.model.layers[-1].mlp.down_proj.weight[-1, -1] += 1e-3  # one weight of the last row
    >>> fingerprint(m)["weights_sha256"] != fp["weights_sha256"]
    True
    """
    arch = arch or get_arch(model)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    state = tuple(
        (n, t.device, t.dtype, tuple(t.shape), t.data_ptr() if not t.is_meta else 0, t._version)
        for n, t in tensors
    )
    seen = _SEEN.get(model)
    if seen is not None and seen[0] == state and not fresh and weights:
        return dict(seen[1])
    h = hashlib.sha256()
    meta = False
    for name, t in tensors:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.is_meta or not weights:
            meta = True
            continue
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # the bytes, no copy on CPU
        for i in range(0, flat.numel(), _CHUNK):
            h.update(flat[i : i + _CHUNK].cpu().numpy().data)
    fp = {
        "model_type": arch.model_type,
        "n_layers": arch.n_layers,
        "d_model": arch.d_model,
        "n_heads": arch.n_heads,
        "n_kv_heads": arch.n_kv_heads,
        "d_head": arch.d_head,
        "d_mlp": arch.d_mlp,
        "gated": arch.gated,
        "weights_sha256": h.hexdigest()[:16],
        "version": FINGERPRINT_VERSION,
    }
    if meta:
        fp["weights"] = "meta"
    if weights:
        _SEEN[model] = (state, fp)
    return dict(fp)


def note_stale(path: Path, fp: dict, what: str) -> Path | None:
    """Say on stderr, in one line, that a cache entry next to ``path`` (about to be computed)
    was keyed by the older fingerprint and is recomputed; return that entry, if any.

    ``path`` is named ``{fingerprint_id(fp)}{rest}``; the older fingerprint named the same entry
    with 8 hex digits of its hash (:func:`~dejavu_lab.vocab.fingerprint_id`). It saw 8 rows of 3
    weight matrices only, so its entries may belong to another model of the same shape: they
    are never used, only reported once (the recomputed entry is found from then on).

    >>> import contextlib, io, tempfile
    >>> from dejavu_lab.models import random_model
    >>> fp = fingerprint(random_model("tiny-llama").model)
    >>> folder = Path(tempfile.mkdtemp())
    >>> new = folder / f"{fingerprint_id(fp)}-0123456789.safetensors"
    >>> _ = (folder / "llama-L2-d64-89abcdef-0123456789.safetensors").write_bytes(b"old")
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     note_stale(new, fp, "calibration").name
    'llama-L2-d64-89abcdef-0123456789.safetensors'
    >>> print(err.getvalue().strip())
    dejavu_lab: the cached calibration llama-L2-d64-89abcdef-0123456789.safetensors was keyed by the older model fingerprint (8 rows of 3 weight matrices); recomputing it once under the whole-model fingerprint.
    """
    fid = fingerprint_id(fp)
    if not path.name.startswith(fid) or not path.parent.is_dir():
        return None
    head, rest = fid.rsplit("-", 1)[0], path.name[len(fid) :]
    pattern = re.compile(rf"{re.escape(head)}-[0-9a-f]{{8}}{re.escape(rest)}")
    old = next((p for p in sorted(path.parent.iterdir()) if pattern.fullmatch(p.name)), None)
    if old is not None:
        print(
            f"dejavu_lab: the cached {what} {old.name} was keyed by the older model fingerprint "
            "(8 rows of 3 weight matrices); recomputing it once under the whole-model "
            "fingerprint.",
            file=sys.stderr,
        )
    return old


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool [T, n] -> uint8 [T, ceil(n/8)] (little-endian bits).

    >>> pack_bits(torch.tensor([[True, False, True, False, False, False, False, False, True]]))
    tensor([[5, 1]], dtype=torch.uint8)
    """
    t, n = mask.shape
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(t, -1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (m * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [T, ceil(n/8)] -> bool [T, n].

    >>> unpack_bits(torch.tensor([[5, 1]], dtype=torch.uint8), 9).int()
    tensor([[1, 0, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.int32)
    >>> mask = torch.rand(3, 10) > 0.5
    >>> torch.equal(unpack_bits(pack_bits(mask), 10), mask)
    True
    """
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (packed[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


@dataclass
class Collection:
    """A finished collection on disk; :meth:`layer` loads one layer's arrays.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")
    >>> col = collect(m.model, None, CollectConfig(window=8, max_tokens=16), tempfile.mkdtemp(),
    ...               windows=torch.randint(0, 128, (2, 8)), progress=False)
    >>> {k: tuple(v.shape) for k, v in col.layer(0).items()}  # 16 tokens of layer 0
    {'pre': (16, 64), 'mid': (16, 64), 'mlp': (16, 192), 'head': (16, 4)}
    """

    path: Path
    manifest: dict

    @property
    def chunks(self) -> list[Path]:
        return [self.path / f"chunk_{c:05d}.safetensors" for c in range(self.manifest["n_chunks"])]

    @property
    def n_tokens(self) -> int:
        return self.manifest["n_tokens"]

    def key(self) -> str:
        """What was collected, as a cache key: the config's, and the token windows' hash when
        the windows were passed in (``collect(windows=...)``) rather than read from the corpus."""
        return _key(CollectConfig(**self.manifest["config"]), self.manifest.get("windows_sha256"))

    def layer(self, i: int, keys=("pre", "mid", "mlp", "head"), chunks=None) -> dict:
        """Concatenated arrays of layer ``i`` over ``chunks`` (default all): key -> tensor."""
        n_layers = self.manifest["fingerprint"]["n_layers"]
        integer(i, "layer", minimum=0, maximum=n_layers - 1, error=CollectionError)
        out: dict[str, list] = {k: [] for k in keys}
        for path in self.chunks if chunks is None else chunks:
            try:
                with safe_open(str(path), "pt") as f:
                    for k in keys:
                        out[k].append(f.get_tensor(f"{i}.{k}"))
            except Exception as e:  # safetensors raises its own error types
                raise CollectionError(
                    f"Cannot read {path} ({type(e).__name__}); the collection is damaged: "
                    "delete the folder and collect again."
                ) from None
        res = {k: torch.cat(v) for k, v in out.items()}
        if "mlp" in res:
            res["mlp"] = unpack_bits(res["mlp"], self.manifest["fingerprint"]["d_mlp"])
        return res


def _key(config: CollectConfig, windows_sha256: str | None = None) -> str:
    if windows_sha256 is None:  # read from the corpus: the config says it all
        return config.key()
    return hashlib.sha256(f"{config.key()}-{windows_sha256}".encode()).hexdigest()[:10]


def default_dir(fp: dict, config: CollectConfig, windows_sha256: str | None = None) -> Path:
    """The cache folder :func:`collect` uses when given no ``out_dir`` (nothing is created).

    ``windows_sha256``: the hash of windows passed to ``collect(windows=...)``, which then
    enters the key (the config alone does not say what they were).

    >>> from dejavu_lab.models import random_model
    >>> fp = fingerprint(random_model("tiny-llama").model)
    >>> path = default_dir(fp, CollectConfig())  # under dejavu_lab.assets.cache_dir()
    >>> path.parent.name, path.name
    ('activations', 'llama-L2-d64-...-afb230d3c5')
    >>> default_dir(fp, CollectConfig(), windows_sha256="0123abcd").name != path.name
    True
    """
    from .assets import cache_dir

    return cache_dir() / "activations" / f"{fingerprint_id(fp)}-{_key(config, windows_sha256)}"


def _sha256(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.long().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


_HINT = "pass another out_dir (--out), or set DEJAVU_LAB_CACHE to a folder on another disk"


def _check_manifest(mpath: Path, manifest: dict, out: Path) -> bool:
    """True if ``mpath`` holds this very manifest, False if there is none; else refuse."""
    if not mpath.exists():
        return False
    old = check_files.read_manifest(mpath)
    if {k: old.get(k) for k in manifest} != manifest:
        check_files.same_model(old, manifest["fingerprint"], out)
        raise CollectionError(
            f"{out} holds a collection for another model or config; pass another out_dir "
            "(--out) or delete that folder."
        )
    return True


@torch.no_grad()
def collect(
    model,
    tokenizer,
    config: CollectConfig = CollectConfig(),
    out_dir: str | os.PathLike | None = None,
    *,
    arch: Arch | None = None,
    windows: torch.Tensor | None = None,
    progress: bool = True,
) -> Collection:
    """Run the dense model over the corpus and stream per-layer inputs and labels to disk.

    ``windows`` [n, window] (token ids) replaces the corpus, e.g. for random-init test models;
    ``config.max_tokens`` and ``skip_windows`` still apply. The default ``out_dir`` is a folder
    under :func:`dejavu_lab.assets.cache_dir` keyed by the model fingerprint and the config.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> m = random_model("tiny-llama")  # no tokenizer: pass token windows [n, window]
    >>> col = collect(m.model, None, CollectConfig(window=8, max_tokens=16), tempfile.mkdtemp(),
    ...               windows=torch.randint(0, 128, (3, 8)), progress=False)
    >>> col.n_tokens, len(col.chunks)  # max_tokens keeps 2 of the 3 windows, one chunk each
    (16, 2)
    >>> col.layer(1, keys=("mlp",))["mlp"].sum(-1)[:4]  # gated: top half of 192 neurons
    tensor([96, 96, 96, 96])
    """
    if not isinstance(config, CollectConfig):
        raise CollectionError(
            f"config must be a CollectConfig, got a {type(config).__name__}; pass "
            "CollectConfig(...) (a dict d: CollectConfig(**d))."
        )
    arch = arch or get_arch(model)
    fp = fingerprint(model, arch)
    n_windows = config.skip_windows + config.max_tokens // config.window
    _, positions = check_tokens.model_limits(model)
    if positions is not None and config.window > positions:
        raise CollectionError(
            f"window={config.window} is longer than the model's {positions} positions; "
            f"collect windows of at most {positions} tokens."
        )
    if windows is None:
        if tokenizer is None:
            raise CollectionError(
                "collect reads the corpus with the model's tokenizer; pass the tokenizer, or "
                "token windows [n, window] as windows=."
            )
        windows = token_windows(tokenizer, load_text(config.corpus), config.window, n_windows)
        windows, given = check_tokens.windows(windows, model), False
    else:
        windows = check_tokens.windows(windows, model)
        if windows.shape[1] != config.window:
            raise CollectionError(
                f"windows are {windows.shape[1]} tokens long but config.window is "
                f"{config.window}; pass CollectConfig(window={windows.shape[1]}, ...)."
            )
        given = True
    windows = windows[config.skip_windows : n_windows]
    if windows.shape[0] == 0:
        raise CorpusError(
            f"The corpus has no windows left after skipping {config.skip_windows}; "
            "lower skip_windows or the window."
        )
    n_chunks = math.ceil(windows.shape[0] / config.chunk_windows)
    manifest = {
        "format": FORMAT,
        "fingerprint": fp,
        "config": asdict(config),
        "n_chunks": n_chunks,
        "n_tokens": windows.numel(),
    }
    sha = _sha256(windows) if given else None
    if given:  # the config alone does not say which tokens these were
        manifest["windows_sha256"] = sha
    out = Path(out_dir) if out_dir is not None else default_dir(fp, config, sha)
    mpath = out / "manifest.json"
    if out_dir is None and not mpath.exists():
        note_stale(out, fp, "collection")
    _check_manifest(mpath, manifest, out)  # refuse another config before waiting for a lock
    atomic.make_dirs(out, hint=_HINT)
    with atomic.locked(out, what="collecting into this folder", hint=_HINT):
        atomic.clean_partials(out)  # a killed run's temporaries (we hold the lock)
        if not _check_manifest(mpath, manifest, out):
            atomic.write_json(mpath, manifest, hint=_HINT)
        _collect_chunks(model, arch, config, windows, out, n_chunks, progress)
    return Collection(out, manifest)


def _collect_chunks(model, arch, config, windows, out: Path, n_chunks: int, progress: bool):
    """The forwards of the chunks not on disk yet; each chunk written atomically."""
    device = next(model.parameters()).device
    grams = [head_gram(model, arch, i).to(device) for i in range(arch.n_layers)]
    k_label = n_keep(config.mlp_label_sparsity, arch.d_mlp)
    relu = not arch.gated and arch.activation == "relu"
    bar = tqdm(total=n_chunks, desc="collect", unit="chunk", disable=not progress)
    buf: dict[str, torch.Tensor] = {}

    def grab(t: torch.Tensor, name: str) -> None:
        _, i, point = name.split(".", 2)
        t = t.detach().flatten(0, -2) if point != "attn.hook_z" else t.detach().flatten(0, 1)
        if point == "hook_resid_pre":
            buf[f"{i}.pre"] = t.half().cpu()
        elif point == "hook_resid_mid":
            buf[f"{i}.mid"] = t.half().cpu()
        elif point == "mlp.hook_post":
            active = t > 0 if relu else topk_mask(t.abs(), k_label)
            buf[f"{i}.mlp"] = pack_bits(active.cpu())
        else:
            buf[f"{i}.head"] = head_output_norms(t, grams[int(i)]).half().cpu()

    points = ["hook_resid_pre", "hook_resid_mid", "mlp.hook_post", "attn.hook_z"]
    with hooks(model, [(f"blocks.*.{p}", grab) for p in points], arch):
        for c in range(n_chunks):
            path = out / f"chunk_{c:05d}.safetensors"
            if path.exists():
                bar.update()
                continue
            ids = windows[c * config.chunk_windows : (c + 1) * config.chunk_windows]
            buf.clear()
            model(input_ids=ids.to(device))
            size = sum(t.numel() * t.element_size() for t in buf.values())
            meta = {"windows": str(ids.shape[0])}
            atomic.save_tensors(path, dict(buf), meta, hint=_HINT, need=(n_chunks - c) * size)
            bar.update()
    bar.close()
    buf.clear()


def open_collection(path: str | os.PathLike, model=None, arch: Arch | None = None) -> Collection:
    """A finished collection folder (written by :func:`collect`); with ``model``, check that it
    was collected from that model.

    >>> import tempfile
    >>> from dejavu_lab.models import random_model
    >>> out = tempfile.mkdtemp()
    >>> _ = collect(random_model("tiny-llama").model, None, CollectConfig(window=8, max_tokens=16),
    ...             out, windows=torch.randint(0, 128, (2, 8)), progress=False)
    >>> open_collection(out).n_tokens
    16
    """
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.exists():
        raise CollectionError(
            f"{path} is not a collection (no manifest.json); run `dejavu-lab collect` first."
        )
    manifest = check_files.read_manifest(mpath)
    if model is not None:
        check_files.same_model(manifest, fingerprint(model, arch), path)
    col = Collection(path, manifest)
    missing = [p.name for p in col.chunks if not p.exists()]
    if missing:
        raise CollectionError(
            f"{path} is incomplete ({len(missing)} of {manifest['n_chunks']} chunks missing); "
            "rerun the same collect command to resume it."
        )
    return col
