"""The typed schema of a `dsq train` config: what conf/config.yaml and its groups may hold.

`dsq_cli.config` merges every config (a Hydra composition, or a run directory's stored
config.yaml) into ``OmegaConf.structured(RunConfig)``: values arrive typed (``train.max_updates``
is an ``int``, ``train.lr`` a ``float``), a wrong type or an unknown key fails at once, and struct
mode refuses new keys afterwards. What a type cannot say (ranges, choices, a model that suits the
task) is checked by ``dsq_cli.config.typed``.

The values themselves live in the YAML files: a field that conf/config.yaml always sets has no
default here (``MISSING``), so there is one place for each default. Fields that only some group
files set (a task's ``src``, the wandb logger's ``project``) default to ``None``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from omegaconf import MISSING

# The task families: the one vocabulary of task.family (which trainer and data a task uses) and
# model.family (which tasks a model serves), so a model suits a task when the two are equal.
# Every name is one registered unit in dsq_cli.train.families (its trainer, data and report).
Family = Literal["translation", "glue", "lm"]
FAMILY_NAMES: tuple[Family, ...] = typing.get_args(Family)


def _expects(text: str, default: Any = MISSING) -> Any:
    """A field whose type errors say ``text`` (``must be <text>``) instead of the type's name."""
    return field(default=default, metadata={"expects": text})


@dataclass
class DataConfig:
    """``data``: where the task's text comes from and how it is tokenized."""

    raw_dir: str | None = MISSING  # plain text to prepare instead of downloading (a folder)
    cache_dir: str = MISSING  # prepared tasks live here (default: $DSQ_CACHE or ~/.cache/dsq)
    subset: int | None = _expects("a positive integer (examples) or null")  # first N train pairs
    src: str | None = MISSING  # task `translation`: source language suffix (train.SRC)
    tgt: str | None = MISSING  # task `translation`: target language suffix (train.TGT)
    vocab_size: int = MISSING  # joint sentencepiece vocabulary
    spm_model: str = MISSING  # sentencepiece model type: unigram | bpe


@dataclass
class TrainConfig:
    """``train``: the budget, the optimizer and how often to validate and log."""

    device: str = MISSING  # auto (cuda when available) | cpu | cuda
    max_epochs: int = _expects("a non-negative integer")  # stop after this many epochs...
    max_updates: int = _expects("a non-negative integer")  # ...or updates (0: no limit)
    max_tokens: int = _expects("a non-negative integer")  # tokens per batch (fairseq --max-tokens)
    batch_size: int = _expects("a non-negative integer")  # GLUE, LM: examples per update
    update_freq: int = _expects("a non-negative integer")  # batches accumulated per update
    lr: float = MISSING  # peak learning rate
    # Linear warmup to the peak lr; auto: 10% of the run's updates, at most 4000.
    warmup_updates: int | str = _expects("a non-negative integer or auto")
    adam_betas: list[float] = MISSING  # Adam's (beta1, beta2)
    weight_decay: float = MISSING
    clip_norm: float = MISSING  # gradient norm clipping (0: off)
    label_smoothing: float = MISSING  # translation's label-smoothed cross entropy
    # Validate (and step the DSQ schedule) every N updates; 0: once per epoch; auto: once per
    # epoch and at least 10 times in the run.
    validate_every: int | str = _expects("a non-negative integer or auto")
    log_every: int = _expects("a non-negative integer")  # a metrics.jsonl line every N updates
    # End the run when the validation loss has not improved (fallen below its best) for this
    # many validations in a row, before the cap of max_updates / max_epochs; 0: train to the cap.
    stop_patience: int = _expects("a non-negative integer")
    distributed_world_size: int = _expects("a non-negative integer")  # data-parallel processes
    # Run every encoder and decoder layer's forward again in the backward pass instead of
    # keeping its activations (torch.utils.checkpoint, non-reentrant).
    activation_checkpointing: bool = _expects("true or false")
    # Translation: the output layer and its loss in chunks of N tokens, never the whole batch's
    # logits at once (the same loss up to float32 summation order); 0: the whole batch.
    loss_chunk_tokens: int = _expects("a non-negative integer")


@dataclass
class RunDirConfig:
    """``run``: where the run directory goes."""

    root: str = MISSING  # a new, unique run directory is made under it
    dir: str | None = MISSING  # an exact run directory instead (refused if it exists)
    name: str | None = MISSING  # the run directory's prefix (default: TASK-QUANT-seedN)


