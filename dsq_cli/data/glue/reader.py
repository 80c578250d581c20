"""The strict reader of GLUE's TSV files: ``read_examples(task, path)`` turns one file of a task
into ``GlueExample``s, naming ``file:line`` for anything it cannot read; ``text_lines`` is its
line splitter, also used for MRPC's source files.

File format decisions (the columns, header and labels are the task's, see ``tasks``)
- Bytes are decoded as UTF-8 (a leading byte-order mark is dropped: the MRPC sources have one);
  a decoding error names the file, the line and the byte offset.
- Only ``\\n`` ends a line; a trailing ``\\r`` is dropped and a stray one inside a line becomes a
  space, so line numbers always count file lines (1-based, the header being line 1).
- Fields are split by ``csv`` with ``delimiter="\\t", quoting=csv.QUOTE_NONE``: GLUE sentences
  contain unbalanced quotes, which must stay text.
- Tasks with a header (all but CoLA) find their columns by header name; a row needs at least
  as many fields as the rightmost column used, and fields beyond the header are ignored (as
  csv.DictReader does). CoLA has no header: exactly four fields, ``source, label,
  original mark, sentence``.
- Sentences are stripped of surrounding whitespace (SST-2 lines end in a space); inner
  whitespace is kept. An empty sentence is an error in the dev file; in ``train.tsv`` such rows
  are dropped and counted in the manifest (QQP's train file has two empty questions), as
  the translation tasks drop blank training pairs.
- Blank lines at the end of a file are ignored; a blank line between examples is an error.
- Labels are class indices into the task's fixed ``labels`` tuple: SST-2, CoLA, MRPC, QQP
  ``("0", "1")``; RTE, QNLI ``("entailment", "not_entailment")``; MNLI ``("contradiction",
  "entailment", "neutral")`` (sorted, the order of fairseq's label dictionary). STS-B is
  regression: ``labels`` is None, ``num_classes`` 1, and the label is the score, a float in
  0..5.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..raw import DataError

if TYPE_CHECKING:
    from .tasks import GlueTask

log = logging.getLogger("dsq.data")

Column = str | int  # a header name, or a 0-based field index in a file without header


@dataclass(frozen=True)
class GlueExample:
    """One example: one or two texts and a class index (float score for STS-B)."""

    text_a: str
    text_b: str | None
    label: int | float


@dataclass
class ReadResult:
    """What one file gave: its examples, the SHA-256 of its bytes, the rows dropped as empty."""

    examples: list[GlueExample]
    sha256: str
    dropped_empty: int


def text_lines(path: Path, on_bytes: Callable[[bytes], object] | None = None) -> Iterator[str]:
    """The text lines of ``path`` (see the module docstring); ``on_bytes`` sees every raw line
    (a digest's update: the file is hashed in the same pass)."""
    offset = 0
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            if on_bytes is not None:
                on_bytes(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{number}: not UTF-8 text at byte offset {offset + err.start} "
                    f"({err.reason}); save the file as UTF-8"
                ) from None
            offset += len(raw)
            if number == 1:
                line = line.removeprefix("\ufeff")
            # csv refuses a bare \r inside an unquoted field; as a space it cannot split a line.
            yield line.removesuffix("\n").removesuffix("\r").replace("\r", " ")


def read_examples(task: GlueTask, path: Path, *, drop_empty: bool) -> ReadResult:
    """The examples of one GLUE TSV file of ``task`` in file order, the file's SHA-256 and the
    count of rows dropped for an empty sentence (``drop_empty``; otherwise such a row fails).

    Raises ``DataError`` naming ``file:line`` for a malformed row (too few fields, an unknown
    label, a bad score, an empty sentence), a missing header, non-UTF-8 bytes or an empty file."""
    if not path.is_file():
        raise DataError(f"missing GLUE file {path}; expected {task.describe_files()}")
    digest = hashlib.sha256()
    reader = csv.reader(text_lines(path, digest.update), delimiter="\t", quoting=csv.QUOTE_NONE)
    rows = enumerate(reader, start=1)
    examples: list[GlueExample] = []
    dropped = 0
    blank_at: int | None = None  # the first of a run of blank lines not yet followed by data
    indices: tuple[int, int | None, int] | None = None
    needed = len(task.field_names)
    for number, row in rows:
        if not any(value.strip() for value in row):
            blank_at = blank_at or number
            continue
        if blank_at is not None:
            raise DataError(
                f"{path}:{blank_at}: blank line between examples; every line must hold one"
            )
        if indices is None:
            indices, needed = _columns(task, path, number, row)
            if task.has_header:
                continue
        a_index, b_index, label_index = indices
        if len(row) < needed or (not task.has_header and len(row) != needed):
            raise DataError(
                f"{path}:{number}: {len(row)} tab-separated field(s), expected "
                f"{_expected_fields(task, needed)}; is a tab missing, or is it the wrong file?"
            )
        text_a = row[a_index].strip()
        text_b = row[b_index].strip() if b_index is not None else None
        empty = [
            _column_name(task, column)
            for column, text in ((task.text_a_column, text_a), (task.text_b_column, text_b))
            if column is not None and not text
        ]
        if empty:
            if drop_empty:
                dropped += 1
                continue
            raise DataError(
                f"{path}:{number}: empty {' and '.join(empty)}; every example needs its text"
            )
        label = _label(task, path, number, row[label_index].strip())
        examples.append(GlueExample(text_a, text_b, label))
    if indices is None:
        raise DataError(f"{path} is empty; expected {task.describe_files()} with examples")
    if not examples:
        kept = f" ({dropped} dropped for an empty sentence)" if dropped else ""
        raise DataError(f"{path} holds no examples{kept}; expected {task.describe_files()}")
    if dropped:
        log.warning("%s: dropped %d row(s) with an empty sentence", path, dropped)
    return ReadResult(examples, digest.hexdigest(), dropped)


def _columns(
    task: GlueTask, path: Path, number: int, first_row: list[str]
) -> tuple[tuple[int, int | None, int], int]:
    """Field indices of text_a, text_b and label, and the fields a row needs; ``first_row``
    (line ``number``) is the header when the task has one."""
    columns = (task.text_a_column, task.text_b_column, task.label_column)
    if not task.has_header:
        a, b, label = (int(c) if c is not None else None for c in columns)
        return (a, b, label), len(task.field_names)
    header = {name.strip(): i for i, name in enumerate(first_row)}
    wanted = [str(c) for c in columns if c is not None]
    missing = [name for name in wanted if name not in header]
    if missing:
        what = "no header" if len(missing) == len(wanted) else "a header without"
        shown = "\t".join(first_row)[:80]
        raise DataError(
            f"{path}:{number}: {what} column(s) {', '.join(missing)}: the line is {shown!r}; "
            f"GLUE {task.folder} files start with a header naming {', '.join(wanted)}"
        )
    a, b, label = (header[str(c)] if c is not None else None for c in columns)
    return (a, b, label), max(i for i in (a, b, label) if i is not None) + 1


def _column_name(task: GlueTask, column: Column) -> str:
    return task.field_names[column] if isinstance(column, int) else column


def _expected_fields(task: GlueTask, needed: int) -> str:
    if not task.has_header:
        return f"{needed} ({', '.join(task.field_names)})"
    return f"at least {needed} as in the header"


def _label(task: GlueTask, path: Path, number: int, value: str) -> int | float:
    if task.labels is not None:
        try:
            return task.labels.index(value)
        except ValueError:
            raise DataError(
                f"{path}:{number}: unknown label {value!r}; {task.folder} labels are "
                f"{', '.join(task.labels)}"
            ) from None
    low, high = task.score_range
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise DataError(
            f"{path}:{number}: score {value!r} is not a number; "
            f"{task.folder} scores are numbers from {low:g} to {high:g}"
        )
    if not low <= score <= high:
        raise DataError(
            f"{path}:{number}: score {value} lies outside {low:g}..{high:g}, the "
            f"{task.folder} range"
        )
    return score
