"""The task families and the one place that tells them apart.

Every conf/task/*.yaml declares ``task.family``; `family_of` maps it to the family's data
preparation and trainer. Adding a family is one YAML key per task, one trainer class and one
entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsq_cli.config import ConfigError
from dsq_cli.data.glue import load_glue
from dsq_cli.data.prepare import prepare
from dsq_cli.models.encoders import check_available
from dsq_cli.run_config import RunConfig

from .glue import GlueTrainer
from .loop import Trainer
from .translation import TranslationTrainer


@dataclass(frozen=True)
class TaskFamily:
    name: str
    title: str  # how messages name it
    trainer: type[Trainer]
    prepare: Callable[[RunConfig], Any]  # the task's data, checked (DataError when it is not)
    data_parallel: bool  # whether train.distributed_world_size > 1 and torchrun are supported


def _prepare_glue(cfg: RunConfig):
    check_available(cfg.model)  # the encoder's weights are there before any run directory is made
    return load_glue(cfg)


FAMILIES = {
    "translation": TaskFamily(
        "translation", "translation", TranslationTrainer, prepare, data_parallel=True
    ),
    "glue": TaskFamily("glue", "GLUE fine-tuning", GlueTrainer, _prepare_glue, data_parallel=False),
}


def family_of(cfg: RunConfig) -> TaskFamily:
    try:
        return FAMILIES[cfg.task.family]
    except KeyError:
        raise ConfigError(
            f"task.family={cfg.task.family!r} has no trainer; choose one of {sorted(FAMILIES)}"
        ) from None
