"""The MX formats and NVFP4 (docs/formats.md, "MX formats", "NVFP4"), as properties:

* the reference equals an exact oracle in Fraction arithmetic (tests/helpers/exact_formats.py)
  on random, tied, subnormal, saturating, zero and NaN/Inf inputs, on the backend the
  environment chooses (``DSQ_BACKEND=c|compile|reference|triton`` runs this file on that one);
* every backend equals the reference bit for bit: quantize, the packed bytes, unpack;
* ``pack`` holds exactly the bits per value the docs give;
* torchao, where installed (make setup: .venv/oracles), agrees bit for bit on a million random
  values, and where the two definitions differ the difference is named and checked on its own input.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from helpers import exact_formats
from helpers.tensors import assert_bitwise_equal

from dsq.formats import parse_format
from dsq.formats.backends import unavailable_reason

MX_SPECS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8"]
SPECS = [*MX_SPECS, "nvfp4"]
CASES = ["random", "tied", "subnormal", "saturating", "zero", "nonfinite"]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def backend_param(name: str):
    device = TRITON_DEVICE if name == "triton" else "cpu"
    reason = unavailable_reason(name, device)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


BACKENDS = [backend_param(name) for name in ("c", "compile", "triton")]


def _element(spec: str) -> str:
    return parse_format(spec).element.name


def _grid(spec: str) -> torch.Tensor:
    """Every non-negative finite value of the spec's element type (NVFP4: E2M1), float64."""
    from dsq.formats.mx import ELEMENTS, element_table

    element = ELEMENTS["fp4_e2m1" if spec == "nvfp4" else _element(spec)]
    table = element_table(element)
    return torch.unique(table[torch.isfinite(table) & (table >= 0)])


def case_tensor(spec: str, case: str, seed: int = 0) -> torch.Tensor:
    """Rows of 70 float32 values (blocks of 32 or 16, the last one partial) built to reach
    ``case``'s edge in every block."""
    g = torch.Generator().manual_seed(seed)
    rows, n = 6, 70
    x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g)).double()
    grid = _grid(spec)
    if case == "tied":
        # values exactly halfway between neighbouring element values, times the block's scale
        # (the block's maximum, the largest element, fixes the scale at 2^0: 1 for MX, and for
        # NVFP4 the tensor scale makes the block scale 1 exactly: see below)
        mids = (grid[1:] + grid[:-1]) / 2
        picks = mids[torch.randint(0, len(mids), (rows, n), generator=g)]
        signs = torch.where(torch.rand(rows, n, generator=g) < 0.5, -1.0, 1.0).double()
        x = picks * signs
        x[:, ::16] = grid[-1]  # every block's maximum: the largest element
        if spec == "mxint8":
            x[:, ::16] = 1.5  # a block maximum in [1, 2): scale 2^0
    elif case == "subnormal":
        # float32 subnormals, maxima that clamp the scale at 2^-127, elements below the
        # element type's smallest normal
        x = x * 2.0**-140
        x[0] = torch.randn(n, generator=g).double() * 2.0**-149 * 50
        x[1, :8] = 2.0**-149
        x[2] = x[2] * 2.0**-20
        x[5] = torch.randn(n, generator=g).double() * 2.0**-127  # results below 2^-126
    elif case == "saturating":
        # maxima whose leading digits round up beyond the largest element
        top = grid[-1]
        binade = 2.0 ** math.floor(math.log2(top))
        x = x.clamp(-binade, binade)
        x[:, ::16] = (2 * binade - binade / 64) * torch.sign(x[:, ::16] + 0.5)
        x[:, 5::16] = top * (1 + 1 / 16)
    elif case == "zero":
        x[0] = 0.0
        x[1] = -0.0
        x[2, :40] = 0.0
        x[3] = x[3] * 2.0**-200  # rounds to zero in float32
        x[4, 1::2] = -0.0
    elif case == "nonfinite":
        x[0, 3] = math.nan
        x[1, 40] = math.inf
        x[2, 69] = -math.inf
        x[3, ::7] = math.nan
        x[4, 0] = math.inf
    return x.to(torch.float32)


