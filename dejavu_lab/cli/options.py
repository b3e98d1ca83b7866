"""One rule for the command line's options: a flag the chosen method or mode does not read is an
error, not a silent no-op.

Seen before this rule: ``perplexity --method dense --sparsity 0.5`` printed the dense perplexity,
``--mode static`` next to ``--method teal`` ran TEAL, ``--allocation greedy`` with CATS and
``--predictor-mode`` with TEAL changed nothing, ``--max-tokens 8`` below one window was dropped.

Which flags a method reads is derived from its row of :data:`dejavu_lab.vocab.METHODS`
(:attr:`~dejavu_lab.vocab.Method.options`, the arguments of ``sparsified`` it takes): each flag
here names the options it feeds, and a flag is refused when the method takes none of them.
:data:`FLAGS` says, per subcommand, which option each flag feeds and on which path it is read
(``perplexity`` has two: ``--method``, and the older ``--mode``). The subcommands call
:func:`check` first, before any model loads; the parser records which flags were typed
(:class:`dejavu_lab.cli.args.Parser`), so a flag given at its default value counts too.

>>> from dejavu_lab.cli.main import parser
>>> check(parser().parse_args("perplexity --method cats --sparsity 0.5".split()))  # fine
>>> check(parser().parse_args("perplexity --method cats --allocation greedy".split()))
Traceback (most recent call last):
...
dejavu_lab.errors.InputError: --method cats does not use --allocation; it takes --sparsity, --calibration, --calibration-tokens (and --dense-layers, --max-tokens): pass only those.
"""

from __future__ import annotations

from ..errors import InputError
from ..vocab import Method
from ..vocab import method as method_spec

__all__ = ["FLAGS", "check", "given"]

ANY = None  # a flag every method reads
CALIBRATION_TEXT = ("static", "thresholds")  # what is computed from calibration text
# subcommand -> {argparse dest: (flag, the sparsified options it feeds, path)}; the path is
# "method" (read with --method only), "mode" (read with the older --mode only) or "both"
FLAGS: dict[str, dict[str, tuple[str, tuple[str, ...] | None, str]]] = {
    "perplexity": {
        "sparsity": ("--sparsity", ("sparsity",), "method"),
        "mlp_sparsity": ("--mlp-sparsity", ("mlp_sparsity",), "both"),
        "head_sparsity": ("--head-sparsity", ("head_sparsity",), "both"),
        "dense_layers": ("--dense-layers", ANY, "both"),
        "predictors": ("--predictors", ("predictors",), "both"),
        "predictor_mode": ("--predictor-mode", ("predictors",), "method"),
        "allocation": ("--allocation", ("allocation",), "method"),
        # the text of static sets and thresholds; dejavu trains its predictors on it
        "calibration": ("--calibration", (*CALIBRATION_TEXT, "predictors"), "method"),
        "calibration_tokens": ("--calibration-tokens", CALIBRATION_TEXT, "method"),
        "max_tokens": ("--max-tokens", ANY, "method"),
        "static_windows": ("--static-windows", ("static",), "mode"),
    },
    "eval-tasks": {
        "sparsity": ("--sparsity", ("sparsity",), "method"),
        "mlp_sparsity": ("--mlp-sparsity", ("mlp_sparsity",), "method"),
        "head_sparsity": ("--head-sparsity", ("head_sparsity",), "method"),
        "dense_layers": ("--dense-layers", ANY, "method"),
        "predictors": ("--predictors", ("predictors",), "method"),
        "calibration_windows": ("--calibration-windows", CALIBRATION_TEXT, "method"),
        "corpus": ("--corpus", CALIBRATION_TEXT, "method"),  # eval-tasks reads text only there
        "window": ("--window", CALIBRATION_TEXT, "method"),
    },
}


def given(args) -> frozenset[str]:
    """The argparse dests typed on the command line (what :class:`~.args.Parser` recorded).

    >>> from dejavu_lab.cli.main import parser
    >>> sorted(given(parser().parse_args("perplexity --window 8".split())))
    ['command', 'window']
    """
    return frozenset(getattr(args, "flags_given", ()))


def check(args) -> None:
    """Refuse, in one sentence, a flag of ``args.command`` that its method or mode does not
    read, ``--mode`` next to ``--method``, and ``--max-tokens`` below one window.

    >>> from dejavu_lab.cli.main import parser
    >>> check(parser().parse_args("perplexity --method dense --sparsity 0.5".split()))
    Traceback (most recent call last):
    ...
    dejavu_lab.errors.InputError: --method dense runs the model unchanged and reads no --sparsity; ...
    """
    table = FLAGS.get(getattr(args, "command", None))
    if table is None:
        return
    typed = given(args)
    new = getattr(args, "method", None) is not None
    if args.command == "perplexity" and new and "mode" in typed:
        raise InputError(
            f"--mode is the older name of --method; pass --method alone (e.g. --method "
            f"{args.method}, or --method {method_spec(args.mode).name} for --mode {args.mode})."
        )
    path = "method" if new or args.command != "perplexity" else "mode"
    spec = method_spec(args.method if new else args.mode)
    for dest, (flag, feeds, where) in table.items():
        if dest not in typed:
            continue
        if where not in ("both", path):
            if path == "mode":
                raise InputError(f"{flag} goes with --method; pass --method too (e.g. --method "
                                 f"{spec.name}) or drop {flag}.")  # fmt: skip
            raise InputError(
                f"{flag} goes with the older --mode, not with --method; pass --calibration-tokens "
                f"instead (the calibration text --method {spec.name} reads)."
            )
        if feeds is not ANY and not set(feeds) & set(spec.options):
            raise InputError(_unused(spec, flag, table, path, "--method" if new else "--mode"))
    max_tokens = getattr(args, "max_tokens", None)
    if "max_tokens" in typed and max_tokens is not None and max_tokens < args.window:
        raise InputError(
            f"--max-tokens {max_tokens} is less than one window of {args.window} tokens, so "
            f"nothing would be evaluated; pass --max-tokens {args.window} or more, or a smaller "
            "--window."
        )


def _unused(spec: Method, flag: str, table: dict, path: str, how: str) -> str:
    name = f"{how} {spec.name}"
    if spec.family == "dense":
        return (
            f"{name} runs the model unchanged and reads no {flag}; drop it, or pass a sparsity "
            "method (e.g. --method oracle)."
        )
    takes = [
        f
        for f, feeds, where in table.values()
        if feeds is not ANY and where in ("both", path) and set(feeds) & set(spec.options)
    ]
    also = [f for f, feeds, where in table.values() if feeds is ANY and where in ("both", path)]
    return (
        f"{name} does not use {flag}; it takes {', '.join(takes)} (and {', '.join(also)}): "
        "pass only those."
    )
