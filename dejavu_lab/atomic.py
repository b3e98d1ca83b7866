"""Crash-safe files: atomic writes and a lock, for everything the package writes.

A kill at any instant (``kill -9``, a full disk, a power cut) must leave either the old file or
the new one, never half of one, and two processes writing the same collection or cache entry
must neither corrupt it nor crash. So every write here

1. goes to a temporary name unique to the process (``.{name}.{pid}-{random}.partial``) in the
   destination's own folder (a rename across file systems would not be atomic),
2. is flushed and ``fsync``-ed, then renamed over the destination with :func:`os.replace`
   (atomic on POSIX and Windows), and the folder is ``fsync``-ed so the rename survives too;

and :func:`locked` holds an exclusive ``flock`` on a folder or a lock file while a process fills
it. A second process *waits* (saying so once on stderr) rather than failing: what it wants is
the same data, which the first process is producing; once it gets the lock it finds the work
done and returns at once. ``timeout=`` (or ``$DEJAVU_LAB_LOCK_TIMEOUT`` seconds) makes it give
up with :class:`BusyError` instead. ``flock`` locks die with their process, so a killed writer
never leaves a stale lock; its stale ``.partial`` files are removed by :func:`clean_partials`.

Disk errors become one sentence naming the folder and what to free or fix
(:class:`WriteError`), not a traceback from deep inside safetensors.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import DEFAULT_HINT, BusyError, WriteError

try:  # POSIX; on Windows the lock is a no-op (the atomic renames still keep files whole)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "BusyError",
    "WriteError",
    "clean_partials",
    "locked",
    "make_dirs",
    "replacing",
    "save_tensors",
    "write_bytes",
    "write_json",
    "write_text",
]

ENV_TIMEOUT = "DEJAVU_LAB_LOCK_TIMEOUT"  # seconds to wait for a lock before giving up
PARTIAL = ".partial"  # suffix of temporary files; the name says which process wrote it


def make_dirs(path: str | os.PathLike, *, hint: str = DEFAULT_HINT) -> Path:
    """``mkdir -p``; a read-only or full disk is a :class:`WriteError` naming the folder.

    >>> import tempfile
    >>> make_dirs(Path(tempfile.mkdtemp()) / "a" / "b").is_dir()
    True
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        there = _existing_parent(path)
        if e.errno in (errno.EEXIST, errno.ENOTDIR) and not there.is_dir():
            raise WriteError(f"{there} exists and is not a folder; remove it or {hint}.") from None
        raise WriteError(WriteError.explain(e, there, hint)) from None
    return path


def _existing_parent(path: Path) -> Path:
    """The deepest of ``path`` and its parents that exists (a folder, or a file in the way)."""
    for p in [path, *path.parents]:
        if p.exists():
            return p
    return path


def _write(f, data: bytes) -> None:
    """Write ``data`` to the open file ``f`` (one place, so tests can simulate a full disk)."""
    f.write(data)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on folders; the rename is still atomic
        pass
    finally:
        os.close(fd)


@contextmanager
def replacing(
    path: str | os.PathLike, *, hint: str = DEFAULT_HINT, need: int = 0
) -> Iterator[BinaryIO]:
    """Write ``path`` through a binary file that replaces it only if the block completes.

    The file is a temporary one in the same folder, unique to the process; on leaving the block
    it is flushed, fsync-ed and renamed over ``path``. An exception inside the block (a checksum
    that does not match, a Ctrl-C) removes it and leaves ``path`` as it was. ``hint`` says where
    else to write when the disk is full or read-only; ``need`` (bytes) how much the whole job
    still has to write, for that message.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "x.bin"
    >>> with replacing(path) as f:
    ...     _ = f.write(b"abc")
    >>> path.read_bytes(), sorted(p.name for p in path.parent.iterdir())  # no temporary left
    (b'abc', ['x.bin'])
    """
    path = Path(path)
    folder = make_dirs(path.parent, hint=hint)
    tmp = folder / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL}"
    try:
        with open(tmp, "xb") as f:  # O_EXCL; permissions from the umask, as any other file
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(WriteError.explain(e, folder, hint, need)) from None
    except BaseException:  # the block refused the data, or a KeyboardInterrupt
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)