def oracle(spec: str, x: torch.Tensor) -> torch.Tensor:
    rows = [[float(v) for v in row] for row in x.tolist()]
    if spec == "nvfp4":
        out = exact_formats.nvfp4(rows)
    else:
        fmt = parse_format(spec)
        out = exact_formats.mx(rows, fmt.element.name, fmt.block)
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", [*SPECS, "mxfp4_e2m1b16", "mxfp8_e4m3b7"])
def test_quantize_equals_the_exact_oracle(spec, case):
    """On the backend DSQ_BACKEND chooses (auto: c on this CPU)."""
    fmt = parse_format(spec)
    x = case_tensor(spec, case)
    expected = oracle(spec, x)
    assert_bitwise_equal(fmt.quantize(x), expected, f"{spec} {case}")
    assert_bitwise_equal(fmt.pack(x).unpack(), expected, f"{spec} {case} packed")


@pytest.mark.parametrize("spec", SPECS)
def test_the_oracle_sees_every_case(spec):
    """The cases reach what they are named after: ties, saturation, subnormal results, zeros
    of both signs and NaN blocks (so the oracle test checks them)."""
    grid = _grid(spec)
    tied = case_tensor(spec, "tied")
    assert bool(torch.isin(tied.abs().double(), (grid[1:] + grid[:-1]) / 2).any())
    saturated = oracle(spec, case_tensor(spec, "saturating"))
    if spec != "nvfp4":  # NVFP4's block scale absorbs a large maximum; MX's power of two cannot
        x = case_tensor(spec, "saturating")
        assert bool((saturated.abs() < x.abs() * (1 - 1 / 64)).any())
    subnormal = oracle(spec, case_tensor(spec, "subnormal"))
    assert bool(((subnormal != 0) & (subnormal.abs() < 2.0**-126)).any()) or spec == "nvfp4"
    zero = oracle(spec, case_tensor(spec, "zero"))
    assert bool(((zero == 0) & torch.signbit(zero)).any()) == (spec != "mxint8")
    assert bool(torch.isnan(oracle(spec, case_tensor(spec, "nonfinite"))).any())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", [*SPECS, "mxfp6_e3m2b16"])
def test_every_backend_equals_the_reference(backend, spec, case):
    fmt = parse_format(spec)
    x = case_tensor(spec, case, seed=1)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    for axis in (1, 0):
        xd = x.to(device)
        expected = fmt.quantize(x, axis, backend="reference")
        assert_bitwise_equal(fmt.quantize(xd, axis, backend=backend).cpu(), expected, backend)
        packed = fmt.pack(xd, axis, backend=backend)
        reference = fmt.pack(x, axis, backend="reference")
        for name, stream in reference.payload.items():
            assert torch.equal(packed.payload[name].cpu(), stream), (backend, name, axis)
        assert_bitwise_equal(packed.unpack(backend=backend).cpu(), expected, f"{backend} unpack")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_go_through_float32(spec, dtype):
    """Inputs are made float32 first; results are cast back (nearest even), shape and dtype
    kept, on every axis and for a 0-dim tensor."""
    fmt = parse_format(spec)
    x = case_tensor(spec, "random", seed=2)[:, :40].to(dtype)
    for axis in (0, 1):
        expected = fmt.quantize(x.float(), axis, backend="reference").to(dtype)
        assert_bitwise_equal(fmt.quantize(x, axis), expected)
        assert_bitwise_equal(fmt.pack(x, axis).unpack(), expected)
    scalar = torch.tensor(3.3, dtype=dtype)
    assert fmt.quantize(scalar).shape == ()
    assert_bitwise_equal(fmt.pack(scalar).unpack(), fmt.quantize(scalar))


