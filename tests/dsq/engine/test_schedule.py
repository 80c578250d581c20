"""docs/spec.md §3: the schedule rule, walked through loss sequences, and QuantConfig plumbing."""

from __future__ import annotations

import math

import pytest

from dsq.engine import QuantConfig, Schedule


def walk(schedule: Schedule, losses):
    return [schedule.step(loss, update=i) for i, loss in enumerate(losses)]


def test_patience_one_moves_up_after_each_stall():
    s = Schedule(["bfp2", "bfp3", "bfp4"], patience=1)
    got = walk(s, [5.0, 4.0, 4.0, 3.9, 3.95, 3.0, 3.0, 2.0])
    # 4.0 is not < 4.0: stall -> up (best reset to 4.0); 3.9 improves; 3.95 stalls -> up; the
    # top level stays
    assert got == [
        "bfp2e8b16",
        "bfp2e8b16",
        "bfp3e8b16",
        "bfp3e8b16",
        "bfp4e8b16",
        "bfp4e8b16",
        "bfp4e8b16",
        "bfp4e8b16",
    ]
    assert [(c.update, c.from_spec, c.to_spec) for c in s.changes] == [
        (2, "bfp2e8b16", "bfp3e8b16"),
        (4, "bfp3e8b16", "bfp4e8b16"),
    ]


def test_patience_counts_consecutive_bad_validations_and_resets_on_improvement():
    s = Schedule(["bfp2", "bfp4"], patience=3)
    walk(s, [5.0, 5.1, 5.2])  # two bad
    assert s.level == 0 and s.policy.bad == 2
    s.step(4.0)  # improvement resets
    assert s.policy.bad == 0 and s.policy.best == 4.0
    walk(s, [4.0, 4.5])
    assert s.level == 0
    s.step(4.2)  # third bad in a row
    assert s.level == 1 and s.policy.bad == 0 and s.policy.best == 4.2


def test_min_delta_requires_a_large_enough_improvement():
    s = Schedule(["bfp2", "bfp4", "bfp8"], patience=1, min_delta=0.1)
    s.step(3.0)
    s.step(2.95)  # improves by 0.05 < min_delta: a stall
    assert s.level == 1 and s.policy.best == 2.95
    s.step(2.8)  # 2.8 < 2.95 - 0.1: improvement
    assert s.level == 1 and s.policy.best == 2.8
    s.step(2.7)  # exactly min_delta: not strictly better
    assert s.level == 2


def test_precision_never_falls_and_state_survives_save_and_restore():
    s = Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"], patience=2, min_delta=0.01)
    losses = [6.0, 5.0, 5.5, 5.2, 4.0, 4.1, 4.3, 3.0, 3.0, 3.0, 3.0, 2.0, 9.0, 9.0, 9.0, 9.0]
    bits = []
    for i, loss in enumerate(losses[:8]):
        s.step(loss, update=i)
        bits.append(s.format.bits_per_value)
    state = s.state_dict()
    resumed = Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"], patience=2, min_delta=0.01)
    resumed.load_state_dict(state)
    for i, loss in enumerate(losses[8:], start=8):
        a, b = s.step(loss, update=i), resumed.step(loss, update=i)
        assert a == b
        bits.append(s.format.bits_per_value)
    assert bits == sorted(bits)  # monotonic
    assert resumed.state_dict() == s.state_dict()
    assert s.current == "bfp8e8b16"


def test_schedule_errors():
    with pytest.raises(ValueError, match="rise in bits"):
        Schedule(["bfp4", "bfp2"])
    with pytest.raises(ValueError, match="rise in bits"):
        Schedule(["bfp4", "bfp4e8b16"])
    with pytest.raises(ValueError, match="at least one level"):
        Schedule([])
    with pytest.raises(ValueError, match="invalid format spec"):
        Schedule(["bfp2", "bfp99"])
    with pytest.raises(ValueError, match="patience"):
        Schedule(["bfp2"], patience=0)
    with pytest.raises(ValueError, match="diverged"):
        Schedule(["bfp2", "bfp4"]).step(math.nan)
    with pytest.raises(ValueError, match="same quant config"):
        Schedule(["bfp2", "bfp4"]).load_state_dict(Schedule(["bfp3", "bfp4"]).state_dict())


def test_quant_config_steps_every_point_from_one_place():
    cfg = QuantConfig(
        q0="bfp8", q1={"levels": ["bfp2", "bfp4"], "patience": 1}, q2="bfp8", q3="fixed16"
    )
    assert cfg.current() == {
        "q0": "bfp8e8b16",
        "q1": "bfp2e8b16",
        "q2": "bfp8e8b16",
        "q3": "fixed16",
    }
    assert cfg.step(3.0, update=10) == []
    changes = cfg.step(3.5, update=20)
    assert [(p, c.update, c.to_spec) for p, c in changes] == [("q1", 20, "bfp4e8b16")]
    assert cfg.format("q1").spec == "bfp4e8b16"
    restored = QuantConfig(q0="bfp8", q1={"levels": ["bfp2", "bfp4"]}, q2="bfp8", q3="fixed16")
    restored.load_state_dict(cfg.state_dict())
    assert restored.current() == cfg.current()


def test_quant_config_errors():
    with pytest.raises(ValueError, match="unknown quantization point"):
        QuantConfig.from_dict({"q0": "bfp8", "q5": "bfp4"})
    with pytest.raises(ValueError, match="unknown quantization point"):
        QuantConfig().format("q4")
    with pytest.raises(ValueError, match="stash_scope"):
        QuantConfig(stash_scope="everything")
    with pytest.raises(ValueError, match="a ladder is"):
        QuantConfig(q1={"level": ["bfp2"]})
