"""``dejavu-lab frontier``: perplexity against bytes per token for many methods and sparsities,
in one long run that resumes after a kill and records its table with provenance.

::

    dejavu-lab frontier --model demo --methods teal wina:uniform cats oracle \\
        --sparsity 0.25 0.4 0.5 0.6 0.7 --eval-tokens 4096 --record frontier_demo --json

The text is chapter 40's cut (:func:`dejavu_lab.sparsify.windows.study_windows`): the corpus's
first ``--train-tokens`` are training text, calibration reads their first
``--calibration-tokens`` (or another ``--calibration`` text, minus what it shares with the
evaluated windows), and perplexity is measured on ``--eval-tokens`` right after them. Each
method is prepared once (a calibration, static sets or predictors, cached), then each point is
measured and saved at once (:mod:`dejavu_lab.sparsify.frontier_state`): a rerun with the same
arguments skips the finished points, one with more methods or sparsities computes only the new
ones. ``--methods`` takes every method of :data:`dejavu_lab.vocab.METHODS`
(:func:`~dejavu_lab.sparsify.frontier.parse_variant`), so a new row there needs nothing here.

>>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
>>> add_parser(sub)
>>> args = sub.choices["frontier"].parse_args(["--methods", "teal:uniform", "cats"])
>>> args.methods
[('teal (uniform)', {'method': 'teal', 'allocation': 'uniform'}), ('cats', {'method': 'cats'})]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from .args import budget, check_text_files, common_args, count, load, positive, text_source

__all__ = ["DEFAULT_METHODS", "EVAL_TOKENS", "add_parser", "cmd_frontier"]

EVAL_TOKENS = 4096  # held-out tokens per point: 8 windows of 512 (a real run's minimum)
# every method that needs no trained predictor, plus the oracle as the ceiling ("all" adds
# DejaVu, whose predictors train for minutes first)
DEFAULT_METHODS = ("training-free",)


def _variants(text: str) -> list[tuple[str, dict]]:
    """An argparse ``type=`` for ``--methods``: a method as users write it, or a group."""
    from ..sparsify.frontier import METHOD_VARIANTS, TRAINING_FREE, parse_variant
    from ..vocab import METHODS

    if text == "all":
        return list(METHOD_VARIANTS.items())
    if text == "training-free":
        return [(k, v) for k, v in METHOD_VARIANTS.items()
                if v["method"] in TRAINING_FREE or METHODS[v["method"]].needs == "nothing"]  # fmt: skip
    try:
        return [parse_variant(text)]
    except (KeyError, ValueError) as e:
        msg = str(e.args[0] if isinstance(e, KeyError) else e).rstrip(".")
        raise argparse.ArgumentTypeError(f"{msg} (or 'all', 'training-free').") from None


class _Flatten(argparse.Action):
    """``nargs="+"`` whose ``type=`` gives a list per word: one flat list, over repeats too."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []),
                                       *(x for v in values for x in v)])  # fmt: skip


def _sparsities(text: str) -> list[float]:
    """An argparse ``type=`` for ``--sparsity``: one budget or several, comma-separated.

    >>> _sparsities("0.5"), _sparsities("0.25,0.5")
    ([0.5], [0.25, 0.5])
    """
    value = budget("sparsity")(text)
    return value if isinstance(value, list) else [value]


def _record_name(text: str) -> str:
    """An argparse ``type=`` for ``--record``: a bare name, checked before hours of work.

    >>> _record_name("frontier_demo")
    'frontier_demo'
    """
    if not text or "/" in text or "\\" in text or text.endswith(".json") or text.startswith("."):
        raise argparse.ArgumentTypeError(
            f"--record takes a bare name such as frontier_demo (written to results/NAME.json), "
            f"got {text!r}."
        )
    return text


