"""Writing files that other processes may read, and locks for work that only one should do.

Every file jspec keeps (the model cache, tuned profiles, training data, heads) is written under a
temporary name in its own folder and renamed into place when complete: ``os.replace`` is atomic on
one file system, so a reader sees the old file or the new one, never half of one, and a process
killed mid-write leaves only a temporary file that no reader takes for a finished one.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import sys
import tempfile

from filelock import FileLock, Timeout

__all__ = [
    "atomic_write",
    "clear_stale_temporaries",
    "exclusive",
    "publish",
    "temporary_dir",
    "temporary_path",
    "write_text",
]

_TMP = ".tmp-"  # every temporary name starts with "." and holds this, then the writer's pid


def temporary_path(path) -> pathlib.Path:
    """A unique name beside ``path`` for writing it before the rename: ``.NAME.tmp-PID-RANDOM``."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}{_TMP}{os.getpid()}-{secrets.token_hex(4)}")


def publish(tmp: pathlib.Path, path: pathlib.Path) -> None:
    """Renames a finished file into place, its bytes on disk first."""
    with open(tmp, "rb") as f:  # the bytes reach the disk before the name does
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_write(path):
    """``with atomic_write(path) as tmp:`` write ``tmp`` (a path); on success it replaces ``path`` whole,
    on an exception (or a kill) ``path`` is untouched."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text: str) -> pathlib.Path:
    """``path.write_text(text)``, atomically."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    return pathlib.Path(path)


@contextlib.contextmanager
def temporary_dir(path):
    """``with temporary_dir(path) as tmp:`` fill the folder ``tmp``; on success it becomes ``path`` (an
    older ``path`` is replaced), on an exception it is removed. Hold :func:`exclusive` for ``path`` when
    another process may publish it too."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}{_TMP}{os.getpid()}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder is as readable as any other
    try:
        yield tmp
        if path.exists():
            old = temporary_path(path)
            os.replace(path, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clear_stale_temporaries(folder, name: str | None = None) -> list[pathlib.Path]:
    """Removes the temporary files and folders of writers that died (``kill -9``) in ``folder`` (only those
    for ``name`` when given); a live writer's are kept. Returns what was removed."""
    folder = pathlib.Path(folder)
    removed = []
    for p in folder.glob(f".{name or ''}*{_TMP}*") if folder.is_dir() else ():
        try:
            pid = int(p.name.rsplit(_TMP, 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def exclusive(path, what: str):
    """Holds an inter-process lock on ``path`` (a ``.lock`` file beside it, via the ``filelock`` package)
    for the block; says on stderr when it waits for another process doing ``what``."""

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.with_name(path.name + ".lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another jspec process {what} ({lock.lock_file}) ...", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
