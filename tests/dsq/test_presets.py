"""The library owns the quant presets (dsq.presets): every conf/quant/*.yaml holds exactly its
registered QuantSpec's mapping, and the other way round; a QuantSpec round-trips through its
mapping; QuantConfig is built from one and keeps its schedule state apart from it."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

from dsq.engine import Ladder, QuantConfig, QuantSpec, Schedule
from dsq.engine.spec import SPEC_VERSION
from dsq.presets import (
    PRESETS,
    get_preset,
    preset_differences,
    preset_names,
    record_quant,
    register_preset,
)

REPO = Path(__file__).resolve().parents[2]
QUANT_DIR = REPO / "dsq_cli" / "conf" / "quant"
YAML_PRESETS = sorted(p.stem for p in QUANT_DIR.glob("*.yaml"))


def test_every_preset_file_is_a_library_preset_and_every_library_preset_has_its_file():
    assert YAML_PRESETS == preset_names()


@pytest.mark.parametrize("name", sorted(set(YAML_PRESETS) | set(PRESETS)))
def test_a_preset_file_holds_its_library_presets_mapping(name):
    path = QUANT_DIR / f"{name}.yaml"
    assert path.is_file(), f"dsq.presets registers {name!r} but conf/quant has no {path.name}"
    assert name in PRESETS, f"{path.name} has no preset in dsq.presets: register_preset it there"
    assert yaml.safe_load(path.read_text()) == get_preset(name).to_dict(), (
        f"{path.name} and dsq.presets' {name!r} differ: the library's value is the preset"
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_round_trips_and_builds_its_config(name):
    spec = get_preset(name)
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert hash(QuantSpec.from_dict(spec.to_dict())) == hash(spec)
    cfg = QuantConfig.from_preset(name, seed=3)
    assert cfg.spec == spec and cfg.to_dict() == spec.to_dict() and cfg.seed == 3
    assert preset_differences({"preset": name, **cfg.to_dict()}) == []


def test_from_preset_builds_the_papers_dsq():
    cfg = QuantConfig.from_preset("dsq")
    assert cfg.current() == {"q0": "bfp8e8b16", "q1": "bfp2e8b16", "q2": "bfp8e8b16",
                             "q3": "fixed16"}  # fmt: skip
    assert cfg.schedule("q1").levels[-1] == "bfp8e8b16" and cfg.stash_scope == "gemm"
    with pytest.raises(ValueError, match=r"unknown quant preset 'dsq9'; choose one of \["):
        QuantConfig.from_preset("dsq9")


def test_the_spec_is_frozen_and_the_schedule_state_is_the_configs():
    cfg = QuantConfig.from_preset("dsq")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.spec.q0 = "bfp4"
    with pytest.raises(TypeError):
        cfg.spec.q1.params["patience"] = 3
    cfg.step(1.0, update=1)
    cfg.step(2.0, update=2)  # a stall: the stash moves up a level
    assert cfg.current()["q1"] == "bfp3e8b16" and cfg.state_dict()["q1"]["level"] == 1
    assert cfg.spec == get_preset("dsq")  # what was asked for has not moved
    resumed = QuantConfig.from_preset("dsq")
    resumed.load_state_dict(cfg.state_dict())
    assert resumed.current() == cfg.current()


def test_a_config_pickles_and_copies_with_its_spec():
    cfg = QuantConfig.from_preset("dsq")
    cfg.step(1.0, update=1)
    cfg.step(2.0, update=2)
    assert pickle.loads(pickle.dumps(cfg.spec)) == cfg.spec
    copied = copy.deepcopy(cfg)  # a patched model's deepcopy copies the config its layers hold
    assert copied.spec == cfg.spec and copied.state_dict() == cfg.state_dict()


def test_keyword_construction_records_its_spec_and_keeps_the_schedule_given():
    ladder = Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"], patience=1)
    cfg = QuantConfig(q0="bfp8", q1=ladder, q2="bfp8", q3="fixed16", rounding={"q1": "stochastic"})
    assert cfg.schedule("q1") is ladder  # the config steps the schedule it was given
    assert cfg.spec.q1 == Ladder(tuple(ladder.levels), params={"patience": 1, "min_delta": 0.0})
    assert cfg.rounding == {"q0": "nearest", "q1": "stochastic", "q2": "nearest", "q3": "nearest"}
    # formats compare as formats: only the rounding differs from the dsq preset
    assert preset_differences({"preset": "dsq", **cfg.to_dict()}) == ["rounding.q1=stochastic"]
    assert QuantConfig.from_dict(cfg.to_dict()).spec == cfg.spec


def test_an_attention_rule_is_a_difference_and_an_attention_kernel_is_not():
    """tiled and explicit give the preset's values (a run with either is the preset's); the rule
    sdpa_bf16 gives its own, so its runs are a row of their own."""
    base = {"preset": "dsq", **get_preset("dsq").to_dict()}
    assert preset_differences(base | {"attention": "explicit"}) == []
    assert preset_differences(base | {"attention": "tiled"}) == []
    assert preset_differences(base | {"attention": "sdpa_bf16"}) == ["attention=sdpa_bf16"]
    assert record_quant(base | {"attention": "sdpa_bf16"})["modified"] is True


def test_a_spec_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="q1: a ladder is"):
        QuantSpec(q1={"patience": 1})
    with pytest.raises(ValueError, match="q1: schedule levels must rise"):
        QuantSpec(q1=Ladder(("bfp8", "bfp2")))
    with pytest.raises(ValueError, match="engine=autocast"):
        QuantSpec("bf16", "bfp4", "bf16", "bf16", engine="autocast")
    with pytest.raises(ValueError, match="unknown quantization point"):
        QuantSpec.from_dict({"q4": "bfp8"})


def test_a_new_preset_is_one_registered_value():
    name = "test_stash_bfp3_stochastic"
    spec = dataclasses.replace(get_preset("stash_bfp"), q1="bfp3", rounding={"q1": "stochastic"})
    try:
        register_preset(name, spec)
        assert QuantConfig.from_preset(name).current()["q1"] == "bfp3e8b16"
        with pytest.raises(ValueError, match="registered already"):
            register_preset(name, spec)
    finally:
        PRESETS.pop(name, None)


# -- the spec's version and the one migration of old records -------------------------------------
def test_a_spec_writes_its_version_and_refuses_one_from_a_newer_dsq():
    mapping = get_preset("dsq").to_dict()
    assert mapping["version"] == SPEC_VERSION == 2
    assert QuantSpec.from_dict(mapping) == get_preset("dsq")
    with pytest.raises(ValueError, match="written by a newer dsq"):
        QuantSpec.from_dict(mapping | {"version": SPEC_VERSION + 1})
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match="versions are whole numbers from 1"):
            QuantSpec.from_dict(mapping | {"version": bad})


def test_a_version_1_record_reads_as_what_its_run_did():
    """A record written before the version key left out what its run did before each setting
    existed: attention explicit, GEMMs in float32, the dsq engine, the GEMM scope, nearest
    rounding; and ``modified`` is decided from the preset where it is absent."""
    old = {"preset": "dsq", **{p: v for p, v in get_preset("dsq").to_dict().items()
                               if p in ("q0", "q1", "q2", "q3")}}  # fmt: skip
    quant = record_quant(old)
    assert quant["version"] == SPEC_VERSION and quant["modified"] is False
    assert (quant["attention"], quant["gemm_unit"], quant["engine"], quant["stash_scope"]) == (
        "explicit", "fp32", "dsq", "gemm")  # fmt: skip
    assert quant["rounding"] == dict.fromkeys(("q0", "q1", "q2", "q3"), "nearest")
    assert "saved" not in quant
    spec = QuantSpec.from_dict({k: v for k, v in old.items() if k != "preset"} | {"version": 1})
    assert spec.attention == "explicit" and spec.gemm_unit == "fp32"
    assert record_quant(old | {"q1": "bfp3"})["modified"] is True
    assert record_quant(old | {"preset": "no_such_preset"})["modified"] is True


def test_a_version_1_record_of_the_library_left_out_its_defaults():
    """The Hugging Face callback wrote version 1's ``to_dict``, which left out ``gemm_unit`` auto
    and ``attention`` tiled; ``dsq train`` wrote every key its config had."""
    written = {k: v for k, v in get_preset("dsq").to_dict().items() if k != "version"}
    quant = record_quant({"preset": "dsq", **written, "modified": False}, by_library=True)
    assert (quant["gemm_unit"], quant["attention"]) == ("auto", "tiled")
    spec = {k: v for k, v in quant.items() if k not in ("preset", "modified")}
    assert QuantSpec.from_dict(spec) == get_preset("dsq")


def test_a_version_1_stash_scope_all_held_every_saved_tensor_in_the_stash():
    """``all`` before its rules held every kind in q1; a record with rules but without a kind
    that came later held that kind at its default."""
    old = {"preset": "dsq", "q0": "bfp8", "q1": "bfp2", "q2": "bfp8", "q3": "fixed16",
           "stash_scope": "all"}  # fmt: skip
    before_rules = record_quant(old)["saved"]
    assert before_rules == {"norm": "q1", "activation": "q1", "elementwise": "q1",
                            "constant": "q1", "checkpoint": "keep"}  # fmt: skip
    rules = {"norm": "bfp8e8b16", "activation": "bfp8e8b16", "elementwise": "bfp8e8b16",
             "constant": "keep"}  # fmt: skip
    assert record_quant(old | {"saved": rules})["saved"] == rules | {"checkpoint": "keep"}


def test_records_read_through_the_result_type_are_upgraded_and_new_ones_are_not_changed():
    """A committed record from before the key (no attention, no gemm_unit, no rounding) and one
    written since (attention tiled) read as their runs ran."""
    from dsq_cli.run_result import RunResult

    old = RunResult.read(REPO / "results/multi30k-wall-time/dsq-seed1-run1")
    assert old.quant["attention"] == "explicit" and old.quant["gemm_unit"] == "fp32"
    new_path = REPO / "results/lm/seed1/quant-dsq/result.json"
    new = RunResult.read(new_path)
    written = yaml.safe_load(new_path.read_text())["quant"]
    assert new.quant == written | {"version": SPEC_VERSION, "engine": "dsq"}


def test_a_rule_for_saved_tensors_is_named_alone_whatever_order_the_record_lists_the_rules():
    """Each kind whose rule differs from the default is named on its own, in the rules' order:
    two records of one setting, their rules listed in different orders, read alike."""
    from dsq.engine.spec import SAVED_DEFAULT

    base = {"preset": "dsq", **get_preset("dsq").to_dict(), "stash_scope": "all"}
    listed = dict(SAVED_DEFAULT) | {"activation": "derivative3"}
    for rules in (listed, dict(reversed(listed.items()))):
        assert preset_differences(base | {"saved": rules}) == [
            "stash_scope=all", "saved.activation=derivative3"]  # fmt: skip
    assert preset_differences(base | {"saved": dict(SAVED_DEFAULT)}) == ["stash_scope=all"]
    # a default written in another spelling is the default (bfp8 is bfp8e8b16)
    assert preset_differences(base | {"saved": {"norm": "bfp8"}}) == ["stash_scope=all"]
    every_q1 = dict.fromkeys(("norm", "activation", "elementwise", "constant"), "q1")
    named = [f"saved.{kind}=q1" for kind in ("norm", "activation", "elementwise", "constant")]
    assert preset_differences(base | {"saved": every_q1})[1:] == named