@pytest.mark.parametrize(
    "spec, bits", [("mxfp4_e2m1", 4.25), ("mxfp6_e3m2", 6.25), ("mxfp6_e2m3", 6.25),
                   ("mxfp8_e4m3", 8.25), ("mxfp8_e5m2", 8.25), ("mxint8", 8.25), ("nvfp4", 4.5)],
)  # fmt: skip
def test_pack_holds_the_bits_per_value(spec, bits):
    fmt = parse_format(spec)
    x = torch.randn(2**20, generator=torch.Generator().manual_seed(3))
    packed = fmt.pack(x)
    scale_aside = 4 if spec == "nvfp4" else 0  # nvfp4's float32 per-tensor scale
    assert (packed.nbytes - scale_aside) * 8 / x.numel() == bits == fmt.bits_per_value
    if spec.startswith("mxfp6"):  # four values in three bytes
        assert packed.payload["elements"].numel() == x.numel() * 3 // 4


def test_fp4_packs_two_values_per_byte_first_in_the_low_nibble():
    x = torch.tensor([[0.5, 6.0] + [0.0] * 30])  # amax 6: scale 2^0; codes 0b0001, 0b0111
    packed = parse_format("mxfp4_e2m1").pack(x)
    assert packed.payload["elements"][0].item() == 0x71
    assert packed.payload["scales"].tolist() == [127]


@pytest.mark.parametrize(
    "spec, canonical, bits",
    [
        ("mxfp8_e4m3", "mxfp8_e4m3", 8.25),
        ("MXFP8_E5M2", "mxfp8_e5m2", 8.25),
        ("mxfp6_e3m2b32", "mxfp6_e3m2", 6.25),
        ("mxfp4_e2m1b16", "mxfp4_e2m1b16", 4.5),
        ("mxint8b1", "mxint8b1", 16),
        ("nvfp4", "nvfp4", 4.5),
    ],
)
def test_specs_parse(spec, canonical, bits):
    fmt = parse_format(spec)
    assert fmt.spec == canonical and fmt.bits_per_value == bits
    assert parse_format(fmt.spec) == fmt


@pytest.mark.parametrize("spec", ["mxfp4", "mxfp8_e4m3b0", "mxfp8_e4m3b4097", "mxint4", "nvfp4b32"])
def test_invalid_specs_show_the_grammar(spec):
    from dsq.formats import GRAMMAR

    with pytest.raises(ValueError) as err:
        parse_format(spec)
    assert "mxfp8_e4m3" in GRAMMAR and "nvfp4" in GRAMMAR and GRAMMAR in str(err.value)


@pytest.mark.parametrize("spec", SPECS)
def test_stochastic_rounding_is_refused(spec):
    with pytest.raises(ValueError, match="nearest"):
        parse_format(spec).quantize(torch.ones(4), rounding="stochastic")


def test_nvfp4_uses_the_whole_tensor_for_its_scale():
    """Scaling one block up changes the others' values: the float32 scale is per tensor (the
    other blocks' E4M3 scales fall to their floor, 2^-6)."""
    fmt = parse_format("nvfp4")
    x = case_tensor("nvfp4", "random", seed=4)
    y = x.clone()
    y[0, :16] *= 2.0**30
    assert not torch.equal(fmt.quantize(x)[1:], fmt.quantize(y)[1:])


# ----------------------------------------------------------------------------- torchao
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not on the tests' path (make setup installs torchao 0.18 in .venv/oracles)",
)


def _torchao_mx(x: torch.Tensor, spec: str) -> torch.Tensor:
    from torchao.prototype.mx_formats import constants
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": constants.DTYPE_FP6_E3M2,
        "mxfp6_e2m3": constants.DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }[spec]
    scale, data = to_mx(x, dtype, 32)  # FLOOR: the scale from floor(log2 amax)
    return to_dtype(data, scale, dtype, 32, torch.float32)


def _torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    s = per_tensor_amax_to_scale(x.abs().max())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=s).dequantize(torch.float32)


def _million(seed: int) -> torch.Tensor:
    """10^6 values (1,000 rows of 1,024: torchao takes whole blocks along the last axis only):
    normal draws, each row at its own scale (2^-40..2^40)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1000, 1024, generator=g)
    return x * torch.exp2(torch.randint(-40, 40, (1000, 1), generator=g).float())


@needs_torchao
@pytest.mark.parametrize("spec", [s for s in SPECS if s != "mxint8"])
def test_torchao_agrees_bit_for_bit_on_a_million_values(spec):
    """torchao's to_mx / to_dtype (FLOOR scale mode) and to_nvfp4 (with the per-tensor scale of
    per_tensor_amax_to_scale) against our quantize. torchao has no MXINT8."""
    x = _million(5)
    ours = parse_format(spec).quantize(x)
    theirs = _torchao_nvfp4(x) if spec == "nvfp4" else _torchao_mx(x, spec)
    assert_bitwise_equal(ours, theirs, spec)


@needs_torchao
@pytest.mark.parametrize("spec", [s for s in MX_SPECS if s != "mxint8"])
def test_torchao_differs_where_its_scale_is_clamped_to_2_to_the_minus_126(spec):
    """A block whose scale is 2^-127 (a maximum below 2^(emax - 126)): torchao divides by
    2^-126 (it clamps the float scale to float32's smallest normal) but decodes with 2^-127, so
    its values are half ours, which the oracle confirms."""
    from fractions import Fraction

    fmt = parse_format(spec)
    x = torch.full((1, 32), 2.0**-127) * torch.linspace(1, 2, 32)
    ours, theirs = fmt.quantize(x), _torchao_mx(x, spec)
    assert_bitwise_equal(ours, oracle(spec, x))
    element = fmt.element.name
    torchaos = [  # E(x / 2^-126) * 2^-127, exactly
        float(exact_formats.round_element(Fraction(v) * 2**126, element) / 2**127)
        for v in x[0].tolist()
    ]
    assert_bitwise_equal(theirs, torch.tensor([torchaos]))
    assert not torch.equal(ours, theirs)


@needs_torchao
@pytest.mark.parametrize("spec", [s for s in MX_SPECS if s != "mxint8"])
def test_torchao_differs_on_an_infinity(spec):
    """Ours: a block holding an infinity is NaN (the E8M0 NaN scale), as for a NaN. torchao's
    FLOOR scale reads the infinity's exponent field as a power of two and saturates it."""
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(6))
    x[0, 3] = math.inf
    assert bool(torch.isnan(parse_format(spec).quantize(x)).all())
    assert not bool(torch.isnan(_torchao_mx(x, spec)).any())
    x[0, 3] = math.nan
    assert bool(torch.isnan(_torchao_mx(x, spec)).all())  # a NaN: the same in both


@needs_torchao
def test_torchao_nvfp4_differs_on_zero_and_tiny_tensors():
    """An all-zero tensor: torchao divides 0 by a zero tensor scale (NaN); a tensor whose
    maximum is below about 1e-35: its reciprocal scale overflows to infinity, and every value
    saturates. Ours floors the tensor scale at 2^-121, as the oracle does."""
    fmt = parse_format("nvfp4")
    zero = torch.zeros(2, 32)
    assert bool(torch.isnan(_torchao_nvfp4(zero)).all())
    assert_bitwise_equal(fmt.quantize(zero), zero)
    tiny = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)) * 2.0**-122
    theirs, ours = _torchao_nvfp4(tiny), fmt.quantize(tiny)
    # torchao: x * inf clamped to +-6, the largest element, wherever x is not zero
    assert len(torch.unique(theirs[0, :16].abs())) == 1
    assert not torch.equal(theirs, ours)
    assert_bitwise_equal(ours, oracle("nvfp4", tiny))


def test_dsq_bench_quant_lists_what_runs_on_the_reference():
    """The compile backend has no MX kernel: bench quant times it (on the reference) and lists
    each such operation below its table; the c backend lists none."""
    from dsq_cli.bench import quant

    result = quant.run(512, ["mxfp4_e2m1", "nvfp4"], ["compile", "c"], 1, ops=("quantize",))
    fallbacks = result["on_the_reference"]
    assert "compile: mx.quantize" in fallbacks and "compile: nvfp4.unpack" in fallbacks
    assert not any(line.startswith("c:") for line in fallbacks)
    assert "no kernel, runs on the reference: compile: mx.pack" in quant.format_table(result)
