"""GEMM units for the MX formats and NVFP4 (docs/dsq.md, "GEMM units"; docs/formats.md, "MX
formats"): an MX value is an element of at most 7 significant bits times a power of two, a bf16
number wherever its magnitude is at least 2^-126, so MX operands run on bf16; but an E8M0 scale
reaches 2^-127, which puts elements below bf16's smallest subnormal (2^-133), and those GEMMs
must run in float32. NVFP4's values are products with a float32 tensor scale: no reduced unit
holds them."""

from __future__ import annotations

import pytest
import torch
from test_gemm_units import _edge_inputs, _is_number_of, needs_bf16

from dsq.engine import units
from dsq.formats import parse_format

MX_SPECS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8"]


@pytest.mark.parametrize("spec", MX_SPECS)
def test_mx_formats_claim_every_reduced_unit_and_nvfp4_none(spec):
    assert parse_format(spec).exact_in == frozenset({"bf16", "tf32", "bf16x2"})
    assert parse_format("nvfp4").exact_in == frozenset()
    device = torch.device("cpu")
    plan = units.plan(parse_format(spec), parse_format("nvfp4"), device, macs=units.MIN_MACS)
    assert plan == units.FP32


@pytest.mark.parametrize("spec", MX_SPECS)
@pytest.mark.parametrize("seed", [0, 1])
def test_mx_values_are_bf16_numbers_down_to_2_to_the_minus_126(spec, seed):
    y = parse_format(spec).quantize(_edge_inputs(seed), axis=-1)
    claimed = (y == 0) | (y.abs() >= 2.0**-126) | ~torch.isfinite(y)
    assert not (claimed & ~_is_number_of(y, "bf16")).any()


def tiny_block(spec: str) -> torch.Tensor:
    """A [256, 256] operand of MX values whose first block has a maximum of 2^-125 (the scale
    2^-127, or 2^-125 for INT8): its smallest elements lie below 2^-126 for every element type,
    and below bf16's smallest subnormal (2^-133) for the fp8 elements (steps of 2^-9 and 2^-16
    under the scale)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    x[0, :32] = torch.exp2(-125 - torch.arange(32) / 2)  # 2^-125 down to 2^-140.5
    return parse_format(spec).quantize(x, axis=-1)


@pytest.mark.parametrize("spec", MX_SPECS)
def test_an_e8m0_scale_puts_elements_below_bf16s_range(spec):
    q = tiny_block(spec)
    tiny = q[0, :32]
    assert bool(((tiny != 0) & (tiny.abs() < 2.0**-126)).any())
    if spec in ("mxfp8_e4m3", "mxfp8_e5m2"):  # the elements with steps below 2^-6
        below = (tiny != 0) & (tiny.abs() < 2.0**-133)
        assert bool(below.any()) and not bool(
            tiny[below].to(torch.bfloat16).float().eq(tiny[below]).all()
        )


@needs_bf16
@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_a_gemm_of_such_an_operand_runs_in_float32_and_equals_it(spec):
    """Planned on bf16 (both operands MX), the GEMM meets a value below 2^-63 at conversion and
    runs in float32: the float32 GEMM's result bit for bit, counted as fp32. Without the tiny
    block the same GEMM runs on bf16."""
    fmt = parse_format(spec)
    a = tiny_block(spec)
    b = parse_format("mxfp8_e4m3").quantize(torch.randn(256, 256), axis=0)
    plan = units.plan(fmt, parse_format("mxfp8_e4m3"), a.device, macs=units.MIN_MACS)
    assert plan == units.GemmPlan("bf16")
    before = units.tally().get("mx-test", {})
    out = units.gemm(a, b, plan, "mx-test")
    assert torch.equal(out, a @ b)
    ordinary = a.clone()
    ordinary[0, :32] = 0.5
    units.gemm(ordinary, b, plan, "mx-test")
    after = units.tally()["mx-test"]
    assert after.get("fp32", 0) == before.get("fp32", 0) + 1
    assert after.get("bf16", 0) == before.get("bf16", 0) + 1


@needs_bf16
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mx_dsq", "mxfp8"])
def test_every_bf16_gemm_of_an_mx_step_is_within_float32s_summation_bound(monkeypatch, preset):
    """A training step of an MX preset on ``auto`` runs its linear GEMMs on bf16, each within
    gamma_K * (|A| |B|) of the exact sums, the bound float32's own GEMM obeys. (The end-to-end
    comparison of tests/dsq/engine/test_gemm_units.py leaves the MX presets out: a block's E8M0
    scale jumps by a factor of two where a sum's last bit moves its maximum across a power of two,
    so a whole block downstream changes, beyond any summation-order tolerance of a whole
    step.)"""
    from test_gemm_units import U, demo_batch, demo_transformer, quantized_copy, train_step

    checked = []
    run = units._run_cpu

    def checked_run(a, b, how, bias, b_ready=None):
        out = run(a, b, how, bias, b_ready)
        if out is not None:
            exact = a.double() @ b.double() + (bias.double() if bias is not None else 0)
            k = a.shape[-1]
            bound = k * U / (1 - k * U) * (a.double().abs() @ b.double().abs())
            if bias is not None:
                bound = bound + U * exact.abs()
            assert ((out.double() - exact).abs() <= bound).all()
            checked.append(how.unit)
        return out

    monkeypatch.setattr(units, "_run_cpu", checked_run)
    train_step(quantized_copy(demo_transformer(), preset, "gemm", "auto"), demo_batch())
    assert checked and set(checked) == {"bf16"}
