"""Where TEAL's own decoder comes from: a checkout the user points to, imported, never copied.

TEAL (Liu et al. 2024) ships a fork of gpt-fast (``gpt-fast/model.py``: ``ModelArgs``,
``Transformer``) and its sparse GEMV kernels (``kernels/sparse_gemv.py``, wrapped as
``torch.ops.teal.*`` by ``kernels/compile_wrapper.py``, which imports ``msgspec``).
:func:`load_teal` imports those two modules from the checkout, with its folders on
``sys.path`` for the import only; its modules stay in ``sys.modules`` under ``teal_*`` names,
so neither our ``kernels/`` scripts folder nor any other ``model`` module is shadowed.
:func:`teal_commit` names the commit the files come from (``git rev-parse`` in a clone; in a
tree extracted with ``git archive``, which has no ``.git``, the commit whose files have the
same sha256), and :func:`teal_args` maps one of our Llama presets to its ``ModelArgs``.
:mod:`dejavu_lab.bench.peer_teal` builds, sparsifies and times that decoder.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from ..errors import InputError
from ..models import PRESETS, Shape

__all__ = ["load_teal", "teal_args", "teal_checkout", "teal_commit"]

FILES = ("gpt-fast/model.py", "kernels/sparse_gemv.py", "kernels/compile_wrapper.py")
# sha256 of FILES' bytes, in order -> the TEAL commit they come from (an extracted tree has no .git)
KNOWN = {"c2464a27ec356791": "5baaec8645ce76368bd49eb05efb23f1da7edec6"}
_LOADED: dict[Path, SimpleNamespace] = {}


def teal_checkout(path: str | os.PathLike) -> Path:
    """The root of a TEAL checkout (its ``gpt-fast/`` and ``kernels/`` folders), resolved.

    >>> teal_checkout("/no/such/dir")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: /no/such/dir is not a TEAL checkout (it lacks gpt-fast/model.py, ...
    """
    root = Path(path).expanduser().resolve()
    missing = [f for f in FILES if not (root / f).is_file()]
    if missing:
        raise InputError(
            f"{path} is not a TEAL checkout (it lacks {', '.join(missing)}); pass the folder of "
            "a clone of https://github.com/FasterDecoding/TEAL (or of `git archive HEAD gpt-fast "
            "kernels` extracted from one)."
        )
    return root


def _commit(root: Path) -> str:
    """TEAL's commit: ``git rev-parse`` in a clone, else looked up from the files' digest."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=False)  # fmt: skip
        if out.returncode == 0:
            return out.stdout.strip()
    digest = hashlib.sha256(b"".join((root / f).read_bytes() for f in FILES)).hexdigest()
    return KNOWN.get(digest[:16], f"unknown (files sha256 {digest[:16]})")


def teal_commit(path: str | os.PathLike) -> str:
    """The commit of the TEAL checkout at ``path``, after importing its decoder and kernels (so
    a missing dependency shows before anything is timed): ``git rev-parse HEAD`` in a clone;
    in an extracted tree, the commit its files' digest is known from (5baaec8, which the
    project's recordings used), else ``"unknown (files sha256 ...)"``.

    >>> teal_commit("/no/such/dir")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: /no/such/dir is not a TEAL checkout (it lacks gpt-fast/model.py, ...
    """
    return load_teal(path).commit


def load_teal(path: str | os.PathLike) -> SimpleNamespace:
    """TEAL's decoder and kernels from the checkout at ``path``: ``.model`` (its gpt-fast
    ``model.py``), ``.gemv`` (``kernels/sparse_gemv.py``) and ``.commit``; imported once, with
    the checkout on ``sys.path`` for the import only (module doc).

    >>> load_teal("/no/such/dir")
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: /no/such/dir is not a TEAL checkout (it lacks gpt-fast/model.py, ...
    """
    root = teal_checkout(path)
    if root in _LOADED:
        return _LOADED[root]
    if importlib.util.find_spec("msgspec") is None:
        raise InputError("TEAL's kernel wrapper imports msgspec, which is not installed; "
                         "pip install msgspec (on an offline box, carry its wheel).")  # fmt: skip
    ours = ("kernels", "compile_wrapper")

    def theirs(name):
        return name in ours or name.startswith("kernels.")

    saved_path, saved = list(sys.path), {k: sys.modules.pop(k) for k in list(sys.modules)
                                         if theirs(k)}  # fmt: skip
    sys.path[:0] = [str(root), str(root / "gpt-fast")]
    try:
        gemv = importlib.import_module("kernels.sparse_gemv")
        spec = importlib.util.spec_from_file_location("teal_model", root / "gpt-fast" / "model.py")
        model = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = model
        spec.loader.exec_module(model)
    finally:
        sys.path[:] = saved_path
        for k in [k for k in sys.modules if theirs(k)]:
            sys.modules["teal_" + k] = sys.modules.pop(k)
        sys.modules.update(saved)
    _LOADED[root] = SimpleNamespace(model=model, gemv=gemv, commit=_commit(root))
    return _LOADED[root]


def teal_args(preset: str | Shape, max_seq_len: int) -> dict:
    """TEAL's ``ModelArgs`` fields for one of our Llama shapes (a :data:`PRESETS` name or a
    :class:`~dejavu_lab.models.Shape`), its RoPE and mask tables sized for ``max_seq_len``.

    >>> teal_args("llama-3-8b", 640)
    {'block_size': 640, 'vocab_size': 128256, 'n_layer': 32, 'n_head': 32, 'dim': 4096, 'intermediate_size': 14336, 'n_local_heads': 8}
    >>> teal_args("opt-30b", 640)
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: TEAL's gpt-fast decoder runs Llama shapes only; 'opt-30b' is opt: pick one of llama-2-7b, ...
    """
    shape = PRESETS.get(preset) if isinstance(preset, str) else preset
    llamas = [n for n, s in PRESETS.items() if s.family == "llama"]
    if shape is None or shape.family != "llama":
        what = f"{preset!r} is {shape.family}" if shape else f"{preset!r} is not a preset"
        raise InputError(f"TEAL's gpt-fast decoder runs Llama shapes only; {what}: pick one of "
                         f"{', '.join(llamas)}.")  # fmt: skip
    if shape.d_head not in (None, shape.d_model // shape.n_heads):  # ModelArgs derives it
        raise InputError(f"TEAL's gpt-fast decoder has d_head = d_model / n_heads; {preset!r} "
                         f"has {shape.d_head}: pick one of {', '.join(llamas)}.")  # fmt: skip
    return dict(block_size=max_seq_len, vocab_size=shape.vocab, n_layer=shape.n_layers,
                n_head=shape.n_heads, dim=shape.d_model, intermediate_size=shape.d_mlp,
                n_local_heads=shape.n_kv_heads or shape.n_heads)  # fmt: skip
