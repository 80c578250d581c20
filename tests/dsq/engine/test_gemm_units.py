"""GEMM units (docs/dsq.md, "GEMM units"): each format states the compute dtypes that hold its
values exactly, the engine plans every GEMM from its two operands' formats, and a GEMM run on a
reduced unit gives the float32 GEMM's result up to the order of the float32 sums.

* the formats' claims, as properties: quantized values round-trip through every dtype claimed,
  over random inputs and edge exponents, and the next narrower dtype fails;
* what breaks exactness (values below 2^-63, values that are not numbers of the dtype, NaN
  payloads) is caught at conversion and the GEMM runs in float32, said once;
* the plan on a CPU with and without bf16 instructions, and on CUDA with its capability mocked;
* the oneDNN kernels against exact float64 results (integer-valued operands: bit for bit);
* float32, fixed32, fixed16 and bfp16 runs never touch a reduced unit (a spy on every GEMM);
* one training step on ``auto`` and on ``fp32`` gives the same loss, gradients and updated
  weights, for every preset and both stash scopes, to the tolerance stated below.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from helpers.preset_cells import PRESETS, accepted_cells

from dsq.engine import QuantConfig, dsq_linear, dsq_matmul, units
from dsq.formats import parse_format
from dsq.formats.base import COMPUTE_DTYPES
from dsq.integrations import quantize_model
from dsq.presets import get_preset
from dsq.warn_once import warn_once
from dsq_cli.presets import at_first_level, load_quant_preset

U = 2.0**-24  # float32's unit roundoff


def bf16_available() -> bool:
    from dsq.kernels import onednn

    return onednn.unavailable_reason() is None


needs_bf16 = pytest.mark.skipif(
    not bf16_available(), reason="this CPU has no bf16 GEMM (no AVX512-BF16 or no oneDNN)"
)


# -- the formats' claims ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("bfp2", {"bf16", "tf32", "bf16x2"}),
        ("bfp8", {"bf16", "tf32", "bf16x2"}),
        ("bfp9", {"bf16", "tf32", "bf16x2"}),  # 8 magnitude bits: the most bf16 holds
        ("bfp10", {"tf32", "bf16x2"}),
        ("bfp12", {"tf32", "bf16x2"}),  # 11 magnitude bits: the most TF32 holds
        ("bfp13", {"bf16x2"}),
        ("bfp16", {"bf16x2"}),
        ("bfp18", set()),
        ("fixed8", {"bf16", "tf32", "bf16x2"}),
        ("fixed16", {"bf16x2"}),
        ("fixed32", set()),
        ("fixed9f4", {"bf16", "tf32", "bf16x2"}),
        ("fixed16f8", {"bf16x2"}),
        ("bf16", {"bf16", "tf32", "bf16x2"}),
        ("e4m3", {"bf16", "tf32", "bf16x2"}),
        ("e5m2", {"bf16", "tf32", "bf16x2"}),
        ("fp16", {"tf32", "bf16x2"}),  # TF32 but not bf16
        ("fp32", set()),
    ],
)
def test_each_format_states_the_dtypes_that_hold_it(spec, expected):
    assert parse_format(spec).exact_in == frozenset(expected)


def _edge_inputs(seed: int) -> torch.Tensor:
    """[64, 64] float32: normal values scaled per row of 16 by 2^e, e from float32's whole range
    (edge exponents at both ends included), with zeros, signs and a few exact powers of two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g)
    exponents = torch.randint(-130, 126, (64, 4), generator=g).float()
    exponents[0], exponents[1] = -126.0, 126.0  # the ends of the normal range
    exponents[2] = -149.0  # subnormal blocks: outside every claim, masked below
    x = x * torch.exp2(exponents).repeat_interleave(16, dim=1)
    x[3, :8] = 0.0
    x[4, :16] = torch.tensor([2.0**k for k in range(-8, 8)])
    return x


def _is_number_of(y: torch.Tensor, dtype: str) -> torch.Tensor:
    """Elementwise: is y a number of ``dtype`` (COMPUTE_DTYPES)? bf16x2 asks whether y is an
    exact sum of two bf16 numbers (its bits past the top 16 form one)."""
    bits = y.view(torch.int32)
    if dtype == "bf16x2":
        hi = (bits & -65536).view(torch.float32)
        rest = (y - hi).view(torch.int32)
        return (rest & 0xFFFF) == 0
    drop = 24 - COMPUTE_DTYPES[dtype]  # float32 mantissa bits the dtype lacks
    return (bits & ((1 << drop) - 1)) == 0


