"""``dejavu-lab``: collect activations, train and evaluate DejaVu predictors, measure perplexity.

::

    dejavu-lab perplexity --model demo --corpus demo --window 512
    dejavu-lab perplexity --model demo --mlp-sparsity 0.5 --head-sparsity 0.3 --mode oracle
    dejavu-lab perplexity --model demo --method teal --sparsity 0.5 --json   # any method
    dejavu-lab collect --model demo --max-tokens 8192            # resumable; prints the folder
    dejavu-lab train-predictors --model demo --mode both         # collects first if needed
    dejavu-lab eval --model demo --predictors P.safetensors --mlp-sparsity 0.5
    dejavu-lab eval-tasks --model demo --method oracle --sparsity 0.5 --limit 50  # lm-eval
    dejavu-lab frontier --model demo --methods teal cats --record NAME --json  # resumable

Every subcommand prints its result on stdout, progress bars on stderr, and on a bad input one
line ``dejavu-lab: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import sys

from . import frontier, perplexity, predictors, tasks
from .args import Parser

__all__ = ["COMMANDS", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The ``dejavu-lab`` argument parser; budgets are checked here, before any model loads.

    >>> args = parser().parse_args("eval --predictors p.safetensors --mlp-sparsity 0.8".split())
    >>> args.command, args.mlp_sparsity, args.head_sparsity
    ('eval', 0.8, 0.3)
    >>> parser().parse_args("perplexity --head-sparsity 0.5,0.25".split()).head_sparsity
    [0.5, 0.25]
    """
    ap = Parser(
        prog="dejavu-lab", description="Contextual sparsity (Deja Vu, ICML 2023) on HF models."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    perplexity.add_parser(sub)
    predictors.add_parsers(sub)
    tasks.add_parser(sub)
    frontier.add_parser(sub)
    return ap


COMMANDS = {
    "perplexity": perplexity.cmd_perplexity,
    "collect": predictors.cmd_collect,
    "train-predictors": predictors.cmd_train,
    "eval": predictors.cmd_eval,
    "eval-tasks": tasks.cmd_eval_tasks,
    "frontier": frontier.cmd_frontier,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``dejavu-lab`` with ``argv`` (default: the command line); return the exit status.

    A bad budget or count fails while parsing, before any model loads, and every other bad
    input (a model, a file, a collection, a full or read-only disk) where it is found: one line
    ``dejavu-lab: error: ...`` on stderr and status 2, never a traceback. Ctrl-C is one line
    and status 130 (an interrupted ``collect`` resumes when rerun).

    >>> import contextlib, sys
    >>> with contextlib.redirect_stderr(sys.stdout):
    ...     main(["eval", "--predictors", "p.safetensors", "--mlp-sparsity", "1.0"])
    dejavu-lab: error: argument --mlp-sparsity: mlp_sparsity must be in [0, 1) (the fraction ...
    2
    """
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2): argparse has printed why
        return e.code or 0
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the results
    from transformers.utils import logging as hf_logging

    from ..assets import AssetError
    from ..results import ResultsError

    if args.no_progress:
        hf_logging.disable_progress_bar()

    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("dejavu-lab: interrupted; rerun the same command to resume.", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError, AssetError, ResultsError) as e:  # one sentence each
        print(f"dejavu-lab: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line; a bare OSError from a library gets its path and a hint."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0]).splitlines()[0]
    if type(e) in (OSError, PermissionError, FileNotFoundError, IsADirectoryError) and e.errno:
        where = f" ({e.filename})" if e.filename else ""
        full = e.errno == errno.ENOSPC
        return f"{e.strerror}{where}; " + (
            "free space there or write somewhere else."
            if full
            else "check the path and its permissions."
        )
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
