"""Helpers of the bad-input audit (tests/test_bad_inputs*.py): a refusal is one exception of the
expected type whose message is one sentence saying what is wrong and what to do, and no file
changed (the test's folder, the cache and the results folder are hashed before and after)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

# a message says what to do: it names an action (or shows the value to use, "e.g. ...")
ACTION = re.compile(
    r"\b(use|pass|run|train|collect|delete|set|make|free|load|copy|wrap|return|choose|tokenize|"
    r"lower|save|rerun|join|reshape|build|install|check|remove|keep|hold|write|connect|wait|"
    r"stop|add|skip|decode|give|start|stay|cut|collecting|training|tokenizing)\b|e\.g\.",
    re.IGNORECASE,
)


def tree(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def sentence(msg: str) -> str:
    """Check that ``msg`` is one line that says what to do; return it."""
    msg = msg.strip()
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    assert len(msg) < 400, msg
    assert ACTION.search(msg), f"the message does not say what to do: {msg}"
    return msg


def message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def refuse(roots, call, error, *words):
    """``call()`` raises ``error``, one sentence holding every one of ``words``; no file changes."""
    before = tree(*roots)
    with pytest.raises(error) as e:
        call()
    msg = sentence(message(e.value))
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    assert tree(*roots) == before, "a refused input changed a file"
    return msg
