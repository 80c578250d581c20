"""Verified downloads and safe unpacking (docs/spec.md §7).

``fetch`` streams a URL to a temporary name next to its destination, hashing while it writes,
and moves the file into place only when its SHA-256 matches the pinned value; a mismatch or a
broken transfer leaves no file behind and raises ``DownloadError``, whose fields (URL,
destination, checksums, sizes) let each caller say what to do instead. ``extract`` unpacks a
.tgz/.tar.gz/.tar/.zip into a temporary directory, refusing members that would land outside
it, and renames the result into place in one step.

Only the standard library is used (urllib, hashlib, tarfile, zipfile), and dsq.atomic_files
for the final rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

from dsq.atomic_files import atomic_path

log = logging.getLogger("dsq.data")

CHUNK_BYTES = 1 << 20
USER_AGENT = "dsq (urllib; verified download)"


class DownloadError(RuntimeError):
    """A file that could not be obtained and verified.

    ``str()`` is one line saying what failed, with no advice: what to do instead depends on who
    wanted the file (a translation task, a GLUE task), and the fields let that caller say it.
    ``dest`` with ``expected_sha256`` is where a copy placed by hand is picked up.
    """

    def __init__(
        self,
        reason: str,
        *,
        url: str | None = None,
        dest: Path | None = None,
        expected_sha256: str | None = None,
        actual_sha256: str | None = None,
        expected_size: int | None = None,
        received_bytes: int | None = None,
        existing_sha256: str | None = None,
        mirrors_failed: int = 0,
    ) -> None:
        self.reason = _one_line(reason)  # what failed, one sentence
        self.url = url
        self.dest = dest  # where the verified file was to go
        self.expected_sha256 = expected_sha256  # the pinned checksum
        self.actual_sha256 = actual_sha256  # what arrived, on a mismatch
        self.expected_size = expected_size  # the pinned size in bytes, when published
        self.received_bytes = received_bytes  # bytes read before the failure
        self.existing_sha256 = existing_sha256  # a wrong file at dest, left unchanged
        self.mirrors_failed = mirrors_failed  # further URLs tried, all failed
        super().__init__(str(self))

    def __str__(self) -> str:
        notes = [self.reason]
        if self.existing_sha256 is not None:
            notes.append(
                f"The existing {self.dest} has sha256 {self.existing_sha256} and was left "
                "unchanged."
            )
        if self.mirrors_failed:
            notes.append(f"{self.mirrors_failed} mirror(s) failed as well.")
        return " ".join(notes)

    def with_fields(self, **changes) -> DownloadError:
        """A copy with some fields replaced (the same class: an ``ArchiveError`` stays one)."""
        fields = {
            "url": self.url,
            "dest": self.dest,
            "expected_sha256": self.expected_sha256,
            "actual_sha256": self.actual_sha256,
            "expected_size": self.expected_size,
            "received_bytes": self.received_bytes,
            "existing_sha256": self.existing_sha256,
            "mirrors_failed": self.mirrors_failed,
        }
        return type(self)(changes.pop("reason", self.reason), **{**fields, **changes})


class ArchiveError(DownloadError):
    """An archive is unsafe (absolute paths, ``..``, links) or of an unknown kind."""


@contextlib.contextmanager
def built_in_place(out_dir: Path, marker: str) -> Iterator[tuple[Path, Path]]:
    """``(ready, scratch)``: build the finished folder in ``ready`` (``scratch`` is free for
    unpacking); when the block ends without error, ``ready`` is renamed to ``out_dir`` in one
    step (docs/spec.md §7: an interrupted preparation leaves the finished result or nothing). A
    folder that another process renamed into place first, with its ``marker`` file, is kept."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(
        tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".part")
    )
    try:
        ready = work_dir / "ready"
        ready.mkdir()
        yield ready, work_dir / "scratch"
        try:
            os.rename(ready, out_dir)
        except OSError:
            if not (out_dir / marker).is_file():
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _one_line(text: str) -> str:
    # Error messages must stay on one line even when they quote a server's reason phrase.
    return " ".join(text.split())


