"""The GLUE tasks: one small registered class per task, a strict TSV reader, pinned downloads,
and the leaderboard metrics in numpy.

Tasks (``GLUE_TASKS``; the GLUE folder name in brackets): sst2 (SST-2), rte (RTE), cola (CoLA),
mrpc (MRPC), qnli (QNLI), mnli (MNLI, matched dev ``dev_matched.tsv``), qqp (QQP), stsb (STS-B).
Every task reads ``train.tsv`` and one dev file from a folder laid out as GLUE distributes it:
``data.raw_dir``, or else the download prepared under ``data.cache_dir/glue/<FOLDER>``.

File format decisions
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

Metric decisions (``GlueTask.metrics``; the first is result.json's ``value``)
- SST-2, RTE, QNLI, MNLI: accuracy. CoLA: Matthews correlation (``mcc``).
- MRPC, QQP: F1 of class 1 (the leaderboard lists F1 first), then accuracy.
- STS-B: Pearson, then Spearman.
- ``glue_score`` is the mean of a task's leaderboard numbers (all of ``metrics``), which is what
  the GLUE average uses: the mean of F1 and accuracy for MRPC and QQP, of Pearson and Spearman
  for STS-B, the single metric otherwise.
- Values are fractions (accuracy and F1 in 0..1, correlations in -1..1), not percentages.
  A correlation that is undefined (a constant side) is 0.0; F1 with no positive prediction or
  label is 0.0. Non-finite STS-B predictions (a diverged model) give NaN correlations.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TypeVar

import numpy as np
from omegaconf import OmegaConf

from dsq_cli.runs import METRICS

from .download import DownloadError, built_in_place, extract, fetch
from .raw import DataError
from .sources import Download

log = logging.getLogger("dsq.data")

PREPARED = "dsq_glue.json"  # written last into a prepared download: the folder is complete

GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/{name}"
# Where the pinned checksums were published. Hugging Face's GLUE loader lists the exact URLs
# used here with their size and SHA-256; tensorflow_datasets lists the same size and SHA-256
# for the firebasestorage copies GLUE first published (all but QQP-clean, which only HF has).
_HF_GLUE = (
    "huggingface/datasets datasets/glue/dataset_infos.json (commit 040102f1), "
    "download_checksums of the URL"
)
_HF_AND_TFDS = f"{_HF_GLUE}; the same size and sha256 in tensorflow/datasets url_checksums/glue.txt"


def _glue_zip(name: str, sha256: str, size: int, checksum_from: str = _HF_AND_TFDS) -> Download:
    return Download(
        filename=name,
        url=GLUE_URL.format(name=name),
        sha256=sha256,
        size=size,
        checksum_from=checksum_from,
    )


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class GlueExample:
    """One example: one or two texts and a class index (float score for STS-B)."""

    text_a: str
    text_b: str | None
    label: int | float


@dataclass
class GlueData:
    """A task's training and dev examples, where they were read and what was read."""

    task: GlueTask
    train: list[GlueExample]
    dev: list[GlueExample]
    source: str  # the directory read
    manifest: dict = field(default_factory=dict)


@dataclass
class _ReadResult:
    examples: list[GlueExample]
    sha256: str
    dropped_empty: int


# --------------------------------------------------------------------------- registry

GLUE_TASKS: dict[str, GlueTask] = {}
_TaskClass = TypeVar("_TaskClass", bound=type)


def register_glue_task(name: str) -> Callable[[_TaskClass], _TaskClass]:
    """Class decorator: register one instance of the class as GLUE task ``name``."""

    def add(cls: _TaskClass) -> _TaskClass:
        if name in GLUE_TASKS:
            raise ValueError(f"GLUE task {name!r} is registered twice")
        cls.name = name
        task = cls()
        task.check_definition()
        GLUE_TASKS[name] = task
        return cls

    return add


