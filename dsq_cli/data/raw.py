"""Reading and checking parallel text: one sentence per line, plain or gzipped, UTF-8.

Every problem is a `DataError` (a ``ValueError``: the CLI reports it in one line, exit code 2)
that names the file and, where there is one, the line.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "valid", "test")


class DataError(ValueError):
    """Input data that cannot be used as it is; the message names the file and the line."""


def open_binary(path: Path):
    """A byte stream over ``path``, gunzipped when it ends in .gz."""
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def read_lines(path: Path) -> list[str]:
    """The lines of ``path`` without their line ends; a decoding error names file and line.
    Only ``\n`` ends a line (bytes are split before decoding), so a stray carriage return or
    Unicode line separator inside a sentence never shifts the alignment of two sides."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing data file {path}")
    lines: list[str] = []
    try:
        with open_binary(path) as stream:
            for raw in stream:
                try:
                    lines.append(raw.decode("utf-8").rstrip("\r\n"))
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}:{len(lines) + 1}: not UTF-8 text ({err.reason})"
                    ) from None
    except (OSError, EOFError) as err:  # a truncated or corrupt .gz
        raise DataError(f"{path}: cannot read ({err}); is the file complete?") from None
    if not lines:
        raise DataError(f"{path} is empty; it must hold one sentence per line")
    return lines


@dataclass
class ParallelSplit:
    """One split of a parallel corpus, aligned line by line."""

    src: list[str]
    tgt: list[str]
    dropped_blank: int = 0  # training pairs left out because one side was blank

    def __len__(self) -> int:
        return len(self.src)


def read_parallel(src_path: Path, tgt_path: Path, *, drop_blank: bool) -> ParallelSplit:
    """Both sides of a split. Mismatched line counts name the shorter file and where it ends.
    A blank line is an error in valid/test (references must align) and dropped in train."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        short, long_ = (src_path, tgt_path) if len(src) < len(tgt) else (tgt_path, src_path)
        n = min(len(src), len(tgt))
        raise DataError(
            f"{long_}:{n + 1}: line has no partner: {short} ends after line {n} "
            f"({len(src)} vs {len(tgt)} lines); the two sides must align line by line"
        )
    kept_src, kept_tgt, dropped = [], [], 0
    for number, (s, t) in enumerate(zip(src, tgt), start=1):
        s, t = " ".join(s.split()), " ".join(t.split())  # one line each, whatever the whitespace
        if s and t:
            kept_src.append(s)
            kept_tgt.append(t)
        elif drop_blank:
            dropped += 1
        else:
            where = src_path if not s else tgt_path
            raise DataError(f"{where}:{number}: blank line; every line must hold a sentence")
    if not kept_src:
        raise DataError(f"{src_path} and {tgt_path} hold no sentence pair with text on both sides")
    return ParallelSplit(kept_src, kept_tgt, dropped)


def find_file(directory: Path, stem: str) -> Path:
    """``directory/stem`` or ``directory/stem.gz``, whichever exists."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise DataError(
        f"{directory} has no {stem} or {stem}.gz"
        + (f" (it holds: {', '.join(present[:12])})" if present else "")
    )


def write_lines(path: Path, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as stream:
        for line in lines:
            stream.write(line.replace("\n", " ") + "\n")
        stream.flush()
        os.fsync(stream.fileno())