def add_parser(sub) -> None:
    """The ``frontier`` options, on ``sub`` (an argparse subparsers object).

    >>> sub = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(sub)
    >>> sub.choices["frontier"].parse_args(["--sparsity", "0.5,0.6", "0.7"]).sparsity
    [0.5, 0.6, 0.7]
    """
    from ..sparsify.frontier import CALIBRATION_TOKENS, SPARSITIES, TRAIN_TOKENS

    p = sub.add_parser(
        "frontier", help="perplexity against bytes per token, every method (resumable)"
    )
    common_args(p, corpus=False)
    p.add_argument(
        "--corpus", type=text_source, default="demo", help="demo, wikitext-2, c4 or a text file"
    )
    p.add_argument("--window", type=count(2), default=512, help="tokens per window")
    p.add_argument(
        "--methods",
        nargs="+",
        action=_Flatten,
        type=_variants,
        default=None,
        help="methods as teal, teal:uniform, wina, cats, oracle, static, dejavu (any of the "
        "method table; default 'training-free': those needing no trained predictor, and the "
        "oracle; 'all' adds dejavu); teal+layers, wina+layers, larosa+layers spread the budget "
        "over the layers by each layer's measured sensitivity",
    )
    p.add_argument(
        "--sparsity",
        nargs="+",
        action=_Flatten,
        type=_sparsities,
        default=None,
        help="fractions removed, e.g. 0.25 0.5 or 0.25,0.5 (default: "
        f"{' '.join(map(str, SPARSITIES))})",
    )
    p.add_argument(
        "--eval-tokens",
        type=positive("--eval-tokens"),
        default=EVAL_TOKENS,
        help=f"held-out tokens per point, whole windows (default {EVAL_TOKENS})",
    )
    p.add_argument(
        "--train-tokens",
        type=count(0),
        default=TRAIN_TOKENS,
        help=f"the corpus's first tokens, never evaluated (default {TRAIN_TOKENS})",
    )
    p.add_argument(
        "--calibration",
        type=text_source,
        default=None,
        help="calibration text, a corpus name or a file (default: the training text); its "
        "windows sharing text with the evaluated ones are left out",
    )
    p.add_argument(
        "--calibration-tokens",
        type=positive("--calibration-tokens"),
        default=CALIBRATION_TOKENS,
        help=f"calibration tokens (default {CALIBRATION_TOKENS})",
    )
    p.add_argument(
        "--fit-window",
        type=float,
        default=0.0,
        help="also read the curves at the targets by a local line fit (see at_bytes)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where finished points are kept (default: the cache's frontier-runs folder)",
    )
    p.add_argument(
        "--record", type=_record_name, default=None, help="write results/NAME.json, provenance too"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_frontier(args) -> None:
    """``dejavu-lab frontier``: measure the missing points, then print (and record) the table.

    >>> import contextlib, io, tempfile
    >>> from dejavu_lab.cli.main import parser
    >>> argv = ("frontier --methods oracle --sparsity 0.5 --window 32 --eval-tokens 32 "
    ...         "--train-tokens 64 --calibration-tokens 64 --no-progress --state-dir").split()
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     cmd_frontier(parser().parse_args([*argv, tempfile.mkdtemp()]))
    >>> print(out.getvalue())  # doctest: +NORMALIZE_WHITESPACE
    variant  sparsity  perplexity  ppl_ratio  bytes_per_token_fraction  seconds
      dense     0.000  ...      1.000                     1.000    ...
     oracle     0.500  ...      ...                     0.53...    ...
    """
    from ..sparsify.frontier import at_bytes, crossing_records

    if not 0 <= args.fit_window < 1:
        raise ValueError(f"--fit-window must be in [0, 1), got {args.fit_window}.")
    if args.eval_tokens < args.window:
        raise ValueError(
            f"--eval-tokens {args.eval_tokens} is less than one window of {args.window} tokens; "
            "evaluate more tokens or use a smaller --window."
        )
    from ..sparsify.frontier import SPARSITIES

    specs = dict(args.methods or [v for m in DEFAULT_METHODS for v in _variants(m)])
    sparsities = list(dict.fromkeys(args.sparsity or SPARSITIES))
    check_text_files(args)
    model, tok, arch = load(args)
    df, run = _run(args, model, tok, arch, specs, sparsities)
    crossing = at_bytes(df)
    path = _record(args, df, run) if args.record else None
    if args.json:
        out = {**run["summary"], "rows": df.to_dict("records"),
               "at_bytes": crossing_records(crossing),
               "record": str(path) if path else None}  # fmt: skip
        if args.fit_window > 0:
            out["at_bytes_fit"] = crossing_records(at_bytes(df, window=args.fit_window))
            out["fit_window"] = args.fit_window
        print(json.dumps(out))
    else:
        cols = ["variant", "sparsity", "perplexity", "ppl_ratio", "bytes_per_token_fraction",
                "seconds"]  # fmt: skip
        print(df[cols].to_string(index=False, float_format="%.3f"))
    if path is not None:
        print(f"dejavu-lab: recorded {path}", file=sys.stderr)


def _run(args, model, tok, arch, specs: dict, sparsities: list[float]):
    """Open the run's state, measure what it lacks (progress bars on stderr), return the table
    of the requested points and what the recording needs."""
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from ..assets import cache_dir
    from ..collect import fingerprint
    from ..results import provenance
    from ..sparsify.calibration import CalibrationConfig, text_hash
    from ..sparsify.frontier import evaluate_point, prepare, study_windows
    from ..sparsify.frontier_state import FrontierState

    progress = not args.no_progress
    calibration = args.calibration if args.calibration not in (None, args.corpus) else None
    calib, held_out = study_windows(
        tok, args.corpus, args.window, args.eval_tokens // args.window, args.train_tokens,
        args.calibration_tokens, calibration,
    )  # fmt: skip
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    cfg = CalibrationConfig()
    inputs = {
        "fingerprint": fingerprint(model, arch),
        "dtype": dtype,
        "window": args.window,
        "evaluated_sha": text_hash(held_out),
        "calibration_sha": text_hash(calib),
        "train_tokens": args.train_tokens,  # dejavu's training text: the corpus's first tokens
        "calibration_config": [cfg.key(), cfg.greedy_key()],
    }
    state = FrontierState.open(args.state_dir or cache_dir() / "frontier-runs", inputs)
    points = [("dense", {"method": "dense"}, 0.0)]
    points += [(name, spec, s) for name, spec in specs.items() for s in sparsities]
    git_sha = provenance("")["git_sha"]
    computed = 0
    with state.locked():
        state.reload()  # a process that held the lock before us may have added points
        taken = _seed(state, args.record)
        done = sum(state.get(spec, s) is not None for _, spec, s in points)
        if taken:
            print(f"dejavu-lab: took {taken} points from results/{args.record}.json (same model, "
                  "text and settings).", file=sys.stderr)  # fmt: skip
        if done:
            print(f"dejavu-lab: resuming {state.path}: {done} of {len(points)} points done.",
                  file=sys.stderr)  # fmt: skip
        bar = tqdm(total=len(points), initial=done, desc="frontier", disable=not progress)
        with bar:
            for name in dict.fromkeys(n for n, _, _ in points):
                spec = specs.get(name, {"method": "dense"})
                todo = [s for n, _, s in points if n == name and state.get(spec, s) is None]
                if not todo:
                    continue
                bar.set_postfix_str(f"{name}: preparing")
                ready = {} if name == "dense" else prepare(
                    model, tok, spec, calib, corpus=args.corpus, window=args.window,
                    train_tokens=args.train_tokens, arch=arch, progress=progress)  # fmt: skip
                for s in todo:
                    bar.set_postfix_str(f"{name} at {s}")
                    row = evaluate_point(model, held_out, name, spec, s, ready, progress=progress)
                    state.add(spec, s, {**row, "git_sha": git_sha})
                    computed += 1
                    bar.update()
    rows = [{**state.get(spec, s), "variant": name} for name, spec, s in points]
    df = pd.DataFrame(rows)
    df["ppl_ratio"] = df["perplexity"] / df["perplexity"].iloc[0]
    summary = {
        "model": args.model,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "corpus": args.corpus,
        "calibration": calibration or args.corpus,
        "window": args.window,
        "tokens": int(held_out.numel()),
        "calibration_tokens": int(calib.numel()),
        "train_tokens": args.train_tokens,
        "state": str(state.path),
        "computed": computed,
        "reused": len(points) - computed,
    }
    return df, {"summary": summary, "inputs": inputs, "specs": specs, "git_sha": git_sha}


def _seed(state, record: str | None) -> int:
    """Points an earlier ``--record`` of the same run holds (a fresh machine has no state
    folder, but the recording is in ``results/``): taken into ``state``, counted."""
    from ..results import results_dir

    path = results_dir() / f"{record}.json" if record else None
    if path is None or not path.exists():
        return 0
    try:
        recording = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(recording, dict):
            raise ValueError("not a results file")
        return state.seed(recording)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        print(f"dejavu-lab: {path} could not be read ({e}); its points are measured again and "
              "it is rewritten at the end.", file=sys.stderr)  # fmt: skip
        return 0


def _record(args, df, run) -> Path:
    """``results/<--record>.json``: the table, with the machine, the versions, the exact
    command and the hashes of the texts in its provenance."""
    import transformers

    from ..results import save

    argv = getattr(args, "argv", None)
    argv = sys.argv[1:] if argv is None else argv
    inputs = run["inputs"]
    extra = {
        **{k: v for k, v in run["summary"].items() if k not in ("computed", "reused")},
        "transformers": transformers.__version__,
        "model_fingerprint": inputs["fingerprint"],
        "text_sha": {
            "evaluated": inputs["evaluated_sha"],
            "calibration": inputs["calibration_sha"],
        },  # fmt: skip
        "calibration_config": inputs["calibration_config"],
        "variants": run["specs"],
        "points_git_sha": sorted(set(df["git_sha"])),
        "seconds_total": float(df["seconds"].sum()),
    }
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    return save(args.record, rows, command=shlex.join(["dejavu-lab", *argv]), extra=extra)
