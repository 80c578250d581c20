"""The `dsq train` config: conf/config.yaml and its groups, composed by Hydra.

Composition runs in struct mode, so an unknown key or group option fails before any work starts;
the failure is turned into one line that names the key and the choices (`ConfigError`, a
``ValueError``, which the CLI reports with exit code 2). The composed config is then merged into
the typed schema (`dsq_cli.run_config.RunConfig`) and checked by `typed`, which turns any config
(a composed one, or a run's stored config.yaml) into the typed, resolved, checked one.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from dsq_cli.data.glue import get_glue_task
from dsq_cli.data.lm import LM_TASKS
from dsq_cli.data.tasks import TASKS
from dsq_cli.presets import CONF_DIR
from dsq_cli.run_config import (
    EVAL_CHECKPOINTS,
    FAMILY_NAMES,
    RESUME_FROM,
    RunConfig,
    expects,
)

GROUPS = ("task", "model", "quant", "logger")


class ConfigError(ValueError):
    """A config that cannot be composed or does not make sense; the message says how to fix it."""


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_group_overrides(overrides: Sequence[str]) -> None:
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS:
            continue
        for choice in value.split(","):
            if choice and choice not in group_choices(key):
                raise ConfigError(
                    f"unknown {key} {choice!r}; choose one of {group_choices(key)} "
                    f"(files in conf/{key}/)"
                )


def _describe_unknown_key(cfg: DictConfig | None, dotted: str) -> str:
    """Why ``dotted`` is not a key of ``cfg``, naming the keys that do exist there."""
    node, walked = cfg, []
    for part in dotted.split(".")[:-1]:
        child = node.get(part) if isinstance(node, DictConfig) else None
        walked.append(part)
        if child is None:
            break
        if not isinstance(child, DictConfig):
            where = ".".join(walked)
            return (
                f"{where} is a single value ({child!r}), not a group of keys; to give it a "
                f"schedule write {where}={{levels: [...], patience: N, min_delta: X}}"
                if where.startswith("quant.")
                else f"{where} is a single value ({child!r}), it has no key {dotted!r}"
            )
        node = child
    known = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
    return f"unknown config key {dotted!r}" + (f"; keys there: {', '.join(known)}" if known else "")


def _explain(err: Exception, overrides: Sequence[str]) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    match = re.search(r"Could not override '([^']+)'", str(err)) or re.search(
        r"Key '([^']+)' is not in struct", str(err)
    )
    if not match:
        return f"bad override: {text}"
    from hydra import compose as hydra_compose

    key = match.group(1)
    full = next((o.split("=", 1)[0] for o in overrides if key in o.split("=", 1)[0]), key)
    # The config as the chosen groups make it, without the offending value overrides.
    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS]
    try:
        base = hydra_compose("config", overrides=groups)
    except Exception:
        base = None
    return _describe_unknown_key(base, full.lstrip("+~"))


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The resolved `dsq train` config for Hydra-style ``overrides`` (``key=value`` strings)."""
    overrides = list(overrides)
    _check_group_overrides(overrides)
    overrides, policy_overrides = _split_policy_overrides(overrides)
    with _COMPOSING:  # Hydra's state and the schema swap below are process-global
        return _compose_locked(overrides, policy_overrides)


# quant.<point>.policy and the policies' parameters, set on a ladder the preset defines
_POLICY_KEY = re.compile(r"quant\.(q[0-3])\.(\w+)")
# quant.saved.<kind>: what stash_scope=all holds of a kind of saved tensor; no preset writes the
# rules (their defaults are the engine's, dsq.engine.spec.SAVED_DEFAULT), so Hydra has no key
_SAVED_KEY = re.compile(r"quant\.saved\.(\w+)")


