"""The run directory contract (docs/spec.md §5), shared by every command that writes runs.

A run directory is created new, never reused, and holds ``config.yaml``, ``metrics.jsonl``,
``schedule.jsonl``, ``result.json``, checkpoints and the log. ``dsq table`` reads only these
files. Whole-file writes are atomic (``write_atomic``, from dsq.atomic_files), so a reader
never sees half a ``result.json``; nothing written here may carry a secret (docs/spec.md §7).
Besides the final statuses, ``running`` marks a result.json written when a run starts, so that
``dsq table`` shows unfinished runs as such (docs/spec.md §5).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import logging
import os
import platform
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from dsq.atomic_files import temporaries, write_atomic
from dsq.warn_once import warn_once

# A name that says it holds a secret: one of these words as a whole `_`/`-`/`.`-separated part
# (WANDB_API_KEY, hf_token, aws_secret_access_key), but not max_tokens or sort_keys.
_SECRET_NAME = re.compile(
    r"(^|[_.-])(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)([_.-]|$)",
    re.IGNORECASE,
)
REDACTED = "<redacted>"
LOGGER = __name__
log = logging.getLogger(LOGGER)


def new_run_dir(root: str | os.PathLike, name: str) -> Path:
    """Create and return a new, unique directory under ``root`` named after ``name`` and the
    time (``name-YYYYmmdd-HHMMSS[-N]``); an existing directory is never reused."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "run"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        path = root / (f"{safe}-{stamp}" if attempt == 0 else f"{safe}-{stamp}-{attempt}")
        try:
            path.mkdir()  # atomic: fails if it exists, so two runs never share a directory
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run directory under {root}")