def get_glue_task(name: str) -> GlueTask:
    if name not in GLUE_TASKS:
        raise DataError(
            f"unknown GLUE task {name!r}; choose one of {', '.join(sorted(GLUE_TASKS))}"
        )
    return GLUE_TASKS[name]


# --------------------------------------------------------------------------- reading


def _lines(path: Path, on_bytes: Callable[[bytes], object] | None = None) -> Iterator[str]:
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


Column = str | int  # a header name, or a 0-based field index in a file without header


class GlueTask:
    """One GLUE task: where its files are, how to read them, how it is scored."""

    name = "?"  # set by register_glue_task
    folder = "?"  # GLUE's folder name (SST-2, ...)
    train_file = "train.tsv"
    dev_file = "dev.tsv"
    has_header = True
    text_a_column: Column = "sentence1"
    text_b_column: Column | None = "sentence2"
    label_column: Column = "label"
    # A file without header: its field count and the names used in messages.
    field_names: tuple[str, ...] = ()
    labels: tuple[str, ...] | None = ("0", "1")  # class names by index; None: regression
    score_range = (0.0, 5.0)  # regression labels must lie in it
    metrics: tuple[str, ...] = ("accuracy",)  # leaderboard numbers; the first is `value`
    downloads: tuple[Download, ...] = ()

    @property
    def metric(self) -> str:
        """The name of result.json's ``value``."""
        return self.metrics[0]

    @property
    def num_classes(self) -> int:
        """Output units of the classifier head (1 for regression)."""
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    def check_definition(self) -> None:
        """Catches a mistyped task class at import time rather than in a run."""
        unknown = [m for m in self.metrics if m not in METRICS]
        if not self.metrics or unknown:
            raise ValueError(f"GLUE task {self.name}: metrics {self.metrics} not among {METRICS}")
        binary_only = {"f1", "mcc"} & set(self.metrics)
        if binary_only and self.num_classes != 2:
            raise ValueError(f"GLUE task {self.name}: {sorted(binary_only)} need two classes")
        if self.is_regression != bool({"pearson", "spearman"} & set(self.metrics)):
            raise ValueError(f"GLUE task {self.name}: correlations are for regression only")
        if not self.has_header and not self.field_names:
            raise ValueError(f"GLUE task {self.name}: a file without header needs field_names")

    # -- files ------------------------------------------------------------------------------
    def describe_files(self) -> str:
        return f"the GLUE {self.folder} folder ({self.train_file}, {self.dev_file})"

    def files(self, directory: Path, where: str) -> dict[str, Path]:
        """``{"train": path, "dev": path}`` in ``directory``; ``where`` names it in errors."""
        found = {}
        for split, name in (("train", self.train_file), ("dev", self.dev_file)):
            path = Path(directory) / name
            if not path.is_file():
                present = sorted(p.name for p in Path(directory).iterdir())
                holds = f" (it holds: {', '.join(present[:12])})" if present else " (it is empty)"
                raise DataError(
                    f"{where} has no {name}{holds}; point it at {self.describe_files()}"
                )
            found[split] = path
        return found

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: Path, *, drop_empty: bool = False) -> list[GlueExample]:
        """The examples of one GLUE TSV file of this task, in file order.

        Raises ``DataError`` naming ``file:line`` for a malformed row (too few fields, an
        unknown label, a bad score, an empty sentence), a missing header, non-UTF-8 bytes or
        an empty file. ``drop_empty`` drops rows with an empty sentence instead (training)."""
        return self._read(Path(path), drop_empty=drop_empty).examples

    def _read(self, path: Path, *, drop_empty: bool) -> _ReadResult:
        if not path.is_file():
            raise DataError(f"missing GLUE file {path}; expected {self.describe_files()}")
        digest = hashlib.sha256()
        reader = csv.reader(_lines(path, digest.update), delimiter="\t", quoting=csv.QUOTE_NONE)
        rows = enumerate(reader, start=1)
        examples: list[GlueExample] = []
        dropped = 0
        blank_at: int | None = None  # the first of a run of blank lines not yet followed by data
        indices: tuple[int, int | None, int] | None = None
        needed = len(self.field_names)
        for number, row in rows:
            if not any(value.strip() for value in row):
                blank_at = blank_at or number
                continue
            if blank_at is not None:
                raise DataError(
                    f"{path}:{blank_at}: blank line between examples; every line must hold one"
                )
            if indices is None:
                indices, needed = self._columns(path, number, row)
                if self.has_header:
                    continue
            a_index, b_index, label_index = indices
            if len(row) < needed or (not self.has_header and len(row) != needed):
                raise DataError(
                    f"{path}:{number}: {len(row)} tab-separated field(s), expected "
                    f"{self._expected_fields(needed)}; is a tab missing, or is it the wrong file?"
                )
            text_a = row[a_index].strip()
            text_b = row[b_index].strip() if b_index is not None else None
            empty = [
                self._column_name(column)
                for column, text in ((self.text_a_column, text_a), (self.text_b_column, text_b))
                if column is not None and not text
            ]
            if empty:
                if drop_empty:
                    dropped += 1
                    continue
                raise DataError(
                    f"{path}:{number}: empty {' and '.join(empty)}; every example needs its text"
                )
            label = self._label(path, number, row[label_index].strip())
            examples.append(GlueExample(text_a, text_b, label))
        if indices is None:
            raise DataError(f"{path} is empty; expected {self.describe_files()} with examples")
        if not examples:
            kept = f" ({dropped} dropped for an empty sentence)" if dropped else ""
            raise DataError(f"{path} holds no examples{kept}; expected {self.describe_files()}")
        if dropped:
            log.warning("%s: dropped %d row(s) with an empty sentence", path, dropped)
        return _ReadResult(examples, digest.hexdigest(), dropped)

    def _columns(
        self, path: Path, number: int, first_row: list[str]
    ) -> tuple[tuple[int, int | None, int], int]:
        """Field indices of text_a, text_b and label, and the fields a row needs; ``first_row``
        (line ``number``) is the header when the task has one."""
        columns = (self.text_a_column, self.text_b_column, self.label_column)
        if not self.has_header:
            a, b, label = (int(c) if c is not None else None for c in columns)
            return (a, b, label), len(self.field_names)
        header = {name.strip(): i for i, name in enumerate(first_row)}
        wanted = [str(c) for c in columns if c is not None]
        missing = [name for name in wanted if name not in header]
        if missing:
            what = "no header" if len(missing) == len(wanted) else "a header without"
            shown = "\t".join(first_row)[:80]
            raise DataError(
                f"{path}:{number}: {what} column(s) {', '.join(missing)}: the line is {shown!r}; "
                f"GLUE {self.folder} files start with a header naming {', '.join(wanted)}"
            )
        a, b, label = (header[str(c)] if c is not None else None for c in columns)
        return (a, b, label), max(i for i in (a, b, label) if i is not None) + 1

    def _column_name(self, column: Column) -> str:
        return self.field_names[column] if isinstance(column, int) else column

    def _expected_fields(self, needed: int) -> str:
        if not self.has_header:
            return f"{needed} ({', '.join(self.field_names)})"
        return f"at least {needed} as in the header"

    def _label(self, path: Path, number: int, value: str) -> int | float:
        if self.labels is not None:
            try:
                return self.labels.index(value)
            except ValueError:
                raise DataError(
                    f"{path}:{number}: unknown label {value!r}; {self.folder} labels are "
                    f"{', '.join(self.labels)}"
                ) from None
        low, high = self.score_range
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise DataError(
                f"{path}:{number}: score {value!r} is not a number; "
                f"{self.folder} scores are numbers from {low:g} to {high:g}"
            )
        if not low <= score <= high:
            raise DataError(
                f"{path}:{number}: score {value} lies outside {low:g}..{high:g}, the "
                f"{self.folder} range"
            )
        return score

    # -- downloading ------------------------------------------------------------------------
    def offline_hint(self, cache_dir: Path) -> str:
        return (
            f"Instead, pass data.raw_dir=DIR holding {self.describe_files()}, or copy "
            f"{Path(cache_dir) / 'glue' / self.folder} from a machine with network"
        )

    def assemble(self, archives: Mapping[str, Path], scratch: Path, out_dir: Path) -> None:
        """Put the train and dev files of the downloaded ``archives`` into ``out_dir``.
        The default: one zip holding ``<FOLDER>/{train_file,dev_file}``."""
        (archive,) = archives.values()
        wanted = {self.train_file, self.dev_file}
        root = extract(
            archive,
            scratch / "unpacked",
            keep=lambda member: PurePosixPath(member.replace("\\", "/")).name in wanted,
        )
        folders = sorted(
            path.parent
            for path in root.rglob(self.train_file)
            if (path.parent / self.dev_file).is_file()
        )
        preferred = [folder for folder in folders if folder.name == self.folder]
        if not (preferred or folders):
            raise DataError(
                f"{archive} holds no {self.folder}/{self.train_file} with {self.dev_file}; "
                "delete it so that it is downloaded again"
            )
        source = (preferred or folders)[0]
        for name in wanted:
            os.replace(source / name, out_dir / name)