def _split_policy_overrides(overrides: list[str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(overrides for Hydra, [(point, key, value)] for `_apply_policy_overrides`). A preset's
    ladder names only its own policy's parameters, so Hydra could not set another policy or its
    parameters (an unknown key); they are applied after composition instead."""
    from dsq.engine.policies import all_parameter_names

    for_hydra, ours = [], []
    for override in overrides:
        key, sep, value = override.partition("=")
        match = _POLICY_KEY.fullmatch(key)
        if sep and match and (match[2] == "policy" or match[2] in all_parameter_names()):
            ours.append((match[1], match[2], value))
        elif sep and _SAVED_KEY.fullmatch(key.lstrip("+")):
            ours.append(("saved", _SAVED_KEY.fullmatch(key.lstrip("+"))[1], value))
        else:
            for_hydra.append(override)
    return for_hydra, ours


def _apply_policy_overrides(quant: DictConfig, overrides: list[tuple[str, str, str]]) -> None:
    """Set ``quant.saved``'s kinds given; then each point's policy, then its parameters. A new
    policy drops the parameters the preset gave the old one (``quant=dsq quant.q1.policy=cyclic``
    leaves out dsq's patience); a parameter given on the command line that the policy does not
    take stays, so that `QuantConfig` refuses it by name."""
    import yaml

    from dsq.engine.policies import DEFAULT_POLICY, all_parameter_names

    saved = {kind: value for point, kind, value in overrides if point == "saved"}
    if saved:  # checked with the rest of the spec (QuantSpec)
        quant.saved = dict(quant.get("saved") or {}) | saved
    overrides = [o for o in overrides if o[0] != "saved"]
    for point in dict.fromkeys(point for point, _, _ in overrides):
        node = quant.get(point)
        if not isinstance(node, DictConfig):
            raise ConfigError(
                f"quant.{point} is one format ({node}); a policy moves along a ladder: "
                f"quant.{point}={{levels: [bfp3, bfp4, bfp6], policy: cyclic}}"
            )
        given = {key: value for p, key, value in overrides if p == point}
        if "policy" in given and given["policy"] != node.get("policy", DEFAULT_POLICY):
            for key in [k for k in node if k in all_parameter_names() and k not in given]:
                node.pop(key)
        for key, value in given.items():
            node[key] = yaml.safe_load(value) if value != "" else None


_COMPOSING = threading.Lock()


def _compose_locked(overrides: list[str], policy_overrides=()) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with (
        _without_foreign_schemas(),
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"),
    ):
        try:
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
        except Exception as err:  # Hydra raises several exception types for bad overrides
            raise ConfigError(_explain(err, overrides)) from None
    # Hydra's own node is not part of a run's config; which file each group chose is.
    choices = {g: str(cfg.hydra.runtime.choices.get(g)) for g in GROUPS}
    with _unlocked(cfg):
        cfg.pop("hydra", None)
        cfg.choices = choices
        if policy_overrides:
            _apply_policy_overrides(cfg.quant, list(policy_overrides))
    if "family" not in cfg.task:
        raise ConfigError(
            f"conf/task/{choices['task']}.yaml sets no task.family; add {_family_lines()} to "
            "its task: block"
        )
    return typed(cfg)


@contextlib.contextmanager
def _without_foreign_schemas():
    """Hide other libraries' structured configs while composing ours.

    Importing fairseq stores its dataclasses in Hydra's global ConfigStore under names that are
    ours too (``config``, ``task/translation``, ``model/...``); Hydra would then validate our YAML
    files against fairseq's schemas. Only Hydra's own entries stay visible during composition.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    saved = store.repo
    visible = {k: v for k, v in saved.items() if k in ("hydra", "_dummy_empty_config_.yaml")}
    store.repo = visible
    try:
        yield
    finally:
        # Keep what was registered meanwhile (a module imported during composition).
        for key, value in visible.items():
            saved.setdefault(key, value)
        store.repo = saved


class _unlocked:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)
        return self.cfg

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def typed(cfg: DictConfig) -> DictConfig:
    """``cfg`` as the typed, resolved and checked run config: a new config in struct mode.

    ``cfg`` is a composed config or a run directory's stored config.yaml (``OmegaConf.load``,
    overrides merged on top). It is merged into the schema (`dsq_cli.run_config.RunConfig`), so
    every value has its declared type (``train.max_updates`` an ``int``, ``train.lr`` a
    ``float``) and a wrong type or an unknown key is a `ConfigError`; then the checks that need
    more than a type (`validate`'s) run and interpolations are resolved. ``cfg`` is not changed.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_schema_error(err)) from None
    OmegaConf.set_struct(merged, True)  # the open parts too (model, quant, choices)
    missing = sorted(_missing_keys(merged))
    if missing:
        raise ConfigError(
            f"the config sets no value for {', '.join(missing)} "
            "(conf/config.yaml and the group files set every key)"
        )
    _check(merged)
    return merged


def _missing_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """The keys left ``???`` (OmegaConf.missing_keys resolves interpolations; this does not)."""
    missing = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if OmegaConf.is_missing(cfg, key):
            missing.append(f"{prefix}{key}")
        elif isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation():
            missing += _missing_keys(node, f"{prefix}{key}.")
    return missing


def _schema_error(err: OmegaConfBaseException) -> str:
    """One line for a value the schema refuses: the key, the bad value, what it must be."""
    key = str(err.full_key or err.key or "")
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not key:
        return f"bad config: {text}"
    if isinstance(err, ConfigKeyError | ConfigAttributeError) and expects(key) is None:
        return _describe_unknown_key(OmegaConf.structured(RunConfig), key)
    want = expects(key)
    if want is None:
        return f"{key}: {text}"
    value = err.value
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value)
    node = err.child_node
    if isinstance(err, InterpolationResolutionError) and node is not None:
        key = f"{key} (= {node._value()})"  # the value came from elsewhere: say from where
    return f"{key} must be {want}, got {value!r}"


def _resolve(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
    except ValidationError as err:  # an interpolation whose value has the wrong type
        raise ConfigError(_schema_error(err)) from None
    except Exception as err:
        raise ConfigError(f"config does not resolve: {str(err).splitlines()[0]}") from None


def check_resume_from(value: str) -> None:
    """``resume_from`` names a checkpoint a run keeps (`RESUME_FROM`)."""
    if value not in RESUME_FROM:
        raise ConfigError(f"resume_from must be {' or '.join(RESUME_FROM)}, got {value!r}")


def _check(cfg: DictConfig) -> None:
    """What the schema's types cannot say: choices, ranges, budgets, a model that suits the task,
    a task family that names a registered task, the quant config. Resolves ``cfg`` in place."""
    from dsq.engine import QuantConfig

    _check_task_family(cfg)
    _check_model_suits_task(cfg)  # before resolving: GLUE tasks read the encoder's model.lr
    _resolve(cfg)
    _check_task_metric(cfg)
    try:
        quant = QuantConfig.from_dict(OmegaConf.to_container(cfg.quant))
        if cfg.train.max_updates:  # the cap; a budget of epochs is checked when it is planned
            quant.check_total(cfg.train.max_updates)
    except ValueError as err:
        raise ConfigError(f"quant: {err}") from None
    if quant.mlp == "sliced" and cfg.model.get("kind") != "llama":
        raise ConfigError(
            f"quant.mlp=sliced runs Llama-style MLPs a slice of tokens at a time, and "
            f"model={cfg.model.name} has none: train a Llama-style model (model=llama_lm) or "
            "set quant.mlp=whole"
        )
    train = cfg.train
    for key in ("max_epochs", "max_updates", "max_tokens", "update_freq", "log_every",
                "batch_size", "distributed_world_size", "loss_chunk_tokens"):  # fmt: skip
        if train[key] < 0:
            raise ConfigError(f"train.{key} must be a non-negative integer, got {train[key]!r}")
    for key in ("warmup_updates", "validate_every"):
        value = train[key]
        if value != "auto" and (isinstance(value, str) or value < 0):
            raise ConfigError(f"train.{key} must be a non-negative integer or auto, got {value!r}")
    if (
        train.activation_checkpointing
        and quant.stash_scope == "all"
        and quant.rounding["q1"] == "stochastic"
    ):
        raise ConfigError(
            "train.activation_checkpointing=true with quant.stash_scope=all and "
            "quant.rounding.q1=stochastic: the checkpoint packs nothing in a layer's first run, "
            "so the saved tensors' noise would be drawn in its run again only (docs/dsq.md, "
            '"Rounding"): round q1 to nearest, use stash_scope=gemm, or turn checkpointing off'
        )
    if quant.saved_format("checkpoint") is not None and not train.activation_checkpointing:
        raise ConfigError(
            "quant.saved.checkpoint holds the input of a checkpointed layer, and no layer is "
            "checkpointed: add train.activation_checkpointing=true, or drop the rule"
        )
    if train.stop_patience < 0:
        raise ConfigError(
            f"train.stop_patience must be a non-negative integer, got {train.stop_patience!r}"
        )
    if cfg.eval.checkpoint not in EVAL_CHECKPOINTS:
        raise ConfigError(
            f"eval.checkpoint must be {' or '.join(EVAL_CHECKPOINTS)}, got {cfg.eval.checkpoint!r}"
        )
    check_resume_from(cfg.resume_from)
    if cfg.resume_from != "last" and cfg.resume is None:
        raise ConfigError(
            f"resume_from={cfg.resume_from} chooses the checkpoint of a resume; give it with "
            "resume=RUN_DIR, or drop it to start a new run"
        )
    if train.max_epochs == 0 and train.max_updates == 0:
        raise ConfigError("set a budget: train.max_epochs or train.max_updates must be positive")
    for key in ("batch_size", "distributed_world_size"):
        if train[key] < 1:
            raise ConfigError(f"train.{key} must be at least 1, got {train[key]}")
    if train.max_tokens < 16:
        raise ConfigError(f"train.max_tokens must be at least 16, got {train.max_tokens}")
    if not train.lr > 0:
        raise ConfigError(f"train.lr must be positive, got {train.lr!r}")
    if train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {train.device!r}")
    subset = cfg.data.subset
    if subset is not None and subset < 1:
        raise ConfigError(f"data.subset must be a positive integer (examples), got {subset!r}")
    if cfg.eval.beam < 1:
        raise ConfigError(f"eval.beam must be at least 1, got {cfg.eval.beam!r}")
    if cfg.task.name == "translation" and not (cfg.data.src and cfg.data.tgt and cfg.data.raw_dir):
        raise ConfigError(
            "task=translation needs data.raw_dir=DIR data.src=SRC data.tgt=TGT "
            "(DIR holding {train,valid,test}.{SRC,TGT}[.gz])"
        )


def _task_file(cfg: DictConfig) -> str:
    return f"conf/task/{cfg.choices.get('task') or cfg.task.name}.yaml"


def _model_file(cfg: DictConfig) -> str:
    return f"conf/model/{cfg.choices.get('model') or cfg.model.get('name')}.yaml"


def _families() -> str:
    """``translation, glue or lm``: the family names, for a message."""
    return ", ".join(FAMILY_NAMES[:-1]) + f" or {FAMILY_NAMES[-1]}"


def _family_lines() -> str:
    """``family: translation`` or ``family: glue``: the lines a group file may declare."""
    return " or ".join(f"`family: {name}`" for name in FAMILY_NAMES)


def _models_of(family: str) -> list[str]:
    """The conf/model files whose model.family is ``family``."""
    return [
        name
        for name in group_choices("model")
        if OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml").get("family") == family
    ]


def _check_task_family(cfg: DictConfig) -> None:
    """task.family names the registry the task's name is in: GLUE tasks or translation tasks."""

    name, family = cfg.task.name, cfg.task.family
    if family not in FAMILY_NAMES:
        raise ConfigError(f"task.family must be {_families()}, got {family!r} ({_task_file(cfg)})")
    try:
        get_glue_task(name)
        is_glue = True
    except ValueError as err:
        is_glue, unknown_glue = False, str(err)
    if family == "glue" and not is_glue:
        hint = "; it is a translation task (family: translation)" if name in TASKS else ""
        raise ConfigError(f"task.family is glue but {unknown_glue}{hint}")
    if family == "lm" and name not in LM_TASKS:
        raise ConfigError(
            f"task.family is lm but unknown language-model task {name!r}; choose one of "
            f"{', '.join(LM_TASKS)}"
        )
    if family == "translation" and name not in TASKS:
        hint = "; it is a GLUE task (family: glue)" if is_glue else ""
        raise ConfigError(
            f"task.family is translation but unknown translation task {name!r}; choose one of "
            f"{', '.join(sorted(TASKS))}{hint}"
        )


def _check_task_metric(cfg: DictConfig) -> None:
    """task.metric (result.json's ``value``) is what the task's trainer reports first."""
    name, metric = cfg.task.name, cfg.task.metric
    if cfg.task.family == "glue":
        reported = get_glue_task(name).metric
        if metric != reported:
            raise ConfigError(
                f"task {name}: {_task_file(cfg)} says task.metric: {metric} but the GLUE task "
                f"reports {reported} first (metrics[0] of its class in dsq_cli/data/glue); "
                "make the two agree"
            )
    elif cfg.task.family == "lm":
        if metric != "perplexity":
            raise ConfigError(
                f"task {name}: task.metric must be perplexity for a language-model task (its "
                f"trainer reports validation perplexity), got {metric!r} ({_task_file(cfg)})"
            )
    elif metric != "bleu":
        raise ConfigError(
            f"task {name}: task.metric must be bleu for a translation task (its trainer scores "
            f"BLEU), got {metric!r} ({_task_file(cfg)})"
        )


def _check_model_suits_task(cfg: DictConfig) -> None:
    task, model = cfg.task.name, cfg.model.get("name")
    if not isinstance(model, str) or not model:
        raise ConfigError(
            f"model.name must be a string (the model's builder, conf/model/), got {model!r}"
        )
    # one vocabulary: a model serves the tasks whose task.family is its model.family
    family, wanted = cfg.model.get("family"), cfg.task.family
    if family is None:
        raise ConfigError(f"{_model_file(cfg)} sets no model.family; add {_family_lines()}")
    if family not in FAMILY_NAMES:
        raise ConfigError(
            f"model.family must be {_families()}, got {family!r} ({_model_file(cfg)})"
        )
    if family != wanted:
        raise ConfigError(
            f"model={model} is a {family} model (model.family) but task {task} is a {wanted} "
            f"task (task.family); choose a {wanted} model: model="
            f"{', '.join(_models_of(wanted)) or '(none in conf/model)'}"
        )


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_plain(cfg):
    """A config node as plain, resolved Python (dicts and lists); any other value as it is."""
    if isinstance(cfg, DictConfig | ListConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg
