"""The cost model (docs/spec.md §4): hand-computed GEMMs, exact uniform ratios, monotonicity,
schedules."""

from __future__ import annotations

import collections
import dataclasses
import re
from fractions import Fraction

import pytest
import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.formats import parse_format
from dsq_cli.cost import (
    CostModel,
    baseline_points,
    derive_gemms,
    derive_records,
    gemm_costs,
    load_cost_model,
    ratios,
    scheduled_cost,
    step_cost,
)
from dsq_cli.cost.model import COST_DIR
from dsq_cli.presets import CONF_DIR, load_quant_preset

STASH_BFP = {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"}


def record(kind: str, batch: int, n: int, k: int, m: int, points: dict) -> GemmRecord:
    return GemmRecord(kind, batch, n, k, m, tuple(sorted(points.items())), stash_bytes=0)


def uniform(spec: str) -> dict:
    return dict.fromkeys(POINTS, spec)


# a small transformer step: four projections, two attention products, two FFN linears
STEP = [
    *(record("linear", 1, 40, 64, 64, uniform("fp32")) for _ in range(4)),
    record("matmul", 8, 10, 8, 10, uniform("fp32")),  # Q K^T per head
    record("matmul", 8, 10, 10, 8, uniform("fp32")),  # P V per head
    record("linear", 1, 40, 64, 256, uniform("fp32")),
    record("linear", 1, 40, 256, 64, uniform("fp32")),
]


def test_linear_three_gemms_by_hand():
    # x [32, 64], W [48, 64], y = g [32, 48]: 2048, 3072 and 1536 elements
    # bits per value: bfp8 = 8 + 8/16 = 8.5, bfp4 = 4.5, fixed16 = 16
    rec = record("linear", 1, 32, 64, 48, STASH_BFP)
    forward, grad_x, grad_w = gemm_costs(rec)
    assert [g.name for g in (forward, grad_x, grad_w)] == ["forward", "grad_x", "grad_w"]
    assert forward.macs == grad_x.macs == grad_w.macs == 32 * 64 * 48 == 98304
    # c(bfp8, bfp8) = 8*8/1024; c(fixed16, bfp4) = 16*4/1024: all three are 98304/16 = 6144
    assert forward.arith == grad_x.arith == grad_w.arith == 6144
    assert forward.operands == ("bfp8e8b16", "bfp8e8b16")
    assert grad_w.operands == ("fixed16", "bfp4e8b16")
    # forward: read x, W and write y at 8.5, write the stash at 4.5
    assert forward.dram_bits == (2048 + 3072 + 1536) * 8.5 + 2048 * 4.5 == 65792
    # grad_x: read g at 16, read W at 8.5 (q2), write dx at 16
    assert grad_x.dram_bits == 1536 * 16 + 3072 * 8.5 + 2048 * 16 == 83456
    # grad_w: read g at 16, read the stash at 4.5, write dW at 16
    assert grad_w.dram_bits == 1536 * 16 + 2048 * 4.5 + 3072 * 16 == 82944
    # against fixed32 (c = 1 per MAC, 32 bits per value everywhere, no stash write)
    fixed32_dram = 32 * ((2048 + 3072 + 1536) + (1536 + 3072 + 2048) + (1536 + 2048 + 3072))
    assert ratios([rec]) == (3 * 6144 / (3 * 98304), (65792 + 83456 + 82944) / fixed32_dram)
    assert ratios([rec])[0] == 1 / 16


def test_matmul_three_gemms_by_hand():
    # a [2, 4, 8], b [2, 8, 16], z = g [2, 4, 16]: 64, 256 and 128 elements, 1024 MACs
    rec = record("matmul", 2, 4, 8, 16, STASH_BFP)
    forward, grad_a, grad_b = gemm_costs(rec)
    assert [g.name for g in (forward, grad_a, grad_b)] == ["forward", "grad_a", "grad_b"]
    assert forward.macs == 1024
    assert forward.arith == 1024 * 8 * 8 / 1024 == 64  # q0 x q0
    assert grad_a.arith == 1024 * 8 * 4 / 1024 == 32  # q2(g) x stash_b (q1)
    assert grad_b.arith == 1024 * 4 * 16 / 1024 == 64  # stash_a (q1) x g (q3)
    # forward: read a, b and write z at 8.5; both operands stashed at 4.5
    assert forward.dram_bits == (64 + 256 + 128) * 8.5 + (64 + 256) * 4.5 == 5248
    # grad_a: read g (16) and stash_b (4.5), write da (16)
    assert grad_a.dram_bits == 128 * 16 + 256 * 4.5 + 64 * 16 == 4224
    # grad_b: read g (16) and stash_a (4.5), write db (16)
    assert grad_b.dram_bits == 128 * 16 + 64 * 4.5 + 256 * 16 == 6432


@pytest.mark.parametrize("width", [2, 3, 4, 6, 8, 12, 16, 24, 31, 32])
def test_uniform_fixed_is_exact_against_fixed32(width):
    points = uniform(f"fixed{width}")
    assert ratios(STEP, points) == ((width / 32) ** 2, width / 32)
    for rec in (STEP[0], STEP[4]):  # a linear and a matmul alone
        assert ratios([rec], points, "fixed32") == ((width / 32) ** 2, width / 32)
    # and in exact arithmetic, not only after rounding to floats
    cost, base = step_cost(STEP, points), step_cost(STEP, uniform("fixed32"))
    assert cost.arith / base.arith == Fraction(width, 32) ** 2
    assert cost.dram_bits / base.dram_bits == Fraction(width, 32)


def test_additive_model_uniform_and_by_hand():
    additive = load_cost_model("additive")
    assert ratios(STEP, uniform("fixed8"), model=additive) == (0.25, 0.25)
    rec = record("linear", 1, 32, 64, 48, STASH_BFP)
    forward, grad_x, grad_w = gemm_costs(rec, model=additive)
    assert forward.arith == grad_x.arith == 98304 * Fraction(8 + 8, 64) == 24576
    assert grad_w.arith == 98304 * Fraction(16 + 4, 64) == 30720
    assert forward.dram_bits == 65792  # the DRAM rule does not depend on the arithmetic model


def test_baseline_against_itself_and_fp32():
    assert ratios(STEP, uniform("fixed32")) == (1.0, 1.0)
    assert ratios(STEP, baseline_points("fixed16"), "fixed16") == (1.0, 1.0)
    assert ratios(STEP, baseline_points("fp32")) == (1.0, 1.0)  # fp32 priced as fixed32


def test_record_formats_are_used_and_points_override_them():
    recorded = [dataclasses.replace(r, formats=tuple(sorted(STASH_BFP.items()))) for r in STEP]
    assert ratios(recorded) == ratios(STEP, STASH_BFP)
    # a partial override keeps the record's other points
    assert ratios(recorded, {"q1": "bfp2"}) == ratios(STEP, {**STASH_BFP, "q1": "bfp2"})
    assert ratios(recorded, {"q1": "bfp2"}) != ratios(recorded)


def test_q1_equal_to_q0_writes_no_stash():
    # x 2048, W 3072, y 1536 elements
    same = gemm_costs(record("linear", 1, 32, 64, 48, uniform("bfp8")))[0]
    spelled = gemm_costs(record("linear", 1, 32, 64, 48, {**uniform("bfp8"), "q1": "BFP8e8b16"}))
    assert same.dram_bits == spelled[0].dram_bits == (2048 + 3072 + 1536) * 8.5 == 56576
    # the model switch puts the write back: + 2048 * 8.5
    data = yaml.safe_load((COST_DIR / "default.yaml").read_text())
    data["dram"]["stash_write_when_q1_equals_q0"] = True
    writes = CostModel.from_dict(data)
    rec = record("linear", 1, 32, 64, 48, uniform("bfp8"))
    assert gemm_costs(rec, model=writes)[0].dram_bits == 56576 + 2048 * 8.5
    # matmul: both stashes left out (a 64, b 256, z 128 elements)
    mm = gemm_costs(record("matmul", 2, 4, 8, 16, uniform("bfp8")))[0]
    assert mm.dram_bits == (64 + 256 + 128) * 8.5


def test_unflushed_activation_grads():
    data = yaml.safe_load((COST_DIR / "default.yaml").read_text())
    data["dram"]["flush_activation_grads"] = False
    fused = CostModel.from_dict(data)
    rec = record("linear", 1, 32, 64, 48, STASH_BFP)
    assert gemm_costs(rec, model=fused)[1].dram_bits == 83456 - 2048 * 16  # no dx write
    assert gemm_costs(rec, model=fused)[2].dram_bits == 82944  # dW is always written


def test_breaking_q1_equals_q0_adds_the_stash_write():
    # docs/spec.md §4's rule is discontinuous: narrowing q1 just below q0 adds a stash write
    # (12 bits) that saves only 4 bits on the stash read, so DRAM rises (documented in
    # docs/cost-model.md)
    rec = record("linear", 1, 32, 64, 48, uniform("fixed16"))
    base = sum(g.dram_bits for g in gemm_costs(rec))
    narrowed = sum(g.dram_bits for g in gemm_costs(rec, {"q1": "fixed12"}))
    assert narrowed - base == 2048 * 12 - 2048 * 4


SPECS = [
    *(f"fixed{w}" for w in (2, 4, 8, 12, 16, 24, 32)),
    *(f"bfp{m}" for m in (2, 3, 4, 6, 8, 16)),
    "fixed8f4",
    "fixed16f8",
    "bfp4e8b64",
    "fp32",
    "fp16",
    "bf16",
    "e4m3",
    "e5m2",
]


def narrower(low: str, high: str) -> bool:
    """``low`` is at most as wide as ``high`` for the multiplier and in DRAM."""
    model = load_cost_model()
    fl, fh = parse_format(low), parse_format(high)
    return model.width(fl) <= model.width(fh) and fl.bits_per_value <= fh.bits_per_value


@settings(max_examples=300, deadline=None)
@given(
    config=st.fixed_dictionaries({p: st.sampled_from(SPECS) for p in POINTS}),
    point=st.sampled_from(POINTS),
    lower=st.sampled_from(SPECS),
    model_name=st.sampled_from(["default", "additive", "elementwise_fp32"]),
)
@example(config=STASH_BFP, point="q1", lower="bfp2", model_name="default")
@example(config=uniform("fixed16"), point="q3", lower="fixed8", model_name="default")
def test_lowering_one_point_never_raises_cost(config, point, lower, model_name):
    assume(narrower(lower, config[point]))
    model = load_cost_model(model_name)
    lowered = {**config, point: lower}
    before, after = step_cost(STEP, config, model=model), step_cost(STEP, lowered, model=model)
    assert after.arith <= before.arith
    stash_now_written = (
        config["q1"] == config["q0"]
        and lowered["q1"] != lowered["q0"]
        and not model.activations_fp32
    )
    if not stash_now_written:  # the one exception (see the test above)
        assert after.dram_bits <= before.dram_bits


@pytest.mark.parametrize("model_name", ["default", "additive", "elementwise_fp32"])
@pytest.mark.parametrize("float_spec", ["fp32", "fp16", "bf16", "e4m3", "e5m2"])
def test_floats_never_cheaper_than_fixed_of_the_same_width(float_spec, model_name):
    model = load_cost_model(model_name)
    fixed = parse_format(f"fixed{int(parse_format(float_spec).bits_per_value)}")
    for partner in map(parse_format, SPECS):
        assert model.per_mac(parse_format(float_spec), partner) >= model.per_mac(fixed, partner)
    float_arith, float_dram = ratios(STEP, uniform(float_spec), model=model)
    fixed_arith, fixed_dram = ratios(STEP, uniform(fixed.spec), model=model)
    assert float_arith >= fixed_arith and float_dram >= fixed_dram


def test_a_float_width_below_storage_is_refused():
    data = yaml.safe_load((COST_DIR / "default.yaml").read_text())
    data["float_widths"]["fp16"] = 11  # the significand width alone
    with pytest.raises(ValueError, match="fp16 cheaper than fixed16"):
        CostModel.from_dict(data)


def test_scheduled_cost_is_the_update_weighted_mean():
    # 1 update at fixed8 (1/16, 1/4) and 3 at fixed16 (1/4, 1/2)
    segments = [(uniform("fixed8"), 1), (uniform("fixed16"), 3)]
    assert scheduled_cost(STEP, segments, "fixed32") == {
        "arith_ratio": (1 / 16 + 3 / 4) / 4,
        "dram_ratio": (1 / 4 + 3 / 2) / 4,
        "baseline": "fixed32",
    }
    # the dsq preset's stash schedule, two levels used
    bfp2, bfp4 = {**STASH_BFP, "q1": "bfp2"}, STASH_BFP
    cost = scheduled_cost(STEP, [(bfp2, 100), (bfp4, 300)])
    (a2, d2), (a4, d4) = ratios(STEP, bfp2), ratios(STEP, bfp4)
    assert cost["arith_ratio"] == pytest.approx((100 * a2 + 300 * a4) / 400, rel=1e-15)
    assert cost["dram_ratio"] == pytest.approx((100 * d2 + 300 * d4) / 400, rel=1e-15)
    assert d2 < cost["dram_ratio"] < d4
    # a level used for no updates does not count; with no updates at all, the first segment
    assert scheduled_cost(STEP, [(bfp2, 0), (bfp4, 5)])["dram_ratio"] == d4
    assert scheduled_cost(STEP, [(bfp2, 0), (bfp4, 0)])["dram_ratio"] == d2


def test_baseline_points_takes_a_schedules_first_level():
    assert baseline_points() == uniform("fixed32")
    assert baseline_points("dsq") == {"q0": "bfp8", "q1": "bfp2", "q2": "bfp8", "q3": "fixed16"}


def test_step_cost_breaks_down_by_kind():
    total = step_cost(STEP, STASH_BFP)
    linear, matmul = total.by_kind["linear"], total.by_kind["matmul"]
    assert linear.macs == 3 * (4 * 40 * 64 * 64 + 2 * 40 * 64 * 256)
    assert matmul.macs == 3 * (8 * 10 * 8 * 10 + 8 * 10 * 10 * 8)
    assert total.macs == linear.macs + matmul.macs
    assert total.arith == linear.arith + matmul.arith
    assert total.dram_bits == linear.dram_bits + matmul.dram_bits
    assert total.as_dict()["by_kind"]["matmul"]["macs"] == matmul.macs


def test_unknown_names_are_errors_listing_the_choices():
    with pytest.raises(ValueError, match=r"unknown cost model 'nope'.*'additive'.*'default'"):
        load_cost_model("nope")
    with pytest.raises(ValueError, match=r"unknown quant preset 'nope'.*'fixed32'"):
        baseline_points("nope")
    with pytest.raises(ValueError, match=r"unknown quant preset"):
        ratios(STEP, STASH_BFP, "nope")
    with pytest.raises(ValueError, match="no GEMMs"):
        ratios([], STASH_BFP)
    with pytest.raises(ValueError, match="a schedule"):
        ratios(STEP, {**STASH_BFP, "q1": {"levels": ["bfp2", "bfp4"]}})


def test_every_coefficient_has_a_comment_beside_it():
    for path in COST_DIR.glob("*.yaml"):
        for line in path.read_text().splitlines():
            if re.match(r"\s*[\w]+:\s*[^\s#]", line):  # a key with a value on its line
                assert "#" in line, f"{path.name}: {line!r} has no justification comment"


def test_activations_in_fp32_by_hand():
    # x [32, 64] 2048, W [48, 64] 3072, y = g [32, 48] 1536 elements; stash_bfp's points
    fp32_acts = load_cost_model("elementwise_fp32")
    rec = record("linear", 1, 32, 64, 48, STASH_BFP)
    forward, grad_x, grad_w = gemm_costs(rec, model=fp32_acts)
    assert forward.arith == grad_x.arith == grad_w.arith == 6144  # arithmetic as in default
    # forward: read x and write y at 32, read W at 8.5 (q0), write the stash at 4.5
    assert forward.dram_bits == (2048 + 1536) * 32 + 3072 * 8.5 + 2048 * 4.5
    # grad_x: read g at 32, W at 8.5 (q2), write dx at 32
    assert grad_x.dram_bits == 1536 * 32 + 3072 * 8.5 + 2048 * 32
    # grad_w: read g at 32 and the stash at 4.5, write dW at 16 (q3)
    assert grad_w.dram_bits == 1536 * 32 + 2048 * 4.5 + 3072 * 16
    # with no q0 copy of x in DRAM, q1 == q0 still writes the stash: no exception to monotony
    same = gemm_costs(record("linear", 1, 32, 64, 48, uniform("bfp8")), model=fp32_acts)[0]
    assert same.dram_bits == (2048 + 1536) * 32 + 3072 * 8.5 + 2048 * 8.5
    # a matmul: a [2, 4, 8] 64, b [2, 8, 16] 256, z [2, 4, 16] 128 elements
    mm = gemm_costs(record("matmul", 2, 4, 8, 16, STASH_BFP), model=fp32_acts)
    assert [g.dram_bits for g in mm] == [
        (64 + 256 + 128) * 32 + (64 + 256) * 4.5,
        128 * 32 + 256 * 4.5 + 64 * 32,
        128 * 32 + 64 * 4.5 + 256 * 32,
    ]


def test_a_dram_switch_must_be_a_boolean():
    data = yaml.safe_load((COST_DIR / "default.yaml").read_text())
    data["dram"]["activations_fp32"] = "yes"
    with pytest.raises(ValueError, match="dram.activations_fp32 must be true or false"):
        CostModel.from_dict(data)
    del data["dram"]["activations_fp32"]
    with pytest.raises(ValueError, match=r"missing \['activations_fp32'\]"):
        CostModel.from_dict(data)


# ------------------------------------------------------------ a step derived from the config
IWSLT = yaml.safe_load((CONF_DIR / "model" / "transformer_iwslt.yaml").read_text())
DSQ = load_quant_preset("dsq")


def test_one_derived_linear_worked_by_hand():
    """docs/cost-model.md's worked example: encoder.layers.0.fc1 of transformer_iwslt, 128
    sentences of 32 tokens, dsq at its first level (q0 bfp8, q1 bfp2, q2 bfp8, q3 fixed16)."""
    sites = {g.site: g.record for g in derive_gemms(IWSLT, 4096, 32, vocab=10000, quant=DSQ)}
    fc1 = sites["encoder.layers.0.fc1"]
    assert (fc1.kind, fc1.batch, fc1.n, fc1.k, fc1.m) == ("linear", 1, 4096, 512, 1024)
    assert dict(fc1.formats) == {
        "q0": "bfp8e8b16",
        "q1": "bfp2e8b16",
        "q2": "bfp8e8b16",
        "q3": "fixed16",
    }
    x, w, y = 4096 * 512, 1024 * 512, 4096 * 1024  # elements of x (= dx), W (= dW), y (= g)
    assert (x, w, y) == (2_097_152, 524_288, 4_194_304)
    forward, grad_x, grad_w = gemm_costs(fc1)
    assert forward.macs == 4096 * 512 * 1024 == 2_147_483_648
    assert forward.arith == grad_x.arith == 2_147_483_648 * 8 * 8 / 1024 == 134_217_728
    assert grad_w.arith == 2_147_483_648 * 16 * 2 / 1024 == 67_108_864
    # bits per value: bfp8 8.5, bfp2 2.5, fixed16 16
    assert forward.dram_bits == (x + w + y) * 8.5 + x * 2.5 == 63_176_704
    assert grad_x.dram_bits == y * 16 + w * 8.5 + x * 16 == 105_119_744
    assert grad_w.dram_bits == y * 16 + x * 2.5 + w * 16 == 80_740_352
    fixed32_dram = 3 * (x + w + y) * 32  # each GEMM moves x, W and y once; no stash write
    assert fixed32_dram == 654_311_424
    arith, dram = ratios([fc1])
    assert arith == (64 + 64 + 32) / (3 * 1024) == 5 / 96
    assert dram == (63_176_704 + 105_119_744 + 80_740_352) / 654_311_424 == 475 / 1248


def test_derived_transformer_iwslt_step_by_hand():
    # 2 source sentences of 32 tokens, targets of 20, 4 heads of 128
    gemms = derive_gemms(IWSLT, 64, 32, 20, vocab=10000)
    shapes = collections.Counter(
        (g.record.kind, g.record.batch, g.record.n, g.record.k, g.record.m) for g in gemms
    )
    assert shapes == collections.Counter(
        {
            ("linear", 1, 64, 512, 512): 6 * 4 + 6 * 2,  # encoder q/k/v/out; cross k, v
            ("linear", 1, 64, 512, 1024): 6,  # encoder fc1
            ("linear", 1, 64, 1024, 512): 6,  # encoder fc2
            ("matmul", 8, 32, 128, 32): 6,  # encoder Q K^T
            ("matmul", 8, 32, 32, 128): 6,  # encoder P V
            ("linear", 1, 40, 512, 512): 6 * 4 + 6 * 2,  # decoder q/k/v/out; cross q, out
            ("linear", 1, 40, 512, 1024): 6,
            ("linear", 1, 40, 1024, 512): 6,
            ("matmul", 8, 20, 128, 20): 6,  # decoder self-attention Q K^T
            ("matmul", 8, 20, 20, 128): 6,  # and P V
            ("matmul", 8, 20, 128, 32): 6,  # encoder-decoder attention Q K^T
            ("matmul", 8, 20, 32, 128): 6,  # and P V
            ("linear", 1, 40, 512, 10000): 1,  # the output projection
        }
    )
    assert all(dict(g.record.formats) == uniform("fp32") for g in gemms)  # no quant: fp32
    sites = [g.site for g in gemms]
    assert (
        "decoder.layers.5.encoder_attn.k_proj" in sites and sites[-1] == "decoder.output_projection"
    )
    kept = derive_records(
        IWSLT, 64, 32, 20, vocab=10000, exclude=["decoder.output_projection", "*.encoder_attn"]
    )
    assert len(kept) == len(gemms) - 1 - 2 * 6  # the projections of encoder_attn stay patched


def test_derived_records_first_levels_and_whole_sentences():
    records = derive_records(IWSLT, 4100, 32, quant=DSQ)
    assert {dict(r.formats)["q1"] for r in records} == {"bfp2e8b16"}
    assert max(r.n for r in records if r.kind == "linear") == 4096  # 128 whole sentences
    assert {r.batch for r in records if r.kind == "matmul"} == {128 * 4}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_ffn_embed_dim": None}, "lacks \\['decoder_ffn_embed_dim'\\]"),
        ({"encoder_attention_heads": 3}, "not divisible by model.encoder_attention_heads 3"),
        ({"decoder_layers": 0}, "model.decoder_layers must be a positive integer"),
    ],
)
def test_derive_refuses_a_bad_model_config(change, message):
    cfg = {k: v for k, v in {**IWSLT, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        derive_records(cfg, 4096, 32)


@pytest.mark.parametrize(
    "args, message",
    [
        ((16, 32), "at least one sentence"),
        ((4096, 0), "src_len must be a positive integer"),
        ((4096, 32, 0), "tgt_len must be a positive integer"),
        ((4096, 32, None, 0), "vocab must be a positive integer"),
    ],
)
def test_derive_refuses_a_bad_batch(args, message):
    with pytest.raises(ValueError, match=message):
        derive_records(IWSLT, *args)
