"""How old a recording is: the commit it measured beside the code it timed.

Every results file records the commit it measured (``provenance["git_sha"]``); a run added with
:func:`dejavu_lab.results.add_repeat` records its own (``provenance["repeats"][k]``), so every
row maps to exactly one commit (:func:`row_commits`). A figure drawn from a recording says when
the code the recording timed has changed since (:func:`note`): *measured at 360074a, 123 commits
to the kernels and engine ago*.

Only ``git`` is asked (``git rev-list --count <sha>..HEAD -- <paths>``), once per question per
process, so the book builds offline and fast. A tree without ``.git`` (a tarball, a copy on a
GPU box), a shallow clone that lacks the commit, or no ``git`` at all reads "unknown", never an
error.
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEPENDS", "Staleness", "commit_of", "note", "row_commits", "staleness"]

#: what a speed recording depends on: the kernels, the engine, the shared timing harness and
#: the scripts that drive them (git pathspecs, relative to the repository root)
DEPENDS = ("dejavu_lab/kernels", "dejavu_lab/engine", "dejavu_lab/bench", "kernels/bench_*.py",
           "kernels/profile_*.py")  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent  # the repository this package runs from
_HEX = re.compile(r"[0-9a-f]{7,40}")


def commit_of(sha: object) -> str | None:
    """The commit id at the start of a recorded ``git_sha`` (which may carry ``-dirty`` or a
    ``+label``), or None when there is none.

    >>> commit_of("360074a752985ee94e215d89fc05b43cf8661864-dirty")[:7], commit_of("unknown")
    ('360074a', None)
    """
    found = _HEX.match(str(sha or "").strip().lower())
    return found.group(0) if found else None


@functools.lru_cache(maxsize=256)
def _git(root: str, *args: str) -> str | None:
    """stdout of ``git args`` in ``root``, or None when git or the answer is not there."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@dataclass(frozen=True)
class Staleness:
    """One recorded commit against the code here.

    >>> Staleness("360074a", 12, False, False).behind
    12
    """

    commit: str | None  # the recorded commit (a hex prefix); None when the recording has none
    behind: int | None  # commits since it that touched the paths; None when git cannot say
    recorded_dirty: bool  # measured with uncommitted changes (the sha carries a suffix)
    dirty_here: bool  # the paths have uncommitted changes in this tree


def staleness(sha: object, paths=DEPENDS, root: str | Path = ROOT) -> Staleness:
    """How many commits touched ``paths`` between the recorded ``sha`` and ``HEAD`` in ``root``.

    >>> s = staleness("not a commit")
    >>> s.commit, s.behind
    (None, None)
    """
    commit = commit_of(sha)
    rest = str(sha or "").strip()[len(commit or "") :]
    behind = dirty_here = None
    top = _git(str(root), "rev-parse", "--show-toplevel")
    # a tree without its own .git (a tarball unpacked inside another repository) knows nothing
    if commit is not None and top is not None and Path(top.strip()) == Path(root).resolve():
        count = _git(str(root), "rev-list", "--count", f"{commit}..HEAD", "--", *paths)
        behind = int(count) if count is not None and count.strip().isdigit() else None
        if behind is not None:
            status = _git(str(root), "status", "--porcelain", "--untracked-files=no", "--", *paths)
            dirty_here = bool(status and status.strip())
    return Staleness(commit, behind, bool(commit and rest), bool(dirty_here))


def row_commits(frame, prov: dict) -> list[str | None]:
    """The commit each row of a recording measured: its repeat's (``provenance["repeats"]``,
    indexed by the row's ``repeat``), else the file's.

    >>> import pandas as pd
    >>> prov = {"git_sha": "aaaaaaa", "repeats": [{"git_sha": "aaaaaaa"}, {"git_sha": "bbbbbbb"}]}
    >>> row_commits(pd.DataFrame({"ms": [1.0, 2.0, 3.0], "repeat": [0, 1, 1]}), prov)
    ['aaaaaaa', 'bbbbbbb', 'bbbbbbb']
    >>> row_commits(pd.DataFrame({"ms": [1.0]}), {"git_sha": "ccccccc"})
    ['ccccccc']
    """
    runs = prov.get("repeats") or []
    if "repeat" not in frame:
        return [prov.get("git_sha")] * len(frame)
    out = []
    for k in frame["repeat"]:
        known = k is not None and k == k and 0 <= int(k) < len(runs)  # k == k: not NaN
        out.append((runs[int(k)] if known else prov).get("git_sha"))
    return out


def _one(s: Staleness, what: str) -> str:
    text = s.commit[:7] + (" (with uncommitted changes)" if s.recorded_dirty else "")
    if s.behind is None:
        return f"{text}, its age unknown here (no git history with that commit)"
    here = " and uncommitted changes here" if s.dirty_here else ""
    if s.behind == 0:
        changed = f"uncommitted changes to {what} here" if s.dirty_here else f"{what} unchanged"
        return f"{text}, {changed} since"
    plural = "commit" if s.behind == 1 else "commits"
    return f"{text}, {s.behind} {plural}{here} to {what} ago"


def note(prov: dict, frame=None, *, paths=DEPENDS, what: str = "the kernels and engine",
         root: str | Path = ROOT) -> str:  # fmt: skip
    """A caption's clause on a recording's age: the commit(s) its rows measured and how many
    commits have touched ``paths`` since (every row of ``frame``; without it, the file's run and
    its repeats).

    >>> from dejavu_lab import results
    >>> note(results.load("engine_e2e")[1])  # e.g. 'measured at 360074a, 123 commits to ... ago'
    'measured at ...'
    >>> note({"git_sha": "unknown"})
    'measured at an unknown commit'
    """
    if frame is not None:
        shas = row_commits(frame, prov)
    else:
        shas = [prov.get("git_sha")] + [r.get("git_sha") for r in prov.get("repeats") or []]
    seen = list(dict.fromkeys(s for s in shas if s is not None))
    states = [staleness(s, paths, root) for s in seen]
    known = [s for s in states if s.commit is not None]
    if not known:
        return "measured at an unknown commit"
    parts = list(dict.fromkeys(_one(s, what) for s in known))
    return "measured at " + "; ".join(parts)
