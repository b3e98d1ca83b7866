"""The ``dejavu-lab`` command line's shared pieces: argument types checked while parsing (before
any model loads), the common options, and loading a model and a corpus's token windows.

>>> count(1)("3"), budget("mlp_sparsity")("0.5,0.25")
(3, [0.5, 0.25])
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "Parser",
    "budget",
    "check_text_files",
    "common_args",
    "corpus_name",
    "corpus_windows",
    "count",
    "default_dtype",
    "layer_list",
    "load",
    "model_dtype",
    "positive",
    "read_text",
    "sparsity_args",
    "static_sets_for",
    "text_source",
]


class Parser(argparse.ArgumentParser):
    """An argument error is one line ``dejavu-lab: error: ...`` and exit status 2, as any other.

    >>> import contextlib, sys
    >>> p = Parser(prog="dejavu-lab")
    >>> _ = p.add_argument("--window", type=int)
    >>> with contextlib.redirect_stderr(sys.stdout):
    ...     p.parse_args(["--window", "x"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
    """

    def parse_known_args(self, args=None, namespace=None):
        """Parse, and record in ``flags_given`` the dests typed on the command line (a flag at
        its default value is still a flag the user chose: :mod:`dejavu_lab.cli.options`)."""
        self._typed: set[str] = set()
        ns, rest = super().parse_known_args(args, namespace)
        # a subcommand's parser has run inside and left its own record on ns
        ns.flags_given = frozenset(getattr(ns, "flags_given", ())) | self._typed
        return ns, rest

    def _get_values(self, action, arg_strings):
        # argparse converts the strings of each option it meets here, and only those (defaults
        # go through _get_value): the one hook that tells typed flags from defaults
        self._typed.add(action.dest)
        return super()._get_values(action, arg_strings)

    def error(self, message: str):
        if not message.endswith("."):  # argparse's own words: say where the usage is
            message += f"; run `{self.prog} --help` for the options."
        self.exit(2, f"dejavu-lab: error: {message}\n")


def budget(what: str, per_layer: bool = True):
    """An argparse ``type=`` for the sparsity ``what``, checked while parsing (no model loaded).

    A number in [0, 1) or, with ``per_layer``, comma-separated numbers each in [0, 1); whether
    their count matches the model's layers is checked once the model has loaded.

    >>> budget("sparsity")("0.5"), budget("sparsity")("0.5,0.25")
    (0.5, [0.5, 0.25])
    >>> budget("sparsity")("1.0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: sparsity must be in [0, 1) (the fraction removed; ...; pass e.g. 0.5.
    """

    def parse(text: str):
        parts = [p for p in text.split(",") if p.strip()] if per_layer else [text]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if not values:
            extra = " or a comma-separated list" if per_layer else ""
            raise argparse.ArgumentTypeError(
                f"expected a number in [0, 1){extra}, got {text!r}; pass e.g. 0.5."
            )
        from ..budgets import budgets

        try:
            budgets(values, len(values), what)  # each in [0, 1), one sentence if not
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{str(e).rstrip('.')}; pass e.g. 0.5.") from None
        return values[0] if len(values) == 1 else values

    return parse


def count(minimum: int, what: str = ""):
    """An argparse ``type=`` for a whole number >= ``minimum`` (``--epochs 0`` fails here).

    >>> count(1)("8")
    8
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}{what}, got {text!r}; pass e.g. {minimum}."
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be at least {minimum}{what}, got {value}; pass {minimum} or more."
            )
        return value

    return parse


def corpus_name(text: str) -> str:
    """An argparse ``type=`` for ``--corpus`` where only a corpus name will do.

    >>> corpus_name("wikitext-2")
    'wikitext-2'
    """
    from ..corpus import CORPORA

    if text not in CORPORA:
        raise argparse.ArgumentTypeError(
            f"unknown corpus {text!r}; choose one of {', '.join(CORPORA)}."
        )
    return text


def layer_list(text: str) -> list[int]:
    """An argparse ``type=`` for ``--dense-layers``: comma-separated layer indices.

    >>> layer_list("0,3")
    [0, 3]
    """
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices, got {text!r}; pass e.g. 0,1."
        ) from None


