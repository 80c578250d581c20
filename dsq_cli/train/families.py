"""The task families: the one place that tells them apart.

Every conf/task/*.yaml declares ``task.family`` and every conf/model/*.yaml ``model.family``, both
names from one vocabulary (`dsq_cli.run_config.Family`, which the config check uses below this
layer); each name is one registered `TaskFamily` here, the keys of `FAMILIES`. A family owns what
differs between them: its data preparation, its trainer, whether it runs data parallel, its lines
in ``dsq train``'s and ``dsq data``'s output, and whether ``dsq cost`` can price its models.
Callers ask `family_of(cfg)`; nothing else compares family names. Adding a family is its name in
`Family`, one YAML key per task and model file, one trainer class and one subclass here.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from dsq_cli.config import ConfigError
from dsq_cli.data.glue import load_glue
from dsq_cli.data.lm import load_lm
from dsq_cli.data.prepare import prepare
from dsq_cli.models.causal_lm import check_transformers
from dsq_cli.models.encoders import check_available
from dsq_cli.run_config import FAMILY_NAMES, Family, RunConfig
from dsq_cli.run_result import RunResult

from .glue import GlueTrainer
from .lm import LMTrainer
from .loop import Trainer
from .translation import TranslationTrainer


class TaskFamily(abc.ABC):
    """One task family: registered under `name` (a `Family`) with `register`."""

    name: ClassVar[Family]
    title: ClassVar[str]  # how messages name it
    trainer: ClassVar[type[Trainer]]
    data_parallel: ClassVar[bool]  # whether train.distributed_world_size > 1 and torchrun work

    @abc.abstractmethod
    def prepare(self, cfg: RunConfig) -> Any:
        """The task's data, checked (DataError when it is not), before any run directory."""

    @abc.abstractmethod
    def completed_line(self, result: RunResult) -> str:
        """``dsq train``'s summary of a completed run: its updates, loss and headline value."""

    @abc.abstractmethod
    def data_line(self, task: str, data: Any) -> str:
        """``dsq data``'s line for the prepared ``data`` of ``task``."""

    def check_priceable(self, cfg: RunConfig) -> None:
        """``dsq cost`` derives a training step's GEMMs from the model config; a family whose
        models it cannot derive raises a ConfigError saying where their cost is instead."""
        return None  # derivable: the translation transformers

    def __repr__(self) -> str:
        return f"<task family {self.name}>"


_REGISTRY: dict[str, TaskFamily] = {}
# The registry, read-only: task.family and model.family -> the family.
FAMILIES: Mapping[Family, TaskFamily] = MappingProxyType(_REGISTRY)


