"""The typed run config (dsq_cli.run_config): composed and stored configs arrive typed, a wrong
type is one line naming the key, the value and the type, and task.family (declared once per
conf/task file) agrees with the task registries and the GLUE tasks' headline metrics."""

from __future__ import annotations

import shutil

import pytest
import yaml
from omegaconf import OmegaConf
from typer.testing import CliRunner

from dsq_cli import config
from dsq_cli.cli import app
from dsq_cli.config import ConfigError, compose, group_choices, to_plain, typed
from dsq_cli.data.glue import get_glue_task
from dsq_cli.data.lm import LM_TASKS
from dsq_cli.data.tasks import TASKS
from dsq_cli.presets import CONF_DIR
from dsq_cli.run_config import RunConfig, TrainConfig, expects

# task=translation needs its text named; any value does for composing.
TRANSLATION = ["data.raw_dir=/tmp", "data.src=de", "data.tgt=en"]


def _compose_task(task: str, *extra: str):
    return compose([f"task={task}", *(TRANSLATION if task == "translation" else []), *extra])


# -- values arrive typed ------------------------------------------------------------------------


def test_composed_values_have_the_schema_types():
    cfg = compose(["task=sst2", "train.max_updates=5", "train.lr=3e-4", "train.warmup_updates=7"])
    assert OmegaConf.get_type(cfg, "train") is TrainConfig
    assert type(cfg.train.max_updates) is int and cfg.train.max_updates == 5
    assert type(cfg.train.lr) is float and cfg.train.lr == 3e-4
    assert cfg.train.warmup_updates == 7 and cfg.train.validate_every == 100
    assert compose([]).train.warmup_updates == 40
    assert compose(["task=translation", *TRANSLATION]).train.warmup_updates == "auto"
    assert [type(b) for b in cfg.train.adam_betas] == [float, float]
    assert cfg.task.family == "glue" and cfg.task.src is None and cfg.task.sizes is None
    assert type(cfg.eval.lenpen) is float and type(cfg.seed) is int
    # interpolations are resolved into the declared type (train.lr: ${model.lr})
    assert compose(["task=sst2", "model.lr=1"]).train.lr == 1.0


def test_an_int_for_a_float_is_a_float_and_a_string_for_an_int_an_int():
    cfg = typed(_stored(compose([]), eval={"lenpen": 1}, train={"max_updates": "12"}))
    assert type(cfg.eval.lenpen) is float and cfg.train.max_updates == 12


def test_the_typed_config_is_in_struct_mode_everywhere():
    cfg = compose([])
    for node in (cfg, cfg.train, cfg.model, cfg.quant, cfg.choices):
        with pytest.raises(Exception, match="foo"):
            node.foo = 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_updates=abc", "train.max_updates must be a non-negative integer, got 'abc'"),
        ("train.lr=fast", "train.lr must be a number, got 'fast'"),
        ("train.adam_betas=[0.9,x]", "train.adam_betas[1] must be a number, got 'x'"),
        ("train.adam_betas=5", "train.adam_betas must be a list of numbers, got 5"),
        ("train.warmup_updates=1.5", "train.warmup_updates must be a non-negative integer or auto"),
        (
            "train.validate_every=soon",
            "train.validate_every must be a non-negative integer or auto",
        ),
        ("seed=x", "seed must be an integer, got 'x'"),
        ("eval.beam=wide", "eval.beam must be an integer, got 'wide'"),
        ("data.subset=many", "data.subset must be a positive integer (examples) or null, got"),
        ("task.sizes.train=x", "task.sizes.train must be an integer, got 'x'"),
        (
            "+train.foo=1",
            "unknown config key 'train.foo'; keys there: activation_checkpointing, adam_",
        ),
        ("+foo=1", "unknown config key 'foo'; keys there: choices, data"),
        ("train.max_updates=-3", "train.max_updates must be a non-negative integer, got -3"),
        ("train.device=tpu", "train.device must be auto, cpu or cuda, got 'tpu'"),
        ("model.name=3", "model.name must be a string"),
        ("train.lr=${model.nope}", "config does not resolve: Interpolation key 'model.nope'"),
    ],
)
def test_a_bad_value_is_one_line_naming_key_value_and_type(override, message):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_interpolated_value_of_the_wrong_type_names_where_it_came_from():
    with pytest.raises(ConfigError, match=r"train.lr \(= \$\{model.lr\}\) must be a number"):
        compose(["task=sst2", "model.lr=abc"])


