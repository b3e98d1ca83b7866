"""Helpers of the bad-input audit (tests/test_bad_inputs*.py): a refusal is one exception of the
expected type whose message is one sentence saying what is wrong and what to do, and no file
changed (the test's folder, the cache and the results folder are hashed before and after).

With ``DEJAVU_AUDIT_LOG=file.tsv`` every refusal appends ``test id<TAB>error type<TAB>message``
to that file: the list of bad inputs tried, with their messages, for a report.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

# a message says what to do: it names an action (or shows the value to use, "e.g. ...")
ACTION = re.compile(
    r"\b(use|pass|run|train|collect|delete|set|make|free|load|copy|wrap|return|choose|tokenize|"
    r"lower|save|rerun|join|reshape|build|install|check|remove|write|connect|wait|stop|add|"
    r"skip|decode|give|cut|re-run|cast|move)\b|e\.g\.",
    re.IGNORECASE,
)


def tree(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def sentence(msg: str, kind: str = "CLI exit 2") -> str:
    """Check that ``msg`` is one line that says what to do; return it."""
    msg = msg.strip()
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    assert len(msg) < 400, msg
    assert ACTION.search(msg), f"the message does not say what to do: {msg}"
    log(kind, msg)
    return msg


def log(kind: str, msg: str) -> None:
    if path := os.environ.get("DEJAVU_AUDIT_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{test}\t{kind}\t{msg}\n")


def message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def refuse(roots, call, error, *words):
    """``call()`` raises ``error``, one sentence holding every one of ``words``; no file changes."""
    before = tree(*roots)
    with pytest.raises(error) as e:
        call()
    msg = sentence(message(e.value), type(e.value).__name__)
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    assert tree(*roots) == before, "a refused input changed a file"
    return msg
