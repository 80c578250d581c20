"""Atomic file writes: a reader sees the old file or the complete new one, never half of it.

Both helpers write a temporary file in the destination's directory (same filesystem, so the
final ``os.replace`` is one rename), flush it to disk, and rename it over the destination; on
any failure, Ctrl-C included, the temporary file is removed and the destination is untouched.

* ``write_atomic(path, data)``: text (UTF-8) or bytes held in memory.
* ``atomic_path(path)``: a context manager yielding the temporary path, for writers that open
  the file themselves (``torch.save``, ``Figure.savefig``).
* ``temporaries(directory)``: the temporary files such writes left in a directory. A writer
  killed mid-write (SIGKILL, a lost machine) never runs its cleanup; whoever owns the directory
  removes them when no write can be using them.

The temporary file gets the permissions a plain ``open(path, "w")`` would give (0o666 less the
umask), so the result looks like any other file the user writes.

Only the standard library is used: anything in dsq may import this module.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

# A temporary file's name: ``.NAME.XXXXXXXX.tmp`` beside NAME, eight random hex digits.
_RANDOM_BYTES = 4
_TEMPORARY_NAME = re.compile(rf"\..+\.[0-9a-f]{{{2 * _RANDOM_BYTES}}}\.tmp")


def _create_temporary(path: Path) -> Path:
    """A new empty file next to ``path``, hidden (leading dot) and named after it."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(_RANDOM_BYTES)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without error, the file
    written there replaces ``path`` in one rename. The directory must exist."""
    path = Path(path)
    tmp = _create_temporary(path)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (a ``str`` is encoded as UTF-8) to ``path`` atomically."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        tmp.write_bytes(payload)


def temporaries(directory: str | os.PathLike) -> list[Path]:
    """The temporary files of atomic writes in ``directory`` (not below it), sorted: each is
    either being written now or left by a writer that was killed. Only the directory's owner
    knows which, so removing them is the caller's decision."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if _TEMPORARY_NAME.fullmatch(p.name) and p.is_file()
    )