def _reason(err: DownloadError) -> str:
    """The failure part of a download error; the advice after it is for translation data."""
    return str(err).partition(" Instead, ")[0].rstrip()


def prepare_glue(task: GlueTask | str, cache_dir: Path, *, timeout: float = 60) -> Path:
    """The folder ``cache_dir/glue/<FOLDER>`` holding the task's train and dev files,
    downloaded (pinned SHA-256) and unpacked first unless it is already there.

    The folder is assembled under a temporary name next to it and renamed into place with
    ``dsq_glue.json`` inside, so an interrupted preparation leaves no half-written folder;
    the downloaded files themselves are kept in ``cache_dir/glue/downloads``."""
    task = get_glue_task(task) if isinstance(task, str) else task
    glue_root = Path(cache_dir).expanduser() / "glue"
    out_dir = glue_root / task.folder
    if (out_dir / PREPARED).is_file():
        return out_dir
    if out_dir.exists():
        raise DataError(
            f"{out_dir} exists but was not prepared by dsq (no {PREPARED}); remove it, or pass "
            f"data.raw_dir={out_dir} if it holds {task.describe_files()}"
        )
    if not task.downloads:
        raise DataError(
            f"GLUE task {task.name} has no pinned download. {task.offline_hint(cache_dir)}"
        )

    archives: dict[str, Path] = {}
    for download in task.downloads:
        dest = glue_root / "downloads" / download.filename
        try:
            archives[download.filename] = fetch(
                download.url, download.sha256, dest, timeout=timeout, size=download.size
            )
        except DownloadError as err:
            raise DataError(
                f"{_reason(err)} {task.offline_hint(cache_dir)}, or place {download.filename} "
                f"(sha256 {download.sha256}) at {dest}."
            ) from None

    with built_in_place(out_dir, PREPARED) as (ready, scratch):
        try:
            task.assemble(archives, scratch, ready)
        except DownloadError as err:  # an unsafe or unreadable archive (ArchiveError)
            raise DataError(str(err)) from None
        record = {
            "task": task.name,
            "folder": task.folder,
            "files": [task.train_file, task.dev_file],
            "downloads": [
                {"url": d.url, "sha256": d.sha256, "checksum_from": d.checksum_from}
                for d in task.downloads
            ],
        }
        (ready / PREPARED).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log.info("GLUE %s ready in %s", task.folder, out_dir)
    return out_dir