def fetch(
    url: str, sha256: str | None, dest: Path, *, timeout: float = 60, size: int | None = None
) -> Path:
    """Download ``url`` to ``dest`` unless ``dest`` already holds the file with ``sha256``.

    ``size`` (bytes), when known, rejects a wrong Content-Length before any data is read.
    Raises ``DownloadError`` (``url``, ``dest`` and ``expected_sha256`` always set) on a missing
    checksum, a network or HTTP error, or a mismatch; in every failure no partial file is left
    in ``dest``'s directory.
    """
    dest = Path(dest)
    if not sha256:
        # Never download unverified data: without a pinned checksum there is nothing to check.
        raise DownloadError(
            f"No pinned SHA-256 for {url}, so it is not downloaded.", url=url, dest=dest
        )
    expected = sha256.lower()
    existing: str | None = None  # the sha256 of a wrong file already at dest
    if dest.is_file():
        actual = sha256_of(dest)
        if actual == expected:
            log.info("using %s (sha256 verified)", dest)
            return dest
        # The cache only ever receives verified files, so a mismatch means a corrupt or wrong
        # hand-placed file; it is replaced only once a verified copy has arrived.
        log.warning(
            "%s has sha256 %s, not the pinned %s; downloading again", dest, actual, expected
        )
        existing = actual

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        # On any failure, Ctrl-C included, atomic_path removes the partial file.
        with atomic_path(dest) as tmp_path, open(tmp_path, "wb") as tmp_file:
            actual, n_bytes = _stream(url, tmp_file, timeout=timeout, size=size)
            if actual != expected:
                raise DownloadError(
                    f"Checksum mismatch for {url}: expected sha256 {expected}, got {actual} "
                    f"({n_bytes} bytes).",
                    url=url,
                    actual_sha256=actual,
                    received_bytes=n_bytes,
                )
    except DownloadError as err:
        raise err.with_fields(
            dest=dest, expected_sha256=expected, expected_size=size, existing_sha256=existing
        ) from err
    log.info("downloaded %s -> %s (%d bytes, sha256 verified)", url, dest, n_bytes)
    return dest


def _stream(url: str, out: BinaryIO, *, timeout: float, size: int | None) -> tuple[str, int]:
    """Copy ``url`` into ``out``; return (hex sha256, byte count). Network errors become
    ``DownloadError``."""
    digest = hashlib.sha256()
    n_bytes = 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    log.info("downloading %s", url)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            announced = response.headers.get("Content-Length") if response.headers else None
            if size is not None and announced is not None and announced.isdigit():
                if int(announced) != size:
                    raise DownloadError(
                        f"Download of {url} failed: the server announces {announced} bytes, "
                        f"the pinned file has {size}.",
                        url=url,
                        received_bytes=0,
                    )
            for chunk in iter(lambda: response.read(CHUNK_BYTES), b""):
                out.write(chunk)
                digest.update(chunk)
                n_bytes += len(chunk)
    except DownloadError:
        raise
    except urllib.error.HTTPError as err:
        raise DownloadError(
            f"Download of {url} failed: HTTP {err.code} {err.reason} after {n_bytes} bytes "
            "(nothing was kept).",
            url=url,
            received_bytes=n_bytes,
        ) from err
    except (urllib.error.URLError, OSError, ValueError) as err:
        # URLError: DNS, refused, missing file:// path; OSError: reset or timeout mid-stream;
        # ValueError: a malformed URL.
        reason = getattr(err, "reason", None) or err
        raise DownloadError(
            f"Download of {url} failed after {n_bytes} bytes: {reason} (nothing was kept).",
            url=url,
            received_bytes=n_bytes,
        ) from err
    return digest.hexdigest(), n_bytes


# --------------------------------------------------------------------------- archives