CLAIM_SPECS = ["bfp2", "bfp4", "bfp8", "bfp9", "bfp10", "bfp12", "bfp13", "bfp16", "bfp17",
               "bfp8e6b32", "fixed8", "fixed9", "fixed16", "fixed8f4", "fixed12f3", "fixed16f8",
               "bf16", "fp16", "e4m3", "e5m2"]  # fmt: skip


@pytest.mark.parametrize("spec", CLAIM_SPECS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantized_values_are_numbers_of_every_dtype_claimed(spec, seed):
    """Every value of quantize(x) of magnitude 2^-126 or more (or zero, or not finite) is a number
    of each dtype the format claims; on the same inputs, the next narrower dtype fails: the claim
    is as wide as it may be."""
    fmt = parse_format(spec)
    y = fmt.quantize(_edge_inputs(seed), axis=-1)
    in_claim = (y == 0) | (y.abs() >= 2.0**-126) | ~torch.isfinite(y)
    for dtype in fmt.exact_in:
        # bf16x2's low part sits up to 15 binary places below the value: normal from 2^-111
        smallest = 2.0**-111 if dtype == "bf16x2" else 2.0**-126
        claimed = (y == 0) | (y.abs() >= smallest) | ~torch.isfinite(y)
        fails = claimed & ~_is_number_of(y, dtype)
        assert not fails.any(), f"{spec} in {dtype}: {y[fails][:4].tolist()}"
    unclaimed = [d for d in COMPUTE_DTYPES if d not in fmt.exact_in]
    if unclaimed and fmt.significant_bits <= 16:
        narrower = max(unclaimed, key=COMPUTE_DTYPES.get)
        assert (in_claim & ~_is_number_of(y, narrower)).any(), f"{spec} fits {narrower} too"


def test_below_bf16s_normal_range_a_bfp9_value_is_no_bf16_number():
    """The claim's named exception: a block whose exponent sits at the bottom of float32's range
    has elements below 2^-126, which bf16 cannot hold (bfp9 steps of 2^-134) or which the bf16
    dot-product instruction flushes to zero."""
    x = torch.tensor([2.0**-127 * (1 + 3 / 128), 2.0**-134 * 3, 0.0, 0.0] * 4)
    y = parse_format("bfp9").quantize(x)
    assert (y != 0).any() and not _is_number_of(y, "bf16").all()


# -- what breaks exactness is caught ------------------------------------------------------------
@needs_bf16
@pytest.mark.parametrize(
    "bad",
    [
        2.0**-64,  # nonzero below 2^-63: two of them would multiply below float32's normal range
        1.0 + 2.0**-10,  # not a bf16 number (a fixed16 value)
        float.fromhex("0x1.000002p+0"),
    ],
)
def test_a_value_the_bf16_unit_cannot_take_sends_the_gemm_to_float32(bad, caplog):
    a = torch.ones(256, 256)
    a[7, 9] = bad
    b = torch.full((256, 256), 0.5)
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsq.engine"):
        before = units.tally().get("test", {}).get("fp32", 0)
        out = units.gemm(a, b, units.GemmPlan("bf16"), "test")
        units.gemm(a, b, units.GemmPlan("bf16"), "test")
    assert torch.equal(out, a @ b)  # the float32 GEMM, exactly
    assert units.tally()["test"]["fp32"] == before + 2
    said = [r for r in caplog.records if "ran in float32" in r.getMessage()]
    assert len(said) == 1  # once, however often it happens


@needs_bf16
def test_the_conversion_takes_zeros_infinities_and_plain_nans_and_refuses_nan_payloads():
    from dsq.kernels import onednn

    ok = torch.tensor([[[0.0, -0.0, math.inf, -math.inf, math.nan, 1.5, 2.0**-63, -(2.0**100)]]])
    converted = onednn.to_bf16(ok, (1, 1, 8))
    assert converted is not None
    assert torch.equal(converted.float()[~ok.isnan()], ok[~ok.isnan()])
    payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32).reshape(1, 1, 1)
    assert onednn.to_bf16(payload, (1, 1, 1)) is None  # it would truncate to infinity