# --------------------------------------------------------------------------- the tasks


@register_glue_task("sst2")
class Sst2(GlueTask):
    folder = "SST-2"
    text_a_column = "sentence"
    text_b_column = None
    downloads = (
        _glue_zip(
            "SST-2.zip", "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa", 7439277
        ),
    )


@register_glue_task("rte")
class Rte(GlueTask):
    folder = "RTE"
    labels = ("entailment", "not_entailment")
    downloads = (
        _glue_zip(
            "RTE.zip", "6bf86de103ecd335f3441bd43574d23fef87ecc695977a63b82d5efb206556ee", 697150
        ),
    )


@register_glue_task("cola")
class Cola(GlueTask):
    folder = "CoLA"
    has_header = False
    field_names = ("source", "label", "original mark", "sentence")
    text_a_column = 3
    text_b_column = None
    label_column = 1
    metrics = ("mcc",)
    downloads = (
        _glue_zip(
            "CoLA.zip", "f212fcd832b8f7b435fb991f101abf89f96b933ab400603bf198960dfc32cbff", 376971
        ),
    )


# MRPC is not in a GLUE zip: GLUE's download script splits Microsoft's training file into train
# and dev by a list of dev id pairs; MRPC.assemble does the same (the test file is not needed).
MRPC_TRAIN_TXT = "msr_paraphrase_train.txt"
MRPC_DEV_IDS = "mrpc_dev_ids.tsv"
MRPC_HEADER = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")