def register(cls: type[TaskFamily]) -> type[TaskFamily]:
    if cls.name not in FAMILY_NAMES:
        raise TypeError(f"{cls.__name__}.name={cls.name!r} is not a Family: {FAMILY_NAMES}")
    if cls.name in _REGISTRY:
        raise TypeError(f"task family {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def family_of(cfg: RunConfig) -> TaskFamily:
    """The family of ``cfg``'s task (the config check has made its model's the same one)."""
    try:
        return FAMILIES[cfg.task.family]
    except KeyError:
        raise ConfigError(
            f"task.family={cfg.task.family!r} has no trainer; choose one of {sorted(FAMILIES)}"
        ) from None


def _scored_model(evaluation: Mapping[str, Any]) -> str:
    """``best model, update 160; last model, update 200: 27.10; ``: which model the BLEU is of,
    and the other's BLEU, when best and last are two models (nothing when they are one)."""
    chosen = evaluation["eval_checkpoint"]
    entries = evaluation["checkpoints"]
    other = "last" if chosen == "best" else "best"
    if not entries.get(other) or entries[other]["update"] == entries[chosen]["update"]:
        return ""
    return (
        f"{chosen} model, update {entries[chosen]['update']}; {other} model, update "
        f"{entries[other]['update']}: {entries[other]['bleu']:.2f}; "
    )


def _priced_from_its_records(what: str, cfg: RunConfig) -> None:
    """`check_priceable`'s refusal for the families whose models dsq cost does not derive."""
    raise ConfigError(
        f"dsq cost derives the translation transformers' GEMMs; {what} "
        f"(model={cfg.model['name']}) is priced in its result.json from the GEMMs its first "
        "update recorded (dsq table shows them)"
    )


def _sizes(data: Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in data.manifest["sizes"].items())


@register
class Translation(TaskFamily):
    """fairseq translation of a prepared parallel corpus, scored with BLEU."""

    name = "translation"
    title = "translation"
    trainer = TranslationTrainer
    data_parallel = True

    def prepare(self, cfg: RunConfig) -> Any:
        return prepare(cfg)

    def completed_line(self, result: RunResult) -> str:
        evaluation = result.evaluation
        return (
            f"completed: {result.updates} updates, valid loss {result.valid_loss:.3f}, "
            f"{evaluation['eval_split']} BLEU {result.value:.2f} ({_scored_model(evaluation)}"
            f"copying the source scores {evaluation['copy_source_bleu']:.2f})"
        )

    def data_line(self, task: str, data: Any) -> str:
        return f"{task}: {data.source} ({_sizes(data)}; vocabulary {data.manifest['vocab_size']})"


@register
class Glue(TaskFamily):
    """GLUE fine-tuning of a sentence encoder, scored with the task's dev metric."""

    name = "glue"
    title = "GLUE fine-tuning"
    trainer = GlueTrainer
    data_parallel = False

    def prepare(self, cfg: RunConfig) -> Any:
        check_available(cfg.model)  # the encoder's weights are there before any run directory
        return load_glue(cfg)

    def completed_line(self, result: RunResult) -> str:
        # the best (or last) dev value, and the other one
        evaluation = result.evaluation
        chosen = evaluation["eval_checkpoint"]
        other = "final" if chosen == "best" else "best"
        return (
            f"completed: {result.updates} updates, dev loss {result.valid_loss:.3f}, "
            f"{chosen} dev {result.metric} {result.value:.4f} "
            f"(update {evaluation['checkpoints'][chosen]['update']}; "
            f"{other} {result.value_of('last' if other == 'final' else 'best'):.4f})"
        )

    def data_line(self, task: str, data: Any) -> str:
        return f"{task}: {data.source} ({_sizes(data)})"

    def check_priceable(self, cfg: RunConfig) -> None:
        _priced_from_its_records("a GLUE run", cfg)


@register
class LanguageModel(TaskFamily):
    """A causal language model from ``transformers`` trained on a text, scored by perplexity."""

    name = "lm"
    title = "language modelling"
    trainer = LMTrainer
    data_parallel = False

    def prepare(self, cfg: RunConfig) -> Any:
        check_transformers(f"task={cfg.task.name}")  # before any run directory
        return load_lm(cfg)

    def completed_line(self, result: RunResult) -> str:
        evaluation = result.evaluation
        chosen = evaluation["eval_checkpoint"]
        other = "last" if chosen == "best" else "best"
        entries = evaluation["checkpoints"]
        return (
            f"completed: {result.updates} updates, {chosen} valid loss "
            f"{entries[chosen]['valid_loss']:.4f}, perplexity {result.value:.3f} (update "
            f"{entries[chosen]['update']}; {other}: loss {entries[other]['valid_loss']:.4f}, "
            f"update {entries[other]['update']})"
        )

    def data_line(self, task: str, data: Any) -> str:
        return (f"{task}: {data.source} ({_sizes(data)} characters; vocabulary "
                f"{data.manifest['vocab_size']} characters)")  # fmt: skip

    def check_priceable(self, cfg: RunConfig) -> None:
        _priced_from_its_records("a language-model run", cfg)


if set(FAMILIES) != set(FAMILY_NAMES):  # every name of the vocabulary is one unit here
    raise TypeError(f"task families {sorted(FAMILIES)} are not the Family names {FAMILY_NAMES}")