DTYPES = ("float32", "bfloat16", "float16")  # --dtype's choices, torch's names


def common_args(p: argparse.ArgumentParser, corpus: bool = True) -> None:
    """``--model``, ``--dtype``, ``--threads``, ``--no-progress`` and (with ``corpus``)
    ``--corpus`` and ``--window``; :func:`load` reads the first three.

    >>> p = argparse.ArgumentParser()
    >>> common_args(p)
    >>> vars(p.parse_args([]))
    {'model': 'demo', 'dtype': None, 'threads': None, 'corpus': 'demo', 'window': 512, 'no_progress': False}
    """
    p.add_argument(
        "--model",
        default="demo",
        help="a named model ('demo', 'qwen2.5-0.5b', 'qwen2.5-1.5b': fetched on first use), a "
        "Hugging Face id, a local folder, or a .gguf file (dequantised once, then cached); "
        "default demo",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the weights' dtype; default bfloat16 for a .gguf file and the Qwen models (on a "
        "CPU several times faster than float32, perplexity within 0.1%%), float32 for the demo "
        "model (as the book's chapters load it), and a Hugging Face checkpoint's own dtype",
    )
    p.add_argument(
        "--threads",
        type=count(1, " threads"),
        default=None,
        help="CPU threads for torch (torch.set_num_threads); default: torch's own choice",
    )
    if corpus:
        p.add_argument("--corpus", type=corpus_name, default="demo", help="demo, wikitext-2 or c4")
        p.add_argument("--window", type=count(2, " tokens"), default=512, help="tokens per window")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def sparsity_args(p: argparse.ArgumentParser) -> None:
    """``--mlp-sparsity``, ``--head-sparsity`` (checked while parsing) and ``--dense-layers``.

    >>> p = argparse.ArgumentParser()
    >>> sparsity_args(p)
    >>> vars(p.parse_args(["--mlp-sparsity", "0.5"]))
    {'mlp_sparsity': 0.5, 'head_sparsity': None, 'dense_layers': []}
    """
    p.add_argument(
        "--mlp-sparsity", type=budget("mlp_sparsity"), default=None, help="neurons removed (0)"
    )
    p.add_argument(
        "--head-sparsity", type=budget("head_sparsity"), default=None, help="heads removed (0)"
    )
    p.add_argument("--dense-layers", type=layer_list, default=[], help="e.g. 0,1 (left dense)")


def text_source(text: str) -> str:
    """An argparse ``type=`` for ``--corpus`` / ``--calibration``: a corpus name or a file.

    >>> text_source("demo")
    'demo'
    """
    from ..corpus import CORPORA

    if text in CORPORA:
        return text
    path = Path(text).expanduser()
    if path.is_file():
        return str(path)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} is not a file; pass a UTF-8 text file.")
    raise argparse.ArgumentTypeError(
        f"no corpus named {text!r} and no file at {text}; pass one of {', '.join(CORPORA)} "
        "or the path of a UTF-8 text file."
    )


def positive(what: str):
    """An argparse ``type=`` for a positive integer option ``what``.

    >>> positive("--max-tokens")("128")
    128
    """

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {text!r}.")
        return v

    return parse


def load(args):
    """``(model, tokenizer, arch)`` of ``--model`` in ``--dtype``, with ``--threads`` set.

    >>> load(argparse.Namespace(model="random:tiny-llama")).arch.n_layers
    2
    >>> args = argparse.Namespace(model="random:tiny-llama", dtype="bfloat16", threads=None)
    >>> next(load(args).model.parameters()).dtype
    torch.bfloat16
    """
    import torch

    from ..models import load_model

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=model_dtype(args))


def model_dtype(args):
    """The ``torch.dtype`` to load ``--model`` in: ``--dtype``, else :func:`default_dtype`
    (None: the checkpoint's own).

    >>> model_dtype(argparse.Namespace(model="qwen2.5-0.5b", dtype=None))
    torch.bfloat16
    >>> model_dtype(argparse.Namespace(model="demo", dtype="float16"))
    torch.float16
    """
    import torch

    name = getattr(args, "dtype", None) or default_dtype(args.model)
    return None if name is None else getattr(torch, name)