@register_glue_task("mrpc")
class Mrpc(GlueTask):
    folder = "MRPC"
    text_a_column = "#1 String"
    text_b_column = "#2 String"
    label_column = "Quality"
    metrics = ("f1", "accuracy")
    downloads = (
        Download(
            filename=MRPC_TRAIN_TXT,
            url=f"https://dl.fbaipublicfiles.com/senteval/senteval_data/{MRPC_TRAIN_TXT}",
            sha256="60a9b09084528f0673eedee2b69cb941920f0b8cd0eeccefc464a98768457f89",
            size=1047044,
            checksum_from=_HF_AND_TFDS,
        ),
        _glue_zip(
            MRPC_DEV_IDS, "971d7767d81b997fd9060ade0ec23c4fc31cbb226a55d1bd4a1bac474eb81dc7", 6222
        ),
    )

    def assemble(self, archives: Mapping[str, Path], scratch: Path, out_dir: Path) -> None:
        ids_path, source_path = archives[MRPC_DEV_IDS], archives[MRPC_TRAIN_TXT]
        dev_ids: set[tuple[str, str]] = set()
        for number, line in enumerate(_lines(ids_path), start=1):
            if not line.strip():
                continue
            pair = [value.strip() for value in line.split("\t")]
            if len(pair) != 2:
                raise DataError(f"{ids_path}:{number}: expected two tab-separated ids")
            dev_ids.add((pair[0], pair[1]))
        rows: dict[str, list[str]] = {"train": [], "dev": []}
        for number, line in enumerate(_lines(source_path), start=1):
            fields = line.strip().split("\t")
            if number == 1:
                if tuple(fields) != MRPC_HEADER:
                    raise DataError(f"{source_path}:1: expected the header {MRPC_HEADER}")
                continue
            if not line.strip():
                continue
            if len(fields) != len(MRPC_HEADER):
                raise DataError(f"{source_path}:{number}: expected {len(MRPC_HEADER)} fields")
            split = "dev" if (fields[1], fields[2]) in dev_ids else "train"
            rows[split].append("\t".join(fields))
        if not rows["dev"] or not rows["train"]:
            raise DataError(
                f"{ids_path} and {source_path} give an empty split; delete them so that they "
                "are downloaded again"
            )
        for split, name in (("train", self.train_file), ("dev", self.dev_file)):
            with open(out_dir / name, "w", encoding="utf-8", newline="\n") as stream:
                stream.write("\t".join(MRPC_HEADER) + "\n")
                stream.writelines(row + "\n" for row in rows[split])


