"""The pins resolve on a Linux GPU box, not only here.

Here torch comes from local disk as a ``+cpu`` wheel that requires no triton; on a Linux box with
the public index, ``torch==2.13.0`` is the CUDA build, whose metadata pins its own triton. A pin
of ours that disagrees with it makes ``pip install`` fail before anything runs. This test reads
torch's metadata for ``manylinux_2_28_x86_64`` from the index (``pip install --dry-run
--report``: no wheel is downloaded) and checks every pin of ``pyproject.toml`` and
``environment.yml`` against it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LINUX = {
    "platform_system": "Linux",
    "sys_platform": "linux",
    "python_version": "3.11",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def our_pins() -> dict[str, Requirement]:
    """Every ``name==version`` of the project (dependencies and all extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    out = {}
    for text in reqs:
        r = Requirement(text)
        out[r.name.lower()] = r
    return out


def test_every_dependency_is_pinned_once():
    pins = our_pins()
    assert pins["torch"].specifier == ">=0" or str(pins["torch"].specifier) == "==2.13.0"
    loose = [str(r) for r in pins.values() if not str(r.specifier).startswith("==")]
    assert loose == [], f"unpinned: {loose}"


def test_environment_yml_mirrors_the_torch_pin():
    env = (ROOT / "environment.yml").read_text()
    assert re.search(r"torch==2\.13\.0\b", env), "environment.yml must install torch==2.13.0"


def _linux_metadata(spec: str) -> dict:
    """The index's metadata of ``spec`` for Linux x86_64, Python 3.11 (no download)."""
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--quiet",
           "--report", "-", "--ignore-installed", "--no-deps", "--target", "/nonexistent",
           "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
           "--only-binary=:all:", "--index-url", "https://pypi.org/simple", spec]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer in 120 s")
    if out.returncode != 0:
        if re.search(r"connection|resolve|network|Max retries|timed out", out.stderr, re.I):
            pytest.skip(f"no package index here: {out.stderr.strip().splitlines()[-1]}")
        raise AssertionError(f"pip could not read {spec} for Linux: {out.stderr[-2000:]}")
    (item,) = json.loads(out.stdout)["install"]
    return item["metadata"]


def test_pins_agree_with_the_linux_cuda_torch():
    """torch's own Linux requirements (triton, above all) admit our pins of the same packages."""
    pins = our_pins()
    meta = _linux_metadata(str(pins["torch"]))
    assert meta["version"] == "2.13.0"
    clashes, seen = [], []
    for text in meta.get("requires_dist", []):
        need = Requirement(text)
        if need.marker is not None and not need.marker.evaluate(LINUX):
            continue
        ours = pins.get(need.name.lower())
        if ours is None:
            continue
        seen.append(need.name)
        pinned = next(iter(ours.specifier)).version
        if not need.specifier.contains(pinned, prereleases=True):
            clashes.append(f"we pin {ours}, torch {meta['version']} on Linux needs {need}")
    assert "triton" in seen, "torch's Linux metadata names no triton: the check read nothing"
    assert clashes == [], "; ".join(clashes)


def test_marker_evaluation_is_what_the_check_assumes():
    assert Marker('platform_system == "Linux" and python_version < "3.15"').evaluate(LINUX)