def default_dtype(spec: str) -> str | None:
    """``--dtype``'s default for ``spec``: bfloat16 for a GGUF file and the Qwen models (a
    512-token forward of Qwen2.5-0.5B on one CPU thread took a third of float32's time, and
    perplexity moved by less than 0.1%); None (the
    checkpoint's own dtype, float32 for the demo model, as the chapters load it, and for random
    models) otherwise.

    >>> default_dtype("qwen2.5-1.5b"), default_dtype("demo"), default_dtype("facebook/opt-125m")
    ('bfloat16', None, None)
    """
    from ..errors import ModelNotFoundError
    from ..models import NAMED, gguf_file

    if spec == "demo" or spec.startswith("random:"):
        return None
    if spec in NAMED:
        return "bfloat16"
    try:
        return "bfloat16" if gguf_file(spec) is not None else None
    except ModelNotFoundError:  # load_model says why, in one sentence
        return None


def corpus_windows(args, tokenizer, n: int | None, skip: int = 0, source: str | None = None):
    """``n`` token windows [n, --window] of ``source`` (default ``--corpus``) after ``skip``.

    >>> from dejavu_lab.models import load_model
    >>> args = argparse.Namespace(model="demo", corpus="demo", window=16)
    >>> corpus_windows(args, load_model("demo").tokenizer, 2, skip=1).shape
    torch.Size([2, 16])
    """
    from ..corpus import CorpusError, token_windows

    if tokenizer is None:
        raise ValueError(
            f"Model {args.model!r} has no tokenizer, so it cannot read a corpus; "
            "use 'demo', a Hugging Face id or a folder with tokenizer files."
        )
    total = None if n is None else n + skip
    every = token_windows(tokenizer, read_text(source or args.corpus), args.window, total)
    w = every[skip:]
    w.add_bos = every.add_bos  # a slice loses it; the JSON's token range needs it
    if w.shape[0] == 0:
        raise CorpusError(
            f"The corpus has no {args.window}-token windows left after skipping {skip}; "
            "skip fewer windows or use a smaller --window."
        )
    return w


def read_text(source: str) -> str:
    """A corpus by name, or a UTF-8 text file.

    >>> read_text("demo")[:10]
    'Hundreds o'
    """
    from ..corpus import CORPORA, CorpusError, load_text

    if source in CORPORA:
        return load_text(source)
    try:
        return Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{source} is not UTF-8 text; pass a UTF-8 text file.") from None


def check_text_files(args) -> None:
    """Fail before the model loads when a text file is not UTF-8 or cannot hold one window
    (a token spans at least one byte).

    >>> import tempfile
    >>> path = f"{tempfile.mkdtemp()}/short.txt"
    >>> _ = open(path, "w").write("Too short.")
    >>> check_text_files(argparse.Namespace(corpus=path, calibration=None, window=512))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.CorpusError: --corpus ... has 10 bytes, fewer than one window of 512 ...
    """
    from ..corpus import CORPORA, CorpusError

    for what, source in (("--corpus", args.corpus), ("--calibration", args.calibration)):
        if source is None or source in CORPORA:
            continue
        raw = Path(source).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError(
                f"{what} {source} is not UTF-8 text; pass a UTF-8 text file."
            ) from None
        if len(raw) < args.window:
            raise CorpusError(
                f"{what} {source} has {len(raw)} bytes, fewer than one window of {args.window} "
                "tokens; pass a longer text or a smaller --window."
            )


def static_sets_for(model, calib, kw: dict, args):
    """The static method's sets, chosen on ``calib`` at the budgets of ``kw``.

    >>> import torch
    >>> from dejavu_lab.models import random_model
    >>> model = random_model("tiny-llama").model
    >>> kw = {"mlp_sparsity": 0.5, "head_sparsity": 0.0}
    >>> sets = static_sets_for(model, torch.randint(0, 128, (1, 8)), kw,
    ...                        argparse.Namespace(no_progress=True))
    >>> sets.mlp_sparsity
    [0.5, 0.5]
    """
    from ..sparsify import static_sets

    return static_sets(model, calib, mlp_sparsity=kw["mlp_sparsity"],
                       head_sparsity=kw["head_sparsity"], progress=not args.no_progress)  # fmt: skip