def test_expects_describes_schema_keys_and_leaves_open_ones():
    assert expects("train.max_updates") == "a non-negative integer"
    assert expects("run.dir") == "a string or null"
    assert expects("train.adam_betas") == "a list of numbers"
    assert expects("logger.tags[0]") == "a string"
    assert expects("model.lr") is None and expects("quant.q0") is None
    assert expects("train.nope") is None


# -- stored configs: load_resume's path ---------------------------------------------------------


def _stored(cfg, **changes):
    """A run directory's config.yaml as load_resume reads it (plain YAML, struct mode)."""
    plain = yaml.safe_load(yaml.safe_dump(to_plain(cfg), sort_keys=False))
    for section, values in changes.items():
        plain[section].update(values)
    stored = OmegaConf.create(plain)
    OmegaConf.set_struct(stored, True)
    return stored


@pytest.mark.parametrize("task", ["demo", "sst2"])
def test_a_stored_config_types_back_to_the_composed_one(task):
    composed = compose([f"task={task}"])
    stored = _stored(composed)
    again = typed(stored)
    assert to_plain(again) == to_plain(composed)
    assert OmegaConf.get_type(again, "train") is TrainConfig
    assert OmegaConf.get_type(stored, "train") is dict  # typed returns a new config


def test_typed_checks_and_resolves_a_stored_config():
    stored = _stored(compose([]))
    merged = OmegaConf.merge(stored, OmegaConf.from_dotlist(["train.max_updates=abc"]))
    with pytest.raises(ConfigError, match="train.max_updates must be a non-negative integer"):
        typed(merged)
    plain = to_plain(compose([]))
    plain["train"]["lr"] = "${eval.lenpen}"
    cfg = typed(OmegaConf.create(plain))
    assert cfg.train.lr == 1.0 and not OmegaConf.is_interpolation(cfg.train, "lr")


def test_a_stored_config_without_task_family_is_refused_with_the_key_named():
    plain = to_plain(compose(["task=demo"]))
    del plain["task"]["family"]
    with pytest.raises(ConfigError, match="the config sets no value for task.family"):
        typed(OmegaConf.create(plain))


def test_a_stored_config_without_a_key_is_refused_by_name():
    plain = to_plain(compose([]))
    del plain["train"]["max_tokens"]
    with pytest.raises(ConfigError, match="sets no value for train.max_tokens"):
        typed(OmegaConf.create(plain))


def test_the_schema_alone_has_no_values_of_the_yaml():
    # One place for each default: conf/config.yaml. The schema only types them.
    schema = OmegaConf.structured(RunConfig)
    assert OmegaConf.is_missing(schema.train, "max_updates")
    assert OmegaConf.is_missing(schema.task, "family")


# -- task.family: one declaration per task file, checked against the registries ------------------


@pytest.mark.parametrize("task", group_choices("task"))
def test_every_task_file_declares_a_family_that_matches_its_registry(task):
    text = (CONF_DIR / "task" / f"{task}.yaml").read_text()
    declared = yaml.safe_load(text)["task"]["family"]
    cfg = _compose_task(task)
    assert cfg.task.family == declared and cfg.model.family == declared  # one vocabulary
    if declared == "glue":
        assert cfg.task.metric == get_glue_task(cfg.task.name).metric
    elif declared == "lm":
        assert cfg.task.name in LM_TASKS and cfg.task.metric == "perplexity"
    else:
        assert declared == "translation" and cfg.task.name in TASKS
        assert cfg.task.metric == "bleu"