def exact_run_dir(path: str | os.PathLike) -> Path:
    """Create exactly ``path`` (``run.dir=``); refuse one that exists."""
    path = Path(path)
    if path.exists():
        raise ValueError(
            f"run.dir {str(path)!r} already exists; runs never reuse a directory: choose a new "
            "one, or use run.root= to get a fresh name"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    return path


def checkpoint_path(run_dir: str | os.PathLike, which: str) -> Path:
    """A run's checkpoint ``which``: ``last`` or ``best`` (``checkpoints/checkpoint_WHICH.pt``,
    fairseq's names)."""
    return Path(run_dir) / "checkpoints" / f"checkpoint_{which}.pt"


def last_checkpoint(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps the checkpoint it resumes from."""
    return checkpoint_path(run_dir, "last")


def best_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The checkpoint of a run's best validation loss so far (fairseq's name), the model scored
    as ``best`` (docs/training.md, "Which model is scored")."""
    return checkpoint_path(run_dir, "best")


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that atomic writes left in ``run_dir`` and its checkpoints/
    when their process was killed mid-write (SIGKILL skips the cleanup; a checkpoint's can be as
    large as the checkpoint). Only for a run this process holds (`hold`): no write of another
    process can be using them then. Returns what was removed."""
    removed = []
    for directory in (Path(run_dir), Path(run_dir) / "checkpoints"):
        for path in temporaries(directory):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# -- one process trains a run at a time ------------------------------------------------------
# A process that trains a run holds an exclusive lock (flock) on this file of its directory until
# it exits. The kernel drops the lock when the process ends, however it ends (a SIGKILL, a
# crashed node), so a lock never outlives its holder and needs no cleaning up. On a file system
# without locks (some NFS and Lustre mounts) nothing is locked, and that is said once.
LOCK_NAME = ".run.lock"
_held: dict[Path, int] = {}  # lock file -> its open descriptor, holding the lock
# A process asking `in_use` holds a shared lock for an instant; one taking the lock retries for
# about a second before it believes another process holds it.
_ATTEMPTS, _PAUSE_S = 20, 0.05
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


class RunInUse(ValueError):
    """Another live process is training this run directory."""


def _no_locks_here(path: Path, err: OSError) -> None:
    if err.errno not in _NO_LOCKS:
        raise err
    warn_once(
        LOGGER,
        f"dsq: {path.parent}: this file system takes no locks ({os.strerror(err.errno)}); "
        "runs there are not protected from being trained by two processes at once",
    )


def lock_file(path: str | os.PathLike) -> bool:
    """Take an exclusive lock on the file ``path`` (created if missing) for this process until
    it calls `unlock_file` or exits: True when taken (or held here already, or when the file
    system takes no locks), False when another live process holds it."""
    import fcntl

    path = Path(path).resolve()
    if path in _held:
        return True
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(_ATTEMPTS):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _held[path] = fd
            return True
        except BlockingIOError:
            if attempt + 1 < _ATTEMPTS:
                time.sleep(_PAUSE_S)
        except OSError as err:
            os.close(fd)
            _no_locks_here(path, err)
            return True
    os.close(fd)
    return False


def unlock_file(path: str | os.PathLike) -> None:
    """Let go of a lock this process took with `lock_file`."""
    fd = _held.pop(Path(path).resolve(), None)
    if fd is not None:
        os.close(fd)


def locked_elsewhere(path: str | os.PathLike) -> bool:
    """Whether another live process holds the lock on the file ``path`` now."""
    import fcntl

    path = Path(path).resolve()
    if path in _held:
        return False  # this process's own
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # never locked
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError as err:
        _no_locks_here(path, err)
        return False
    finally:
        os.close(fd)  # closing drops the shared lock taken to ask


def hold(run_dir: str | os.PathLike) -> None:
    """Mark ``run_dir`` as trained by this process until it exits (`in_use` tells the others);
    RunInUse when another process holds it. Holding it again is a no-op."""
    if not lock_file(Path(run_dir) / LOCK_NAME):
        raise RunInUse(
            f"{run_dir}: another process is training this run (it holds {LOCK_NAME} there); "
            "wait for it to end, or stop it first"
        )


def release(run_dir: str | os.PathLike) -> None:
    """Let go of a run this process held (`hold`), once its training has ended."""
    unlock_file(Path(run_dir) / LOCK_NAME)


def in_use(run_dir: str | os.PathLike) -> bool:
    """Whether another live process trains ``run_dir`` now (holds its lock)."""
    return locked_elsewhere(Path(run_dir) / LOCK_NAME)


def _json_text(obj) -> str:
    return json.dumps(scrub_secrets(obj), indent=2, sort_keys=True) + "\n"


def write_json(path: str | os.PathLike, obj) -> None:
    write_atomic(path, _json_text(obj))


def overwrite_json(path: str | os.PathLike, obj) -> None:
    """`write_json` in place, not atomically: the last resort when a full disk has no room for
    an atomic write's second copy. Truncating the old file first frees its blocks for the new
    text; a kill during the write can leave it torn, which readers report as unreadable."""
    with open(path, "w") as f:
        f.write(_json_text(obj))


def append_jsonl(path: str | os.PathLike, obj) -> None:
    """Append one JSON object as a line (metrics.jsonl, schedule.jsonl)."""
    line = json.dumps(scrub_secrets(obj), sort_keys=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def _secret_values(environ: Mapping[str, str]) -> set[str]:
    return {v for k, v in environ.items() if _SECRET_NAME.search(k) and len(v) >= 6}


def scrub_secrets(obj, environ: Mapping[str, str] | None = None):
    """``obj`` without secrets: keys that name a secret (``*_KEY``, ``*_TOKEN``, ...) are
    dropped, and any string holding the value of such an environment variable is redacted."""
    secrets = _secret_values(os.environ if environ is None else environ)

    def clean(value):
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items() if not _SECRET_NAME.search(str(k))}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        if isinstance(value, str):
            for secret in secrets:
                if secret in value:
                    value = value.replace(secret, REDACTED)
        return value

    return clean(obj)


def versions(project_dir: str | os.PathLike | None = None) -> dict[str, str | None]:
    """python, torch, fairseq and the project's git commit (None where unknown)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "fairseq"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    project_dir = Path(project_dir or Path(__file__).resolve().parents[1])
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=project_dir,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        out["dsq_commit"] = commit or None
    except (OSError, subprocess.SubprocessError):
        out["dsq_commit"] = None
    return out