@dataclass
class EvalConfig:
    """``eval``: the final evaluation: which model is scored, and translation's BLEU (beam
    search)."""

    split: str = MISSING  # the split scored with BLEU at the end
    beam: int = MISSING  # beam size
    lenpen: float = MISSING  # length penalty
    max_len_a: float = MISSING  # maximum output length: a * source length + b
    max_len_b: int = MISSING
    max_sentences: int = MISSING  # sentences per generation batch
    # The model result.json's `value` scores: best (the best validation loss's checkpoint;
    # GLUE: the best dev metric's validation) or last (the final model).
    checkpoint: str = _expects("best or last")


@dataclass
class SplitSizes:
    """``task.sizes`` of the generated demo corpus: sentence pairs per split."""

    train: int = MISSING
    valid: int = MISSING
    test: int = MISSING


@dataclass
class TaskConfig:
    """``task``: what conf/task/<name>.yaml puts under ``task:``."""

    name: str = MISSING  # the registered task (dsq_cli.data.tasks.TASKS or the GLUE registry)
    # translation (fairseq, BLEU) | glue (fine-tuning an encoder) | lm (a causal language model,
    # perplexity): a `Family`, the same name as
    # the model's model.family. The single place that decides a task's family; required in
    # every conf/task file.
    family: str = MISSING
    # result.json's `value`: bleu, the GLUE task's headline metric, or the LM's perplexity
    metric: str = MISSING
    src: str | None = None  # translation: source language suffix
    tgt: str | None = None  # translation: target language suffix
    sizes: SplitSizes | None = None  # demo: sentence pairs generated per split


@dataclass
class LoggerConfig:
    """``logger``: where metrics go besides the run directory (conf/logger/)."""

    name: str = MISSING  # wandb | none
    project: str | None = None  # wandb project
    entity: str | None = None  # wandb entity (team); null: your default
    mode: str | None = None  # wandb: auto (online with a login, else offline) | online | offline
    group: str | None = None  # wandb group (sweeps set it)
    tags: list[str] = field(default_factory=list)  # wandb tags


# conf/model/: an open mapping, since keys differ between families (fairseq flags for the
# translation models, builder arguments for the encoders); `name` and `family` are always there.
ModelConfig = Mapping[str, Any]


@dataclass
class RunConfig:
    """The whole `dsq train` config (conf/config.yaml with one file of each group)."""

    seed: int = MISSING  # fairseq's seed: initialisation, batch order, dropout
    resume: str | None = MISSING  # a run directory to continue (its config.yaml and checkpoint)
    # With resume: the checkpoint to continue from, last or best; config.yaml keeps last.
    resume_from: str = _expects("last or best")
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # conf/model/: keys differ between families (fairseq arch and sizes, or an encoder's
    # builder); `name` (the file's builder) and `family` (a `Family`, equal to task.family) are
    # required.
    model: dict[str, Any] = field(default_factory=dict)
    task: TaskConfig = field(default_factory=TaskConfig)
    # conf/quant/: q0..q3, stash_scope, rounding; validated by engine.QuantConfig.from_dict.
    quant: Any = None
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    choices: dict[str, str] = field(default_factory=dict)  # group -> the file it chose


EVAL_CHECKPOINTS = ("best", "last")  # eval.checkpoint: which model `value` scores
# resume_from: the checkpoint a resume continues from, newest first (the order a refused resume
# offers them in)
RESUME_FROM = ("last", "best")


_PHRASES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_PLURALS = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def expects(key: str) -> str | None:
    """What the schema wants at the dotted ``key`` (``train.adam_betas[1]``), as a phrase for
    ``must be ...``; None when the key is not in the schema (or is open: model, quant)."""
    hint: Any = RunConfig
    meta: str | None = None
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        hint, _ = _strip_optional(hint)
        if part.startswith("["):
            if typing.get_origin(hint) is not list:
                return None
            hint, meta = typing.get_args(hint)[0], None
        elif dataclasses.is_dataclass(hint):
            fields = {f.name: f for f in dataclasses.fields(hint)}
            if part not in fields:
                return None
            hint = typing.get_type_hints(hint)[part]
            meta = fields[part].metadata.get("expects")
        elif typing.get_origin(hint) is dict and typing.get_args(hint)[1] is not Any:
            hint, meta = typing.get_args(hint)[1], None
        else:
            return None
    if meta:
        return meta
    hint, optional = _strip_optional(hint)
    if typing.get_origin(hint) is list:
        phrase = f"a list of {_PLURALS.get(typing.get_args(hint)[0], 'values')}"
    elif dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        phrase = "a group of keys"
    else:
        phrase = _PHRASES.get(hint)
    if phrase is None:
        return None
    return f"{phrase} or null" if optional else phrase


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return hint, False
