"""The GLUE tasks: one small registered class per task, saying where its files are, which
columns and labels they hold, how it is scored, and which pinned files it is downloaded from.

Tasks (``GLUE_TASKS``; the GLUE folder name in brackets): sst2 (SST-2), rte (RTE), cola (CoLA),
mrpc (MRPC), qnli (QNLI), mnli (MNLI, matched dev ``dev_matched.tsv``), qqp (QQP), stsb (STS-B).
Every task reads ``train.tsv`` and one dev file from a folder laid out as GLUE distributes it:
``data.raw_dir``, or else the download prepared under ``data.cache_dir/glue/<FOLDER>``.

Labels are class indices into the task's fixed ``labels`` tuple: SST-2, CoLA, MRPC, QQP
``("0", "1")``; RTE, QNLI ``("entailment", "not_entailment")``; MNLI ``("contradiction",
"entailment", "neutral")`` (sorted, the order of fairseq's label dictionary). STS-B is
regression: ``labels`` is None, ``num_classes`` 1, and the label is the score, a float in 0..5.

Metrics (``GlueTask.metrics``; the first is result.json's ``value``): accuracy for SST-2, RTE,
QNLI and MNLI; Matthews correlation (``mcc``) for CoLA; F1 of class 1, then accuracy, for MRPC
and QQP; Pearson, then Spearman, for STS-B. dsq_cli.train.glue_metrics computes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import TypeVar

from dsq_cli.run_result import METRICS

from ..download import extract
from ..raw import DataError
from ..sources import Download
from .reader import Column, GlueExample, read_examples, text_lines

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


# --------------------------------------------------------------------------- the task class


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
        return read_examples(self, Path(path), drop_empty=drop_empty).examples

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
        for number, line in enumerate(text_lines(ids_path), start=1):
            if not line.strip():
                continue
            pair = [value.strip() for value in line.split("\t")]
            if len(pair) != 2:
                raise DataError(f"{ids_path}:{number}: expected two tab-separated ids")
            dev_ids.add((pair[0], pair[1]))
        rows: dict[str, list[str]] = {"train": [], "dev": []}
        for number, line in enumerate(text_lines(source_path), start=1):
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