@register_glue_task("qnli")
class Qnli(GlueTask):
    folder = "QNLI"
    text_a_column = "question"
    text_b_column = "sentence"
    labels = ("entailment", "not_entailment")
    downloads = (
        _glue_zip(
            "QNLIv2.zip",
            "e634e78627a29adaecd4f955359b22bf5e70f2cbd93b493f2d624138a0c0e5f5",
            10627589,
        ),
    )


@register_glue_task("mnli")
class Mnli(GlueTask):
    folder = "MNLI"
    dev_file = "dev_matched.tsv"
    label_column = "gold_label"  # the last column of train (12 fields) and dev (16)
    labels = ("contradiction", "entailment", "neutral")
    downloads = (
        _glue_zip(
            "MNLI.zip",
            "e7c1d896d26ed6caf700110645df426cc2d8ebf02a5ab743d5a5c68ac1c83633",
            312783507,
        ),
    )


@register_glue_task("qqp")
class Qqp(GlueTask):
    folder = "QQP"
    text_a_column = "question1"
    text_b_column = "question2"
    label_column = "is_duplicate"
    metrics = ("f1", "accuracy")
    # QQP-clean (GLUE's corrected release): only Hugging Face publishes its checksum.
    downloads = (
        _glue_zip(
            "QQP-clean.zip",
            "40e7c862c04eb26ee04b67fd900e76c45c6ba8e6d8fab4f8f1f8072a1a3fbae0",
            41696084,
            checksum_from=_HF_GLUE,
        ),
    )


@register_glue_task("stsb")
class Stsb(GlueTask):
    folder = "STS-B"
    label_column = "score"  # the last column
    labels = None
    metrics = ("pearson", "spearman")
    downloads = (
        _glue_zip(
            "STS-B.zip", "e60a6393de5a8b5b9bac5020a1554b54e3691f9d600b775bd131e613ac179c85", 802872
        ),
    )


# --------------------------------------------------------------------------- loading


def _subset(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(
            f"data.subset={value!r}: expected a positive number of training examples, or null"
        )
    return value


def load_glue(cfg) -> GlueData:
    """The training and dev examples of ``cfg.task.name`` from ``cfg.data.raw_dir``, or from
    the download in ``cfg.data.cache_dir`` when raw_dir is null; ``cfg.data.subset=N`` keeps
    the first N training examples in file order."""
    task = get_glue_task(str(cfg.task.name))
    raw_dir = OmegaConf.select(cfg, "data.raw_dir", default=None)
    subset = _subset(OmegaConf.select(cfg, "data.subset", default=None))
    if raw_dir is None:
        cache_dir = OmegaConf.select(cfg, "data.cache_dir", default=None)
        if cache_dir is None:
            raise DataError(f"task {task.name} needs data.raw_dir or data.cache_dir")
        directory = prepare_glue(task, Path(str(cache_dir)).expanduser())
        where = str(directory)
    else:
        directory = Path(str(raw_dir)).expanduser()
        where = f"data.raw_dir={raw_dir}"
        if not directory.is_dir():
            raise DataError(
                f"{where} does not exist or is not a directory; point it at {task.describe_files()}"
            )
    paths = task.files(directory, where)
    train = task._read(paths["train"], drop_empty=True)
    dev = task._read(paths["dev"], drop_empty=False)
    train_examples = train.examples[:subset] if subset is not None else train.examples
    manifest = {
        "task": task.name,
        "folder": task.folder,
        "dir": str(directory),
        "downloaded": raw_dir is None,
        "files": {"train": paths["train"].name, "dev": paths["dev"].name},
        "sha256": {paths["train"].name: train.sha256, paths["dev"].name: dev.sha256},
        "sizes": {"train": len(train_examples), "dev": len(dev.examples)},
        "train_in_file": len(train.examples),
        "dropped_empty": {"train": train.dropped_empty},
        "subset": subset,
    }
    return GlueData(task, train_examples, dev.examples, str(directory), manifest)


# --------------------------------------------------------------------------- metrics


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(predictions == labels))