def test_a_glue_metric_that_disagrees_with_the_task_class_names_both_and_the_fix():
    with pytest.raises(ConfigError) as err:
        compose(["task=mrpc", "task.metric=accuracy"])
    message = str(err.value)
    assert "conf/task/mrpc.yaml says task.metric: accuracy" in message
    assert "GLUE task reports f1 first (metrics[0]" in message
    assert "make the two agree" in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.family=glue"], "task.family is glue but unknown GLUE task 'demo'; choose one of"),
        (
            ["task=sst2", "task.family=translation"],
            "task.family is translation but unknown translation task 'sst2'; choose one of",
        ),
        (["task.family=vision"], "task.family must be translation, glue or lm, got 'vision'"),
        (["task.metric=chrf"], "task.metric must be bleu for a translation task"),
        (["task.name=nope"], "unknown translation task 'nope'"),
        (["task=sst2", "task.name=nope"], "unknown GLUE task 'nope'"),
        (
            ["model=minilm"],
            "model=minilm is a glue model (model.family) but task demo is a translation task "
            "(task.family); choose a translation model: model=transformer_iwslt, "
            "transformer_small, transformer_tiny",
        ),
        (
            ["task=sst2", "model=transformer_tiny"],
            "task sst2 is a glue task (task.family); choose a glue model: model=minilm, "
            "roberta_base, roberta_tiny",
        ),
        (["model.family=encoder"], "model.family must be translation, glue or lm, got 'encoder'"),
        (["~model.family"], "conf/model/transformer_small.yaml sets no model.family; add"),
    ],
)
def test_family_mismatches_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_task_file_without_family_is_refused_when_composed(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    path = conf / "task" / "rte.yaml"
    path.write_text("".join(l for l in path.read_text().splitlines(True) if "family:" not in l))
    monkeypatch.setattr(config, "CONF_DIR", conf)
    with pytest.raises(ConfigError, match=r"conf/task/rte.yaml sets no task.family; add"):
        compose(["task=rte"])


# -- the CLI -------------------------------------------------------------------------------------


def test_a_bad_type_on_the_command_line_exits_2_with_one_line(tmp_path):
    result = CliRunner().invoke(
        app, ["train", "train.max_updates=abc", f"run.root={tmp_path / 'runs'}"]
    )
    assert result.exit_code == 2, result.output
    assert "train.max_updates must be a non-negative integer, got 'abc'" in result.output
    assert result.output.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_run_from_before_task_family_resumes_once_told_its_family(tmp_path):
    from dsq_cli.train import load_resume
    from dsq_cli.train.recorder import save_checkpoint

    plain = to_plain(compose(["task=demo", f"run.root={tmp_path}"]))
    del plain["task"]["family"]
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(plain))
    save_checkpoint(run / "checkpoints" / "checkpoint_last.pt", {"num_updates": 3})
    with pytest.raises(ConfigError, match="predates task.family; .*add task.family=translation"):
        load_resume(str(run), [f"resume={run}"])
    cfg, resume = load_resume(str(run), [f"resume={run}", "task.family=translation"])
    assert cfg.task.family == "translation" and resume.run_dir == run
    assert resume.state["num_updates"] == 3
    assert yaml.safe_load((run / "config.yaml").read_text())["task"]["family"] == "translation"
    with pytest.raises(ConfigError, match="task.family cannot change"):  # now it is stored
        load_resume(str(run), ["task.family=glue"])


@pytest.mark.parametrize(
    "task, old, new", [("demo", None, "translation"), ("sst2", "encoder", "glue")]
)
def test_a_run_from_before_one_family_vocabulary_resumes_with_its_model_family_renamed(
    tmp_path, task, old, new
):
    # model.family was absent (a translation model) or `encoder` (a GLUE encoder)
    from dsq_cli.train import load_resume
    from dsq_cli.train.recorder import save_checkpoint

    plain = to_plain(compose([f"task={task}", f"run.root={tmp_path}"]))
    if old is None:
        del plain["model"]["family"]
    else:
        plain["model"]["family"] = old
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(plain))
    save_checkpoint(run / "checkpoints" / "checkpoint_last.pt", {"num_updates": 3})
    cfg, _ = load_resume(str(run), [f"resume={run}"])
    assert cfg.model.family == new == cfg.task.family
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["family"] == new


def test_quant_saved_kinds_are_set_from_the_command_line_with_or_without_a_plus():
    """No preset writes quant.saved (the engine holds its defaults), so its kinds are set after
    composition, as a ladder's policy parameters are; the spec checks them."""
    from dsq.engine import QuantConfig

    cfg = compose(["quant=dsq", "quant.stash_scope=all", "quant.saved.norm=bf16",
                   "+quant.saved.constant=q1"])  # fmt: skip
    assert dict(cfg.quant.saved) == {"norm": "bf16", "constant": "q1"}
    held = QuantConfig.from_dict(dict(cfg.quant)).to_dict()["saved"]
    assert held == {"norm": "bf16", "activation": "bfp8e8b16", "elementwise": "bfp8e8b16",
                    "constant": "q1", "checkpoint": "keep"}  # fmt: skip
