"""The precision policies (docs/dsq.md, "Precision policies"): each one's level sequence against
values worked out by hand from its source's formula, the mapping of bits onto a ladder, their
parameters and errors, and their state across a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsq.engine import QuantConfig, Schedule
from dsq.engine.policies import highest_level_within

ONE_PER_BIT = ["bfp3", "bfp4", "bfp5", "bfp6", "bfp7", "bfp8"]  # a level's bits = its index + 3
DSQ_LADDER = ["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"]


def bits_in_force(schedule: Schedule, total: int) -> list[int]:
    """The bit width in force at each update 1..total, as a trainer drives the schedule."""
    schedule.start(total, 0)
    seen = []
    for update in range(1, total + 1):
        seen.append(schedule.format.significant_bits + 1)
        schedule.after_update(update, train_loss=1.0)
    return seen


# -- cyclic (CPT) --------------------------------------------------------------------------------
def test_cyclic_follows_cpt_by_hand():
    # T = int(64 / 2) = 32; b(i) = rint(3 + 2.5 (1 + cos(pi (i mod 32) / 32 + pi))), i = update - 1
    # i=8: 3 + 2.5 (1 - cos(pi/4)) = 3.732 -> 4; i=16: 5.5 -> 6 (half to even); i=24: 7.268 -> 7;
    # i=31: 7.988 -> 8; i=32: a new period, 3.
    seen = bits_in_force(Schedule(ONE_PER_BIT, "cyclic", periods=2), 64)
    assert [seen[i] for i in (0, 8, 16, 24, 31, 32, 40, 48, 63)] == [3, 4, 6, 7, 8, 3, 4, 6, 8]


def test_cyclic_equals_the_source_formula_at_every_update():
    def cpt(i, period, low, high):  # cpt_cifar/train.py, cyclic_adjust_precision
        return np.rint(
            low + 0.5 * (high - low) * (1 + np.cos(np.pi * ((i % period) / period) + np.pi))
        )

    total, periods = 200, 6
    seen = bits_in_force(Schedule(ONE_PER_BIT, "cyclic", periods=periods), total)
    assert seen == [int(cpt(i, int(total / periods), 3, 8)) for i in range(total)]


def test_cyclic_on_dsqs_ladder_takes_the_highest_level_within_the_bits():
    # b from 2 to 8: 5 bits is not a level, so bfp4 (4 bits) is in force; 7 bits -> bfp6
    assert highest_level_within([2, 3, 4, 6, 8], 5) == 2
    assert highest_level_within([2, 3, 4, 6, 8], 7) == 3
    assert highest_level_within([2, 3, 4, 6, 8], 8) == 4
    seen = bits_in_force(Schedule(DSQ_LADDER, "cyclic", periods=1), 32)
    # T = 32: b(i) = rint(2 + 3 (1 - cos(pi i / 32))); i=10: 2 + 3 (1 - 0.5556) = 3.33 -> 3;
    # i=16: 5 -> bfp4; i=20: 2 + 3 (1 + 0.3827) = 6.15 -> 6; i=22: 7.06 -> 7 -> bfp6
    assert [seen[i] for i in (0, 10, 16, 20, 22, 31)] == [2, 3, 4, 6, 6, 8]
    assert set(seen) == {2, 3, 4, 6, 8}


# -- shape (Wolfe & Kyrillidis) ------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, total, expected",
    [
        # T = int(99 / 1) + 1 = 100, b_min 3, b_max 8, z = i / 100
        ({"shape": "cos"}, 99, {0: 3, 50: 6, 98: 8}),  # i=50: 3 + 2.5 (1 - cos(pi/2)) = 5.5 -> 6
        ({"shape": "linear"}, 99, {10: 4, 30: 4, 50: 6}),  # 3.5 -> 4, 4.5 -> 4 (half to even)
        ({"shape": "exp"}, 99, {0: 3, 25: 6}),  # i=25: 8 - 5 e^-1 = 6.16 -> 6
        ({"shape": "demon"}, 99, {0: 3, 50: 3}),  # i=50: 8 - 5 (0.5 / 0.55) = 3.45 -> 3
        ({"shape": "cos", "direction": "decay"}, 99, {0: 8, 50: 6}),
        # decay alternates with growth: T = int(99 / 2) + 1 = 50, i=60 is in period 1 (growth):
        # 3 + 2.5 (1 - cos(0.2 pi)) = 3.48 -> 3
        ({"shape": "cos", "direction": "decay", "periods": 2}, 99, {0: 8, 60: 3}),
        ({"shape": "exp", "direction": "decay"}, 99, {25: 8}),  # z -> 0.75: 8 - 5 e^-3 = 7.75
        ({"shape": "exp", "direction": "decay", "flip_vertically": True}, 99, {25: 5}),  # 4.84
        ({"shape": "demon", "direction": "decay"}, 99, {0: 8, 50: 3}),  # 3.45 -> 3
        ({"shape": "demon", "direction": "decay", "flip_vertically": True}, 99, {50: 8}),  # 7.55
        ({"shape": "exp", "exponent": 1.0}, 99, {50: 5}),  # 8 - 5 e^-0.5 = 4.97 -> 5
    ],
)
def test_shape_follows_the_source_by_hand(params, total, expected):
    seen = bits_in_force(Schedule(ONE_PER_BIT, "shape", **params), total)
    assert {i: seen[i] for i in expected} == expected


# -- pfq (FracTrain) -----------------------------------------------------------------------------
def drive_pfq(schedule: Schedule, windows: list[float]) -> list[tuple[int, int]]:
    """Each window: two updates whose training losses average to its value, then a validation;
    return (window, level) for every change."""
    schedule.start(2 * len(windows), 0)
    moves, update = [], 0
    for window, value in enumerate(windows, start=1):
        for loss in (value - 0.5, value + 0.5):
            update += 1
            schedule.after_update(update, loss)
        before = schedule.level
        schedule.step(valid_loss=100.0, update=update)  # pfq ignores the validation loss
        if schedule.level != before:
            moves.append((window, schedule.level))
    return moves


def test_pfq_turning_points_by_hand():
    windows = [12, 10, 10, 10, 10, 10, 9, 9, 9, 9, 9, 8, 8.1, 8.2, 8.3, 8.4, 8.4, 8.4, 8.4, 7]
    # window 5: scale = 52/5 = 10.4, |12 - 10| / 10.4 = 0.19 > 0.15: no; window 6: all five 10s:
    # turning point 1 (threshold -> 0.06, kept losses cleared). Window 11: five 9s: turning
    # point 2 (threshold -> 0.024); the scale is fixed after window 10: (62 + 36) / 10 = 9.8.
    # Window 16: 0.4/9.8 = 0.041 > 0.024; 17: 0.3/9.8 = 0.031; 18: 0.2/9.8 = 0.0204: turning
    # point 3, the last of a 4-level ladder: the fall to 7 moves nothing.
    schedule = Schedule(["bfp3", "bfp4", "bfp6", "bfp8"], "pfq")
    assert drive_pfq(schedule, windows) == [(6, 1), (11, 2), (18, 3)]
    assert math.isclose(schedule.policy.threshold, 0.15 * 0.4 * 0.4)
    assert [c.train_loss for c in schedule.changes] == [10.0, 9.0, 8.4]


def test_pfq_parameters_change_the_turning_points():
    windows = [12, 10, 10, 10, 10, 10, 9, 9, 9, 9, 9]
    # keep=3: window 3 sees [12, 10, 10] with scale 32/3: 2/10.67 = 0.19 > 0.15; window 4 fires
    assert drive_pfq(Schedule(DSQ_LADDER, "pfq", keep=3), windows)[0] == (4, 1)
    # threshold 0.2: window 5 already fires (0.19 <= 0.2)
    assert drive_pfq(Schedule(DSQ_LADDER, "pfq", threshold=0.2), windows)[0] == (5, 1)
    # one turning point allowed
    assert drive_pfq(Schedule(DSQ_LADDER, "pfq", turning_points=1), windows) == [(6, 1)]


# -- every policy: state across a checkpoint, errors ---------------------------------------------
@pytest.mark.parametrize(
    "policy, params",
    [
        ("plateau", {"patience": 2}),
        ("cyclic", {"periods": 3}),
        ("shape", {"shape": "exp"}),
        ("pfq", {"keep": 2, "threshold": 0.5}),
    ],  # fmt: skip
)
def test_a_resumed_schedule_continues_exactly(policy, params):
    rng = np.random.default_rng(0)
    losses = list(5 - np.arange(60) * 0.01 + rng.normal(0, 0.05, 60))
    valid = list(4 + rng.normal(0, 0.1, 60))  # flat: plateau stalls

    def run(stop_at=None, state=None):
        schedule = Schedule(DSQ_LADDER, policy, **params)
        start = 0
        if state is not None:
            schedule.load_state_dict(state)
            start = stop_at
        schedule.start(60, start)
        for update in range(start + 1, 61):
            schedule.after_update(update, float(losses[update - 1]))
            if update % 4 == 0:
                schedule.step(float(valid[update - 1]), update)
            if update == stop_at and state is None:
                return schedule.state_dict()
        return schedule

    straight = run()
    resumed = run(stop_at=33, state=run(stop_at=33))
    assert straight.changes, f"{policy} never moved: the test would show nothing"
    assert resumed.changes == straight.changes and resumed.level == straight.level


def test_a_checkpoint_of_another_policy_is_refused():
    state = Schedule(DSQ_LADDER, "cyclic").state_dict()
    with pytest.raises(ValueError, match="follows policy cyclic, this run's plateau"):
        Schedule(DSQ_LADDER).load_state_dict(state)


def test_a_checkpoint_from_before_policies_loads_as_plateau():
    canonical = Schedule(DSQ_LADDER).levels  # bfp2e8b16, ...
    state = {"levels": canonical, "level": 2, "best": 4.5, "bad": 1, "changes": []}
    schedule = Schedule(DSQ_LADDER, patience=2)
    schedule.load_state_dict(state)
    assert schedule.level == 2 and schedule.policy.best == 4.5 and schedule.policy.bad == 1


@pytest.mark.parametrize(
    "q1, message",
    [
        ({"levels": DSQ_LADDER, "policy": "sawtooth"}, "unknown precision policy 'sawtooth'"),
        ({"levels": DSQ_LADDER, "policy": "cyclic", "patience": 2},
         "patience is a parameter of policy plateau, not cyclic; policy cyclic takes periods"),
        ({"levels": DSQ_LADDER, "policy": "pfq", "spin": 2}, "spin is no parameter"),
        ({"levels": DSQ_LADDER, "policy": "cyclic", "periods": 0},
         "periods of policy cyclic must be"),
        ({"levels": DSQ_LADDER, "policy": "cyclic", "periods": "many"}, "must be int, got 'many'"),
        ({"levels": DSQ_LADDER, "policy": "shape", "shape": "sine"}, "shape 'sine' is not one of"),
        ({"levels": DSQ_LADDER, "policy": "pfq", "turning_points": 5}, "between 0 and 4"),
        ({"levels": DSQ_LADDER, "policy": "pfq", "keep": 1}, "keep of policy pfq must be"),
    ],
)  # fmt: skip
def test_bad_policies_and_parameters_are_one_line_errors(q1, message):
    with pytest.raises(ValueError, match=message) as err:
        QuantConfig.from_dict({"q1": q1})
    assert "\n" not in str(err.value) and str(err.value).startswith("q1: ")


def test_more_periods_than_updates_is_refused_at_start():
    with pytest.raises(ValueError, match="32 periods do not fit in 20 updates"):
        Schedule(DSQ_LADDER, "cyclic").start(20, 0)


def test_a_one_format_point_never_moves_under_any_policy():
    for policy in ("plateau", "cyclic", "shape", "pfq"):
        assert set(bits_in_force(Schedule(["bfp6"], policy), 40)) == {6}


# -- where users meet them -----------------------------------------------------------------------
def test_train_help_and_conf_readme_name_every_policy_and_parameter():
    from typer.testing import CliRunner

    from dsq.engine.policies import parameter_names, policy_names
    from dsq_cli.cli import app
    from dsq_cli.presets import CONF_DIR

    help_text = " ".join(CliRunner().invoke(app, ["train", "--help"]).output.split())
    readme = (CONF_DIR / "README.md").read_text()
    for name in policy_names():
        assert name in help_text and f"`{name}`" in readme
        for key in parameter_names(name):
            assert key in help_text and f"`{key}`" in readme, (name, key)


def test_command_line_policy_overrides_compose_and_name_their_row():
    from dsq.presets import preset_differences
    from dsq_cli.config import ConfigError, compose

    def q1(*overrides):
        cfg = compose(["task=demo", "logger=none", *overrides])
        return {k: v for k, v in cfg.quant.q1.items()}, cfg

    ladder, cfg = q1("quant.q1.policy=cyclic", "quant.q1.periods=8")
    assert ladder == {"levels": DSQ_LADDER, "policy": "cyclic", "periods": 8}  # no patience
    quant = {"preset": "dsq", **{k: cfg.quant[k] for k in ("q0", "q1", "q2", "q3")}}
    assert preset_differences(quant) == ["q1.policy=cyclic", "q1.periods=8"]
    ladder, cfg = q1("quant.q1.policy=pfq")
    quant["q1"] = ladder
    assert preset_differences(quant) == ["q1.policy=pfq"]  # pfq at its source's defaults
    assert q1("quant.q1.patience=2")[0]["patience"] == 2  # the preset's own policy: as before
    with pytest.raises(ConfigError, match="quant.q1 is one format"):
        compose(["task=demo", "quant=bfp6", "quant.q1.policy=cyclic"])