def _safe_parts(name: str, archive: Path) -> tuple[str, ...]:
    """The path components of an archive member, refusing any that could escape the target."""
    posix = PurePosixPath(name.replace("\\", "/"))
    windows = PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or name.startswith("/"):
        raise ArchiveError(f"Refusing {archive}: member {name!r} has an absolute path.")
    if ".." in posix.parts:
        raise ArchiveError(f"Refusing {archive}: member {name!r} leaves the target directory.")
    return tuple(part for part in posix.parts if part not in ("", "."))


def _archive_kind(archive: Path) -> str:
    name = archive.name.lower()
    if name.endswith((".tgz", ".tar.gz")):
        return "r:gz"
    if name.endswith(".tar"):
        return "r:"
    if name.endswith(".zip"):
        return "zip"
    raise ArchiveError(f"Cannot unpack {archive}: expected .tgz, .tar.gz, .tar or .zip.")


def _target(root: Path, parts: tuple[str, ...], name: str, archive: Path) -> Path:
    target = root.joinpath(*parts)
    # Defence in depth: the resolved path must still lie under the temporary root.
    if not target.resolve().is_relative_to(root.resolve()):
        raise ArchiveError(f"Refusing {archive}: member {name!r} leaves the target directory.")
    return target


def _copy_member(source: BinaryIO, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        shutil.copyfileobj(source, out, CHUNK_BYTES)


def _extract_tar(archive: Path, mode: str, root: Path, keep: Callable[[str], bool]) -> None:
    with tarfile.open(archive, mode) as tar:
        # One streaming pass: members are checked and written as they come, so a .tgz is
        # decompressed once; a refusal part-way is cleaned up with the temporary directory.
        for member in tar:
            parts = _safe_parts(member.name, archive)
            if member.issym() or member.islnk():
                raise ArchiveError(f"Refusing {archive}: member {member.name!r} is a link.")
            if not (member.isfile() or member.isdir()):
                raise ArchiveError(
                    f"Refusing {archive}: member {member.name!r} is not a file or directory."
                )
            if not parts or not keep(member.name):
                continue
            target = _target(root, parts, member.name, archive)
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            source = tar.extractfile(member)
            if source is None:  # pragma: no cover - isfile() members always have data
                continue
            with source:
                _copy_member(source, target)


def _extract_zip(archive: Path, root: Path, keep: Callable[[str], bool]) -> None:
    with zipfile.ZipFile(archive) as zipped:
        infos = zipped.infolist()
        for info in infos:  # zip has a central directory: check everything before writing
            _safe_parts(info.filename, archive)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ArchiveError(f"Refusing {archive}: member {info.filename!r} is a link.")
        for info in infos:
            parts = _safe_parts(info.filename, archive)
            if not parts or not keep(info.filename):
                continue
            target = _target(root, parts, info.filename, archive)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            with zipped.open(info) as source:
                _copy_member(source, target)


def extract(archive: Path, into: Path, *, keep: Callable[[str], bool] | None = None) -> Path:
    """Unpack ``archive`` (.tgz, .tar.gz, .tar, .zip) so that ``into`` appears complete or not
    at all. ``keep(member_name)`` selects the members written (all by default); every member
    is still checked. Refuses absolute paths, ``..``, links and special files
    (``ArchiveError``), and an ``into`` that already exists (``FileExistsError``)."""
    archive, into = Path(archive), Path(into)
    if into.exists():
        raise FileExistsError(f"{into} already exists; remove it to unpack {archive} again.")
    kind = _archive_kind(archive)
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(dir=into.parent, prefix=f".{into.name}.", suffix=".part"))
    try:
        keep_member = keep or (lambda _name: True)
        if kind == "zip":
            _extract_zip(archive, tmp_root, keep_member)
        else:
            _extract_tar(archive, kind, tmp_root, keep_member)
        os.rename(tmp_root, into)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as err:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise ArchiveError(
            f"Cannot unpack {archive}: {err}. Delete it so that it is downloaded again."
        ) from err
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise
    return into