def write_bytes(
    path: str | os.PathLike, data: bytes, *, hint: str = DEFAULT_HINT, need: int = 0
) -> Path:
    """Atomically replace ``path`` with ``data`` (:func:`replacing`); return ``path``.

    >>> import tempfile
    >>> write_bytes(Path(tempfile.mkdtemp()) / "x.bin", b"abc").read_bytes()
    b'abc'
    """
    with replacing(path, hint=hint, need=max(need, len(data))) as f:
        _write(f, data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, **kw) -> Path:
    """:func:`write_bytes` of UTF-8 text.

    >>> import tempfile
    >>> write_text(Path(tempfile.mkdtemp()) / "note.txt", "hello").read_text()
    'hello'
    """
    return write_bytes(path, text.encode("utf-8"), **kw)


def write_json(path: str | os.PathLike, obj, **kw) -> Path:
    """:func:`write_bytes` of ``json.dumps(obj, indent=1)`` (NaN refused: it is not JSON).

    >>> import tempfile
    >>> write_json(Path(tempfile.mkdtemp()) / "m.json", {"n_chunks": 2}).read_text()
    '{\\n "n_chunks": 2\\n}'
    """
    return write_text(path, json.dumps(obj, indent=1, allow_nan=False), **kw)


def save_tensors(
    path: str | os.PathLike, tensors: dict, metadata: dict | None = None, **kw
) -> Path:
    """Atomically write a safetensors file (serialised in memory, then :func:`write_bytes`).

    >>> import tempfile, torch
    >>> from safetensors.torch import load_file
    >>> path = save_tensors(Path(tempfile.mkdtemp()) / "t.safetensors", {"w": torch.ones(2)})
    >>> load_file(path)["w"]
    tensor([1., 1.])
    """
    from safetensors.torch import save

    return write_bytes(path, save(tensors, metadata=metadata), **kw)


def clean_partials(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that killed writers left in ``folder``; return them.

    Only files of processes that no longer run are removed, so calling this while another
    process writes there is safe (it is meant to be called under :func:`locked`).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / f".chunk.safetensors.999999999-ab12cd34{PARTIAL}").write_bytes(b"half")
    >>> [p.name for p in clean_partials(folder)], list(folder.iterdir())
    (['.chunk.safetensors.999999999-ab12cd34.partial'], [])
    """
    removed = []
    for p in Path(folder).glob(f".*{PARTIAL}"):
        pid = p.name[: -len(PARTIAL)].rsplit(".", 1)[-1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except PermissionError:  # it runs, as another user
        return True
    except (OSError, OverflowError):  # no such process (or no such pid at all)
        return False
    return True


@contextmanager
def locked(
    path: str | os.PathLike,
    *,
    what: str,
    timeout: float | None = None,
    hint: str = DEFAULT_HINT,
) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (a folder, or a lock file created if missing).

    A second process waits until the first releases it (or dies: ``flock`` locks die with their
    process), saying once on stderr, after half a second, that another process is ``what``.
    With ``timeout`` seconds (default ``$DEJAVU_LAB_LOCK_TIMEOUT``, else forever) it raises
    :class:`BusyError` instead.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with locked(folder, what="collecting into it"):
    ...     print("only one process at a time here")
    only one process at a time here
    """
    path = Path(path)
    if timeout is None and os.environ.get(ENV_TIMEOUT):
        timeout = float(os.environ[ENV_TIMEOUT])
    if fcntl is None:  # pragma: no cover - Windows: atomic renames only
        yield
        return
    try:
        if path.is_dir():
            fd = os.open(path, os.O_RDONLY)
        else:
            make_dirs(path.parent, hint=hint)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise WriteError(WriteError.explain(e, path.parent, hint)) from None
    try:
        _acquire(fd, path, what, timeout)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _acquire(fd: int, path: Path, what: str, timeout: float | None) -> None:
    t0, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - t0
        if timeout is not None and waited >= timeout:
            raise BusyError(
                f"Another process is {what} ({path}); wait for it to finish, stop it, "
                "or write somewhere else."
            )
        if not told and waited >= 0.5:  # a short wait (or a quick timeout) stays quiet
            print(
                f"dejavu_lab: another process is {what} ({path}); waiting for it to finish "
                "(Ctrl-C to stop).",
                file=sys.stderr,
            )
            told = True
        time.sleep(0.05 if waited < 1 else 0.25)