# -- the plan -----------------------------------------------------------------------------------
F = parse_format
CPU = torch.device("cpu")


def test_cpu_plan_with_bf16_instructions(monkeypatch):
    from dsq.formats import compute

    monkeypatch.setattr(units, "cpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(compute, "cpu_split_pays", lambda: False)  # a Zen 4, say
    assert units.plan(F("bfp8"), F("bfp8"), CPU) == units.GemmPlan("bf16")
    assert units.plan(F("bfp8"), F("bfp2"), CPU) == units.GemmPlan("bf16")
    assert units.plan(F("bf16"), F("e4m3"), CPU) == units.GemmPlan("bf16")
    assert units.plan(F("fixed16"), F("bfp2"), CPU) == units.FP32  # the split would not pay
    assert units.plan(F("fp16"), F("fp16"), CPU) == units.FP32  # no TF32 on a CPU
    assert units.plan(F("fp32"), F("bfp8"), CPU) == units.FP32
    assert units.plan(F("bfp8"), F("bfp8"), CPU, "fp32") == units.FP32
    assert units.plan(F("bfp8"), F("bfp8"), CPU, macs=units.MIN_MACS - 1) == units.FP32
    with pytest.raises(ValueError, match="gemm_unit must be one of"):
        units.plan(F("bfp8"), F("bfp8"), CPU, "bf16")


def test_a_cpu_whose_split_pays_runs_fixed16_by_bfp_gemms_as_two_bf16_gemms(monkeypatch):
    from dsq.formats import compute

    monkeypatch.setattr(units, "cpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(compute, "cpu_split_pays", lambda: True)
    assert units.plan(F("fixed16"), F("bfp2"), CPU) == units.GemmPlan("bf16x2", split="a")
    assert units.plan(F("bfp2"), F("fixed16"), CPU) == units.GemmPlan("bf16x2", split="b")
    assert units.plan(F("bfp8"), F("bfp8"), CPU) == units.GemmPlan("bf16")  # the narrower first
    assert units.plan(F("fixed16"), F("fixed16"), CPU) == units.FP32  # neither half is bf16
    assert units.plan(F("bfp16"), F("bfp16"), CPU) == units.FP32
    assert units.plan(F("fixed16"), F("bfp2"), CPU, "fp32") == units.FP32


@pytest.mark.parametrize(
    "cpuinfo, pays",
    [
        ("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel name\t: AMD EPYC\n", True),
        (
            "vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel name\t: AMD Ryzen AI 9 HX 370\n",
            False,
        ),  # a laptop Zen 5: AVX-512 at 256 bits
        ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC 9654\n", False),
        ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n", False),  # not measured
        ("processor\t: 0\n", False),  # says nothing of its family
    ],
)
def test_the_split_pays_on_the_cpus_it_was_measured_to_pay_on(monkeypatch, cpuinfo, pays):
    from dsq.kernels import cpu, onednn

    monkeypatch.setattr(cpu, "_cpu_lines", lambda: cpuinfo.splitlines())
    onednn.cpu_vendor_family_model.cache_clear()
    try:
        assert onednn.split_pays() is pays
    finally:
        onednn.cpu_vendor_family_model.cache_clear()


def test_a_cpu_without_bf16_instructions_takes_float32_and_says_so_once(monkeypatch, caplog):
    from dsq.kernels import onednn

    monkeypatch.setattr(onednn, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsq.engine"):
        plans = [units.plan(F("bfp8"), F("bfp8"), CPU) for _ in range(5)]
    assert plans == [units.FP32] * 5
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no bf16 dot-product instructions" in said[0], said


CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("bfp8", "bfp8", units.GemmPlan("bf16")),
        ("bfp12", "bfp12", units.GemmPlan("tf32")),
        ("fp16", "bfp8", units.GemmPlan("tf32")),
        ("fixed16", "bfp8", units.GemmPlan("bf16x2", split="a")),  # dsq's GEMM3: q3 x q1
        ("bfp2", "fixed16", units.GemmPlan("bf16x2", split="b")),  # a matmul's db: q1 x q3
        ("fixed16", "fixed16", units.FP32),
        ("bfp16", "bfp16", units.FP32),
        ("fp32", "bfp8", units.FP32),
        ("fixed32", "fixed32", units.FP32),
    ],
)
def test_cuda_plan_with_its_capability_mocked(monkeypatch, a, b, expected):
    monkeypatch.setattr(units, "cuda_capability", lambda device: (9, 0))
    assert units.plan(F(a), F(b), CUDA) == expected


def test_a_gpu_before_ampere_takes_float32_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(units, "cuda_capability", lambda device: (7, 5))
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsq.engine"):
        assert units.plan(F("bfp8"), F("bfp8"), CUDA) == units.FP32
    assert "compute capability 7.5" in caplog.records[0].getMessage()


def test_the_torch_split_is_exact_and_refuses_wider_values():
    """bf16x2's split (CUDA): hi + lo == x exactly, both bf16 numbers, for fixed16 values."""
    x = parse_format("fixed16").quantize(torch.randn(64, 64))
    hi, lo = units.split_bf16(x)
    assert torch.equal(hi + lo, x)
    assert _is_number_of(hi, "bf16").all() and _is_number_of(lo, "bf16").all()
    # 1 + 2^-8 + 2^-20: hi = 1, and the rest (13 significant bits) is no bf16 number
    assert units.split_bf16(torch.tensor([1.0 + 2.0**-8 + 2.0**-20])) is None


def test_tf32_is_allowed_inside_one_call_only_and_put_back_on_error():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with pytest.raises(RuntimeError, match="inside"), units._tf32_allowed():
        assert matmul.fp32_precision == "tf32"
        raise RuntimeError("inside")
    assert matmul.fp32_precision == before


# -- the oneDNN kernels ---------------------------------------------------------------------------
def _integers(*shape, seed=0, bound=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=g).float()


@needs_bf16
@pytest.mark.parametrize(
    "a_shape, b_shape, transpose_a, transpose_b",
    [
        ((2000, 256), (256, 1000), False, False),  # every side padded (2000 -> 2016, 1000 -> 1008)
        ((300, 257), (257, 70), True, False),  # a transposed view, odd sizes
        ((512, 64), (64, 512), False, True),
        ((3, 100, 96), (3, 96, 130), False, False),  # batched
        ((2, 4, 40, 64), (2, 4, 64, 40), False, True),  # two batch dimensions
    ],
)
def test_bf16_gemm_of_integers_is_exact(monkeypatch, a_shape, b_shape, transpose_a, transpose_b):
    """Integer operands below 2^8 are bf16 numbers and their sums stay below 2^24: the bf16 GEMM
    equals the float64 product, bit for bit, whatever the layout and padding."""
    a, b = _integers(*a_shape, seed=1), _integers(*b_shape, seed=2)
    if transpose_a:
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    if transpose_b:
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = units._run_cpu(a, b, units.GemmPlan("bf16"), None)
    assert out is not None and out.shape == torch.Size([*a_shape[:-1], b_shape[-1]])
    assert torch.equal(out, (a.double() @ b.double()).float())


@needs_bf16
def test_bf16_gemm_adds_its_bias_and_returns_no_view():
    a, b, bias = _integers(1000, 256), _integers(256, 300, seed=3), _integers(300, seed=4)
    out = units._run_cpu(a, b, units.GemmPlan("bf16"), bias)
    assert torch.equal(out, (a.double() @ b.double() + bias.double()).float())
    assert out._base is None and out.is_contiguous()  # a custom Function may return it


def _fixed16_like(*shape, seed=0):
    """Values of up to 16 significant bits (fixed16's), at exponents from 2^-40 to 2^20."""
    g = torch.Generator().manual_seed(seed)
    integers = torch.randint(-(2**15) + 1, 2**15, shape, generator=g).float()
    return integers * 2.0 ** torch.randint(-55, 5, shape, generator=g).float()


@needs_bf16
def test_the_c_split_is_exact_and_equals_the_torch_split():
    from dsq.kernels import onednn

    x = _fixed16_like(3, 40, 50, seed=1).transpose(1, 2)  # strided: read in its memory order
    parts = onednn.split_bf16(x, (4, 56, 48))  # every side padded
    assert parts is not None
    hi, lo = (part.float() for part in parts)
    assert torch.equal(hi[:3, :50, :40] + lo[:3, :50, :40], x)
    reference = units.split_bf16(x)
    assert torch.equal(hi[:3, :50, :40], reference[0]) and torch.equal(
        lo[:3, :50, :40], reference[1]
    )
    for part in (hi, lo):  # the padding adds nothing
        assert not part[3:].any() and not part[:, 50:].any() and not part[:, :, 40:].any()


@needs_bf16
@pytest.mark.parametrize(
    "bad",
    [
        1.0 + 2.0**-8 + 2.0**-20,  # 21 significant bits: the low part is no bf16 number
        2.0**-60 + 2.0**-70,  # its low part (2^-70) is below 2^-63
        math.inf,  # not finite: float32 takes the call
        math.nan,
    ],
)
def test_the_c_split_refuses_what_two_bf16_numbers_cannot_hold(bad):
    from dsq.kernels import onednn

    x = torch.ones(1, 4, 70)
    x[0, 2, 33] = bad
    assert onednn.split_bf16(x, (1, 4, 70)) is None


@needs_bf16
@pytest.mark.parametrize("split", ["a", "b"])
def test_the_split_gemm_of_integers_is_exact(split):
    """16-bit integers times -1, 0 and 1 over 250 terms: every sum is below 2^24, so the two
    bf16 GEMMs added equal the float64 product, bit for bit, with the bias added."""
    wide, narrow = _integers(300, 250, bound=2**15 - 1, seed=1), _integers(250, 70, bound=1)
    a, b = (wide, narrow) if split == "a" else (narrow.t().contiguous(), wide.t())
    bias = _integers(b.shape[1], seed=3)
    exact = a.double() @ b.double()
    out = units._run_cpu(a, b, units.GemmPlan("bf16x2", split=split), bias)
    assert out is not None and torch.equal(out, (exact + bias.double()).float())
    assert out._base is None and out.is_contiguous()


@needs_bf16
def test_the_split_gemm_stays_within_float32s_summation_bound():
    """dsq's dW shape in small: a fixed16 gradient by a bfp2 stash, within gamma_K (as the bf16
    GEMM's test below)."""
    g = parse_format("fixed16").quantize(torch.randn(256, 1024))
    x = parse_format("bfp2").quantize(torch.randn(1024, 128), axis=0)
    exact = g.double() @ x.double()
    k = g.shape[1]
    bound = k * U / (1 - k * U) * (g.double().abs() @ x.double().abs())
    out = units._run_cpu(g, x, units.GemmPlan("bf16x2", split="a"), None)
    assert out is not None and ((out.double() - exact).abs() <= bound).all()


@needs_bf16
def test_bf16_gemm_stays_within_float32s_summation_bound():
    """Random BFP operands: |C - C_exact| <= gamma_K * (|A| |B|) elementwise, gamma_K = K u /
    (1 - K u), the bound of any order of float32 sums of exact products; float32 itself obeys
    it, so the two units differ by at most twice that."""
    fmt = parse_format("bfp8")
    a, b = fmt.quantize(torch.randn(512, 1024)), fmt.quantize(torch.randn(1024, 256), axis=0)
    exact = a.double() @ b.double()
    k = a.shape[1]
    bound = k * U / (1 - k * U) * (a.double().abs() @ b.double().abs())
    for out in (units._run_cpu(a, b, units.GemmPlan("bf16"), None), a @ b):
        assert ((out.double() - exact).abs() <= bound).all()


# -- the engine: which GEMMs may use a reduced unit, and what a step gives on each ---------------
def demo_transformer(seed: int = 0):
    """The demo task's model shape (conf/model/transformer_small.yaml: 2+2 layers, 128 wide,
    FFN 512, 4 heads), on a vocabulary of 500."""
    import argparse
    import types

    fairseq = pytest.importorskip("fairseq")  # noqa: F841
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, base_architecture

    torch.manual_seed(seed)
    dictionary = Dictionary()
    for i in range(500 - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    args = argparse.Namespace(
        arch="transformer", encoder_layers=2, decoder_layers=2, encoder_embed_dim=128,
        decoder_embed_dim=128, encoder_ffn_embed_dim=512, decoder_ffn_embed_dim=512,
        encoder_attention_heads=4, decoder_attention_heads=4, dropout=0.1,
        share_all_embeddings=True,
    )  # fmt: skip
    base_architecture(args)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return TransformerModel.build_model(args, task)


def demo_batch(sentences: int = 16, length: int = 16):
    """256 tokens a side: the FFN's GEMMs (256 x 128 x 512, 2^24 multiply-adds) are just large
    enough for the bf16 unit (units.MIN_MACS)."""
    g = torch.Generator().manual_seed(5)
    src, prev, target = (torch.randint(4, 500, (sentences, length), generator=g) for _ in "abc")
    return src, torch.full((sentences,), length), prev, target


def train_step(model, batch, seed: int = 7):
    """One update (dropout seeded, SGD): the loss, the gradients and the updated parameters, the
    last two each as one flat vector. SGD's update is the gradient times the learning rate, so
    the weights carry the gradients' agreement; Adam's first update is about lr * sign(g) per
    element, which turns a gradient that is pure rounding noise (the key projection's bias,
    zero in exact arithmetic) into a full step either way."""
    src, lengths, prev, target = batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    logits, _ = model(src, lengths, prev)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    )
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    optimizer.step()
    return loss.item(), grads, torch.cat([p.detach().flatten() for p in model.parameters()])


def quantized_copy(model, preset: str, scope: str, gemm_unit: str):
    points = at_first_level(load_quant_preset(preset)) | {"stash_scope": scope}
    cfg = QuantConfig.from_dict(points | {"gemm_unit": gemm_unit})
    return quantize_model(copy.deepcopy(model), cfg, exclude=["decoder.output_projection"])


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["gemm", "all"])
@pytest.mark.parametrize("preset", ["fp32", "fixed32", "fixed16", "bfp16"])
def test_wide_presets_never_touch_a_reduced_unit(monkeypatch, preset, scope):
    """A spy on the reduced units' runners: float32, fixed32, fixed16 and bfp16 runs never call
    them, and every GEMM is counted as float32; bfp8, beside them, does call them (so the spy
    can see a call). Global settings stay as they were."""
    calls = []
    monkeypatch.setattr(units, "cpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(units, "_run_cpu", lambda *args: calls.append(args[2]) or None)
    monkeypatch.setattr(units, "_run_cuda", lambda *args: calls.append(args[2]) or None)
    precision = (
        torch.backends.mkldnn.matmul.fp32_precision,
        torch.backends.cuda.matmul.fp32_precision,
    )
    model, batch = demo_transformer(), demo_batch()
    before = units.tally()
    train_step(quantized_copy(model, preset, scope, "auto"), batch)
    ran = units.merge_tallies(units.tally(), units.negated(before))
    assert calls == []
    assert ran and all(set(counts) == {"fp32"} for counts in ran.values()), ran
    assert precision == (
        torch.backends.mkldnn.matmul.fp32_precision,
        torch.backends.cuda.matmul.fp32_precision,
    )
    train_step(quantized_copy(model, "bfp8", scope, "auto"), batch)
    assert calls and all(plan.unit == "bf16" for plan in calls)


def _exact_sums(monkeypatch):
    """Every float32 GEMM of the engine summed exactly (in float64) and rounded once: the result
    that every order of float32 sums approximates."""
    run = units.gemm

    def gemm(a, b, how, kind, bias=None):
        if how.unit != "fp32":
            return run(a, b, how, kind, bias)
        out = torch.matmul(a.double(), b.double())
        return (out + bias.double() if bias is not None else out).float()

    monkeypatch.setattr(units, "gemm", gemm)


# The MX presets are left out of the step comparison below: the sums of their GEMMs are inexact
# in float32 in any order (each block of 32 has its own power of two), and the next quantizer
# turns last-bit differences into whole steps (at its ties, and where a block's maximum crosses
# a power of two), so two valid summation orders give steps further apart than the distance
# from float32 to exact sums that the tolerance is measured by.
# tests/dsq/engine/test_mx_gemm_units.py checks each of their bf16 GEMMs in a step against
# float32's summation bound instead.
# An autocast preset (amp_bf16) patches nothing, and quantize_model refuses it: it has no
# quantized GEMM whose unit could differ.
STEP_PRESETS = [
    p for p in PRESETS
    if p not in ("mx_dsq", "mxfp8", "nvfp4_dsq") and get_preset(p).engine == "dsq"
]  # fmt: skip


@needs_bf16
@pytest.mark.slow
@pytest.mark.parametrize(("preset", "scope"), accepted_cells(STEP_PRESETS))
def test_a_training_step_on_auto_equals_one_on_fp32(monkeypatch, preset, scope):
    """The tolerance is float32's own summation order, measured on the same step: a step on
    ``auto`` may differ from one on ``fp32`` by at most twice what the fp32 step differs from one
    whose GEMMs sum exactly (a valid order of the same sums, with no rounding error at all). In
    one step those differences are not only the sums' last bits: a downstream quantizer turns a
    last-bit difference into a whole quantization step where a value sits on a rounding
    boundary, and both comparisons meet the same effect. Presets whose GEMMs all stay in
    float32 must agree exactly."""
    _assert_same_step_on_both_settings(monkeypatch, preset, scope)


@needs_bf16
@pytest.mark.slow
def test_a_dsq_step_with_its_dw_gemms_split_equals_one_on_fp32(monkeypatch):
    """As above with the split offered whatever this CPU (one whose bf16 GEMMs are slower does not
    offer it): dsq's GEMM3 (a fixed16 gradient by the bfp2 stash) runs as two bf16 GEMMs, within
    the same tolerance."""
    from dsq.formats import compute

    monkeypatch.setattr(compute, "cpu_split_pays", lambda: True)
    ran = _assert_same_step_on_both_settings(monkeypatch, "dsq", "gemm")
    assert ran["linear.dw"].get("bf16x2"), ran


def _assert_same_step_on_both_settings(monkeypatch, preset: str, scope: str) -> dict:
    """The comparison of `test_a_training_step_on_auto_equals_one_on_fp32`; returns the units
    the step on auto ran its GEMMs on."""
    model, batch = demo_transformer(), demo_batch()
    before = units.tally()
    auto = train_step(quantized_copy(model, preset, scope, "auto"), batch)
    ran = units.merge_tallies(units.tally(), units.negated(before))
    fp32 = train_step(quantized_copy(model, preset, scope, "fp32"), batch)
    with monkeypatch.context() as patched:
        _exact_sums(patched)
        exact = train_step(quantized_copy(model, preset, scope, "fp32"), batch)
    wide = all(not ({"bf16"} & parse_format(f).exact_in) for f in _formats(preset))
    for name, a, f, e in zip(("loss", "gradients", "weights"), auto, fp32, exact):
        a, f, e = (torch.as_tensor(t, dtype=torch.float64) for t in (a, f, e))
        if wide:
            assert torch.equal(a, f), name
            continue
        order = (f - e).norm().item()  # float32's summation-order effect on this step
        assert (a - f).norm().item() <= 2 * order + 1e-7 * f.norm().item(), name
    return ran


def _formats(preset: str) -> list[str]:
    """Every format a preset's points take, its schedules' levels included."""
    points = load_quant_preset(preset)
    found = []
    for point in ("q0", "q1", "q2", "q3"):
        value = points[point]
        found += value["levels"] if isinstance(value, dict) else [value]
    return found


@needs_bf16
def test_integer_valued_layers_are_bitwise_equal_on_both_settings():
    """A DSQ linear and an activation product in bf16 on integer data (all values and sums
    exact): forward and both gradients are bit for bit the same on auto and fp32, and auto ran
    them on the bf16 unit."""
    x, w, b = _integers(256, 256, seed=1), _integers(256, 256, seed=2), _integers(256, seed=3)
    dy = _integers(256, 256, seed=4)
    a, m, dz = (
        _integers(2, 256, 256, seed=5),
        _integers(2, 256, 256, seed=6),
        _integers(2, 256, 256, seed=7),
    )
    results = {}
    for setting in ("auto", "fp32"):
        cfg = QuantConfig("bf16", "bf16", "bf16", "bf16", gemm_unit=setting)
        leaves = [t.clone().requires_grad_() for t in (x, w, b, a, m)]
        before = units.tally()
        y = dsq_linear(leaves[0], leaves[1], leaves[2], cfg)
        z = dsq_matmul(leaves[3], leaves[4], cfg)
        torch.autograd.backward([y, z], [dy, dz])
        ran = units.merge_tallies(units.tally(), units.negated(before))
        results[setting] = (y, z, *(t.grad for t in leaves), ran)
    for auto, fp32 in zip(results["auto"][:-1], results["fp32"][:-1]):
        assert torch.equal(auto, fp32)
    assert all(set(c) == {"bf16"} for c in results["auto"][-1].values()), results["auto"][-1]
    assert all(set(c) == {"fp32"} for c in results["fp32"][-1].values())
