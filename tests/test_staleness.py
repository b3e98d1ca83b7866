"""A recording says how far the code it timed has moved: checked in a throwaway git repository."""

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from dejavu_lab import results, staleness


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """Commits: a benchmark, the book and a checking script (not dependencies), the engine twice."""
    _git(tmp_path, "init", "-q")
    shas = []
    for path, text in (("kernels/bench_mlp.py", "0"), ("book/a.md", "1"), ("kernels/check.py", "2"),
                       ("dejavu_lab/engine/step.py", "3"), ("dejavu_lab/engine/step.py", "4")):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "commit", "-qm", text)
        shas.append(_git(tmp_path, "rev-parse", "HEAD"))
    return tmp_path, shas


def test_counts_only_commits_that_touch_the_timed_code(repo):
    root, shas = repo
    first = staleness.staleness(shas[0], root=root)
    # the book and kernels/check.py are no dependencies of a recording
    assert (first.commit, first.behind, first.dirty_here) == (shas[0], 2, False)
    assert staleness.staleness(shas[3] + "-dirty", root=root).recorded_dirty
    assert staleness.note({"git_sha": shas[2]}, root=root) == (
        f"measured at {shas[2][:7]}, 2 commits to the kernels and engine ago"
    )
    assert staleness.note({"git_sha": shas[4]}, root=root).endswith(
        "the kernels and engine unchanged since"
    )
    assert staleness.note({"git_sha": shas[3]}, root=root).endswith(
        "1 commit to the kernels and engine ago"
    )


def test_uncommitted_changes_here_are_said(repo):
    root, shas = repo
    (root / "kernels" / "bench_mlp.py").write_text("changed")
    staleness._git.cache_clear()  # the answers are cached per process
    try:
        assert staleness.note({"git_sha": shas[4]}, root=root).endswith(
            "uncommitted changes to the kernels and engine here since"
        )
        assert "2 commits and uncommitted changes here" in staleness.note(
            {"git_sha": shas[2]}, root=root
        )
    finally:
        staleness._git.cache_clear()


def test_each_repeat_names_its_own_commit(repo):
    root, shas = repo
    prov = {"git_sha": shas[0], "repeats": [{"git_sha": shas[0]}, {"git_sha": shas[3]}]}
    frame = pd.DataFrame({"ms": [1.0, 1.1, 1.2], "repeat": [0, 1, 1]})
    assert staleness.row_commits(frame, prov) == [shas[0], shas[3], shas[3]]
    text = staleness.note(prov, frame, root=root)
    assert f"{shas[0][:7]}, 2 commits" in text and f"{shas[3][:7]}, 1 commit " in text
    assert f"{shas[3][:7]}" not in staleness.note(prov, frame[:1], root=root)


def test_unknown_without_git_history(tmp_path, repo):
    _, shas = repo
    tarball = tmp_path / "unpacked"  # a copy of the tree without .git
    tarball.mkdir()
    assert staleness.staleness(shas[0], root=tarball).behind is None
    assert staleness.note({"git_sha": shas[0]}, root=tarball) == (
        f"measured at {shas[0][:7]}, its age unknown here (no git history with that commit)"
    )
    assert staleness.note({"git_sha": "unknown"}, root=tarball) == "measured at an unknown commit"
    root, _ = repo  # a commit this history never had (a shallow clone, another fork)
    assert staleness.staleness("0123456789abcdef", root=root).behind is None


def test_every_recording_in_results_has_a_note():
    """Each file the book draws resolves to a commit (the check a reader's caption relies on)."""
    for name in results.list_results():
        frame, prov = results.load(name)
        assert staleness.note(prov, frame).startswith("measured at "), name
