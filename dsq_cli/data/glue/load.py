"""A GLUE task's examples for a run: ``load_glue(cfg)`` reads the training and dev files from
``data.raw_dir``, or from the download prepared under ``data.cache_dir``, into ``GlueData``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from dsq_cli.run_config import RunConfig

from ..raw import DataError
from .prepare import prepare_glue
from .reader import GlueExample, read_examples
from .tasks import GlueTask, get_glue_task


@dataclass
class GlueData:
    """A task's training and dev examples, where they were read and what was read."""

    task: GlueTask
    train: list[GlueExample]
    dev: list[GlueExample]
    source: str  # the directory read
    manifest: dict = field(default_factory=dict)


def _subset(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(
            f"data.subset={value!r}: expected a positive number of training examples, or null"
        )
    return value


def load_glue(cfg: RunConfig) -> GlueData:
    """The training and dev examples of ``cfg.task.name`` from ``cfg.data.raw_dir``, or from
    the download in ``cfg.data.cache_dir`` when raw_dir is null; ``cfg.data.subset=N`` keeps
    the first N training examples in file order."""
    task = get_glue_task(cfg.task.name)
    raw_dir = OmegaConf.select(cfg, "data.raw_dir", default=None)
    subset = _subset(OmegaConf.select(cfg, "data.subset", default=None))
    if raw_dir is None:
        cache_dir = OmegaConf.select(cfg, "data.cache_dir", default=None)
        if cache_dir is None:
            raise DataError(f"task {task.name} needs data.raw_dir or data.cache_dir")
        directory = prepare_glue(task, Path(cache_dir).expanduser())
        where = str(directory)
    else:
        directory = Path(raw_dir).expanduser()
        where = f"data.raw_dir={raw_dir}"
        if not directory.is_dir():
            raise DataError(
                f"{where} does not exist or is not a directory; point it at {task.describe_files()}"
            )
    paths = task.files(directory, where)
    train = read_examples(task, paths["train"], drop_empty=True)
    dev = read_examples(task, paths["dev"], drop_empty=False)
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