def _binary_counts(predictions: np.ndarray, labels: np.ndarray) -> tuple[int, int, int, int]:
    """(tp, fp, fn, tn) with class 1 positive, as Python ints (products cannot overflow)."""
    positive, actual = predictions == 1, labels == 1
    tp = int(np.sum(positive & actual))
    fp = int(np.sum(positive & ~actual))
    fn = int(np.sum(~positive & actual))
    return tp, fp, fn, len(labels) - tp - fp - fn


def binary_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """F1 of class 1; 0.0 when neither predictions nor labels hold a 1."""
    tp, fp, fn, _ = _binary_counts(predictions, labels)
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Binary Matthews correlation; 0.0 when undefined (a constant side)."""
    tp, fp, fn, tn = _binary_counts(predictions, labels)
    denominator = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)
    if denominator == 0:
        return 0.0
    return (tp * tn - fp * fn) / math.sqrt(denominator)


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation; 0.0 when a side is constant, NaN when a value is not finite."""
    x, y = predictions.astype(np.float64), labels.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return math.nan
    # Exact test: the centred values of a constant side need not be exactly 0 in floating point.
    if np.all(x == x[0]) or np.all(y == y[0]):
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    r = float(np.dot(x, y) / (np.sqrt(np.dot(x, x)) * np.sqrt(np.dot(y, y))))
    return min(1.0, max(-1.0, r))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the average of the ranks they span."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts_run = np.empty(len(values), dtype=bool)
    starts_run[:1] = True
    starts_run[1:] = ordered[1:] != ordered[:-1]
    run_starts = np.flatnonzero(starts_run)
    run_ends = np.append(run_starts[1:], len(values))  # exclusive
    run_rank = (run_starts + run_ends + 1) / 2  # mean of the 1-based ranks start+1..end
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = run_rank[np.cumsum(starts_run) - 1]
    return ranks


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Spearman correlation: Pearson of the average ranks."""
    x, y = predictions.astype(np.float64), labels.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return math.nan
    return pearson(average_ranks(x), average_ranks(y))


METRIC_FUNCTIONS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def _class_indices(values: Sequence, num_classes: int, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be class indices (integers), got dtype {array.dtype}")
    if np.any(array < 0) or np.any(array >= num_classes):
        raise ValueError(f"{what} must lie in 0..{num_classes - 1}")
    return array


def compute_metrics(task: GlueTask, predictions: Sequence, labels: Sequence) -> dict[str, float]:
    """The task's leaderboard metrics of ``predictions`` (class indices; floats for STS-B)
    against ``labels``, plus ``glue_score`` (their mean) and ``value`` (the task's metric)."""
    shapes = np.shape(predictions), np.shape(labels)
    if len(shapes[0]) != 1 or shapes[0] != shapes[1] or shapes[0][0] == 0:
        raise ValueError(
            f"predictions and labels must be two non-empty 1-D sequences of the same length, "
            f"got shapes {shapes[0]} and {shapes[1]} (take the argmax of logits first)"
        )
    if task.is_regression:
        y_pred = np.asarray(predictions, dtype=np.float64)
        y_true = np.asarray(labels, dtype=np.float64)
        if not np.all(np.isfinite(y_true)):
            raise ValueError("labels must be finite scores")
    else:
        y_pred = _class_indices(predictions, task.num_classes, "predictions")
        y_true = _class_indices(labels, task.num_classes, "labels")
    scores = {name: float(METRIC_FUNCTIONS[name](y_pred, y_true)) for name in task.metrics}
    scores["glue_score"] = float(np.mean([scores[name] for name in task.metrics]))
    scores["value"] = scores[task.metric]
    return scores
