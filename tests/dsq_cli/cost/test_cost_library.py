"""The cost model's split (docs/architecture.md): the library's ``dsq.cost`` prices GEMM records
with built-in default coefficients and baselines given as points; the suite's ``dsq_cli.cost``
reads conf/cost/*.yaml and names baselines by conf/quant preset, on the same functions."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

import dsq
import dsq.cost
import dsq_cli.cost
from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.presets import COST_BASELINE
from dsq_cli.cost import load_cost_model
from dsq_cli.cost.model import COST_DIR

STASH_BFP = {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"}
STEP = [
    GemmRecord("linear", 1, 40, 64, 64, tuple(sorted(STASH_BFP.items())), stash_bytes=0),
    GemmRecord("matmul", 8, 10, 8, 10, tuple(sorted(STASH_BFP.items())), stash_bytes=0),
    GemmRecord("linear", 1, 40, 64, 256, tuple(sorted(STASH_BFP.items())), stash_bytes=0),
]


def test_the_built_in_default_is_conf_cost_default_yaml():
    # the library's coefficients and the suite's file cannot drift apart
    as_the_suite_loads_it = load_cost_model("default")
    assert dsq.cost.DEFAULT_MODEL == as_the_suite_loads_it
    assert type(as_the_suite_loads_it) is dsq.cost.CostModel
    on_disk = yaml.safe_load((COST_DIR / "default.yaml").read_text())
    assert dsq.cost.DEFAULT_MODEL.to_dict() == on_disk
    assert {k: dict(v) for k, v in dsq.cost.DEFAULT_COEFFICIENTS.items()} == on_disk
    assert dsq_cli.cost.load_cost_model() == dsq.cost.DEFAULT_MODEL


def test_the_default_baseline_is_the_baseline_preset():
    assert dsq.cost.FIXED32 == dsq_cli.cost.baseline_points(COST_BASELINE)


@pytest.mark.parametrize("name", sorted(p.stem for p in COST_DIR.glob("*.yaml")))
def test_every_conf_model_round_trips_through_the_library(name):
    model = load_cost_model(name)
    assert model.to_dict() == yaml.safe_load((COST_DIR / f"{name}.yaml").read_text())
    assert dsq.cost.CostModel.from_dict(model.to_dict(), name=name) == model


def test_the_suite_prices_with_the_librarys_functions():
    for name in ("CostModel", "gemm_costs", "step_cost", "GemmCost", "CostTotals", "StepCost"):
        assert getattr(dsq_cli.cost, name) is getattr(dsq.cost, name)
    # a model read from conf/ equals the same coefficients given to the library
    additive = load_cost_model("additive")
    assert dsq_cli.cost.CostModel.from_dict(additive.to_dict(), name="additive") == additive
    # and prices differently from the default (the model argument is used)
    assert any(
        dsq.cost.gemm_costs(record) != dsq.cost.gemm_costs(record, model=additive)
        for record in STEP
    )


def test_a_baseline_is_points_in_the_library_and_a_preset_name_in_the_suite():
    fixed16 = dsq_cli.cost.baseline_points("fixed16")
    assert dsq.cost.ratios(STEP, baseline=fixed16) == dsq_cli.cost.ratios(STEP, None, "fixed16")
    assert dsq.cost.ratios(STEP) == dsq_cli.cost.ratios(STEP)  # fixed32 by default in both
    additive = load_cost_model("additive")
    assert dsq.cost.ratios(STEP, dict.fromkeys(POINTS, "fixed8"), model=additive) == (0.25, 0.25)
    segments = [(STASH_BFP, 3), ({**STASH_BFP, "q1": "bfp2"}, 1)]
    library = dsq.cost.scheduled_cost(STEP, segments, fixed16)
    suite = dsq_cli.cost.scheduled_cost(STEP, segments, "fixed16")
    assert library == {**suite, "baseline": fixed16}
    assert suite["baseline"] == "fixed16"
    with pytest.raises(ValueError, match="no GEMMs"):
        dsq.cost.ratios([], STASH_BFP)


def test_from_dict_checks_keys_in_the_library():
    data = dsq.cost.DEFAULT_MODEL.to_dict()
    data["dram"]["spare"] = True
    with pytest.raises(ValueError, match=r"dram: expected keys .* unknown \['spare'\]"):
        dsq.cost.CostModel.from_dict(data)
    with pytest.raises(dataclasses.FrozenInstanceError):  # the default cannot be changed
        dsq.cost.DEFAULT_MODEL.scale = 1  # type: ignore[misc]


def test_the_library_api_names_the_cost_model():
    assert dsq.cost is dsq.__getattr__("cost")
    assert dsq.CostModel is dsq.cost.CostModel
    assert "cost" in dsq.__all__ and "CostModel" in dsq.__all__


@pytest.mark.parametrize(
    "spec, width, bits",
    [("mxfp8_e4m3", 8, "33/4"), ("mxfp8_e5m2", 8, "33/4"), ("mxfp6_e3m2", 6, "25/4"),
     ("mxfp4_e2m1", 4, "17/4"), ("mxint8", 8, "33/4"), ("mxfp4_e2m1b16", 4, "9/2"),
     ("nvfp4", 4, "9/2")],
)  # fmt: skip
def test_mx_and_nvfp4_are_priced_by_element_and_scale_bits(spec, width, bits):
    """The format says its cost width (the element's bits: the scales are added once per block,
    like BFP's exponents) and its storage (the element's bits plus the scale's per value); a
    uniform config then costs (w/32)^2 and bits/32 of fixed32."""
    from fractions import Fraction

    from dsq.formats import parse_format

    fmt = parse_format(spec)
    assert dsq.cost.DEFAULT_MODEL.width(fmt) == fmt.cost_width == width
    assert dsq.cost.bits_per_value(fmt) == Fraction(bits)
    arith, dram = dsq.cost.ratios(STEP, dict.fromkeys(POINTS, spec))
    assert arith == pytest.approx(float(Fraction(width, 32) ** 2), rel=1e-12)
    assert dram == pytest.approx(float(Fraction(bits) / 32), rel=1e-12)


def test_a_cost_model_may_price_any_format_and_leaves_out_the_rest():
    """float_widths overrides the widths of the formats it lists (a floating format need not be
    listed); one it leaves out is priced at the format's own cost width."""
    from dsq.formats import parse_format

    data = load_cost_model("default").to_dict()
    data["float_widths"] = {"FP16": 20, "mxfp8_e4m3": 9}
    model = dsq.cost.CostModel.from_dict(data)
    assert model.width(parse_format("fp16")) == 20 and model.width(parse_format("bf16")) == 16
    assert model.width(parse_format("mxfp8_e4m3")) == 9
    with pytest.raises(ValueError, match="mxfp4_e2m1 cheaper than fixed4"):
        dsq.cost.CostModel.from_dict({**data, "float_widths": {"mxfp4_e2m1": 3}})
