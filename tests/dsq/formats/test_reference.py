"""The reference quantizers against docs/spec.md §1, checked by an independent exact oracle and by
the invariants a correct quantizer must satisfy (in the style of QPyTorch's tests).

The oracle below is docs/spec.md §1.1 / the static fixed-point formula in exact rational arithmetic
(``fractions.Fraction``), one Python number at a time: slow, obviously right, and sharing no
code with the implementation.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from helpers.tensors import assert_bitwise_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from dsq.formats import parse_format

REF = "reference"


def f32(value: Fraction | float) -> float:
    """Nearest float32 (the exact rational is first made float64, exactly in every case here)."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def oracle_bfp(values: list[float], m: int, E: int) -> list[float]:
    """docs/spec.md §1.1 for one block, exactly, round half to even."""
    if any(not math.isfinite(v) for v in values):
        return [math.nan] * len(values)
    a = max(abs(v) for v in values)
    if a == 0:
        return [0.0] * len(values)
    emax = 2 ** (E - 1) - 1
    e = math.frexp(a)[1] - 1  # floor(log2 a), exact
    e = max(-emax, min(emax, e))
    scale = Fraction(2) ** (e - (m - 2))
    limit = 2 ** (m - 1) - 1
    out = []
    for v in values:
        q = round(Fraction(v) / scale)  # Python rounds Fractions half to even
        q = max(-limit, min(limit, q))
        out.append(f32(q * scale))
    return out


def oracle_fixed_static(v: float, w: int, f: int) -> float:
    if not math.isfinite(v):
        return math.nan
    q = round(Fraction(v) * 2**f)
    q = max(-(2 ** (w - 1)), min(2 ** (w - 1) - 1, q))
    return f32(Fraction(q, 2**f))


def bfp_by_oracle(x: torch.Tensor, m: int, E: int, B: int, axis: int) -> torch.Tensor:
    moved = x.movedim(axis, -1)
    rows = moved.reshape(-1, moved.shape[-1]).tolist()
    out = []
    for row in rows:
        q = []
        for start in range(0, len(row), B):
            q += oracle_bfp(row[start : start + B], m, E)
        out.append(q)
    return torch.tensor(out, dtype=torch.float32).reshape(moved.shape).movedim(-1, axis)


def assert_same_values(actual, expected):
    """Value equality with NaN positions (the oracle does not model the sign of zero)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------- the worked example
def test_spec_worked_example_bfp4():
    x = torch.tensor([0.3, -1.7, 0.05, 2.9] + [0.0] * 12)
    q = parse_format("bfp4").quantize(x, backend=REF)
    assert q[:4].tolist() == [0.5, -1.5, 0.0, 3.0]
    assert not q[4:].any()


# ------------------------------------------------------------------- exhaustive small cases
@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_every_bfp_block_of_small_values_matches_the_oracle(m):
    """All blocks of 3 values from a grid of 13 (including ties at the step midpoints)."""
    grid = [0.0, 0.25, -0.25, 0.375, 0.5, -0.75, 1.0, 1.25, -1.5, 1.75, 2.5, 3.0, -3.75]
    blocks = torch.cartesian_prod(*[torch.tensor(grid)] * 3)  # 2197 blocks of 3
    got = parse_format(f"bfp{m}e8b3").quantize(blocks.reshape(-1), backend=REF)
    expected = bfp_by_oracle(blocks.reshape(-1), m, 8, 3, -1)
    assert_same_values(got, expected)


def test_every_fixed4f2_value_on_a_fine_grid_matches_the_oracle():
    x = torch.arange(-4096, 4097, dtype=torch.float32) / 512  # [-8, 8] in steps of 1/512
    got = parse_format("fixed4f2").quantize(x, backend=REF)
    expected = torch.tensor([oracle_fixed_static(v, 4, 2) for v in x.tolist()])
    assert_same_values(got, expected)


# ------------------------------------------------------------------- random tensors vs oracle
finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
any_f32 = st.floats(width=32)  # NaN, infinities, subnormals, -0.0 included


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(any_f32, min_size=1, max_size=40),
    m=st.integers(2, 24),
    E=st.integers(2, 10),
    B=st.sampled_from([1, 2, 3, 5, 16, 64]),
)
def test_bfp_matches_the_oracle(values, m, E, B):
    x = torch.tensor(values, dtype=torch.float32)
    got = parse_format(f"bfp{m}e{E}b{B}").quantize(x, backend=REF)
    assert_same_values(got, bfp_by_oracle(x, m, E, B, -1))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(any_f32, min_size=1, max_size=40), w=st.integers(2, 32), data=st.data())
def test_fixed_static_matches_the_oracle(values, w, data):
    f = data.draw(st.integers(0, w - 1))
    x = torch.tensor(values, dtype=torch.float32)
    got = parse_format(f"fixed{w}f{f}").quantize(x, backend=REF)
    expected = torch.tensor([oracle_fixed_static(v, w, f) for v in values])
    assert_same_values(got, expected)
    assert not torch.signbit(got[got == 0]).any()  # two's complement: no -0.0


@settings(max_examples=60, deadline=None)
@given(values=st.lists(finite_f32, min_size=1, max_size=64), w=st.integers(2, 32))
def test_fixed_w_is_bfp_w_with_one_block(values, w):
    x = torch.tensor(values, dtype=torch.float32)
    got = parse_format(f"fixed{w}").quantize(x, backend=REF)
    if w <= 24:  # the bfp grammar stops at 24 bits; compare with the one-block bfp directly
        one_block = parse_format(f"bfp{w}e8b{x.numel()}").quantize(x, backend=REF)
        assert_bitwise_equal(got, one_block)
    assert_same_values(got, torch.tensor(oracle_bfp(values, w, 8)))


# ------------------------------------------------------------------- invariants
bfp_specs = st.builds(
    lambda m, E, B: f"bfp{m}e{E}b{B}",
    st.integers(2, 12),
    st.sampled_from([4, 8]),
    st.sampled_from([1, 4, 16]),
)


@settings(max_examples=80, deadline=None)
@given(values=st.lists(finite_f32, min_size=1, max_size=48), spec=bfp_specs)
def test_idempotent(values, spec):
    fmt = parse_format(spec)
    q = fmt.quantize(torch.tensor(values), backend=REF)
    assert_bitwise_equal(fmt.quantize(q, backend=REF), q)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(-(2.0**99), 2.0**99, width=32), min_size=16, max_size=16),
    m=st.integers(2, 16),
)
def test_nearest_error_is_at_most_half_a_step_unless_clamped(values, m):
    x = torch.tensor(values, dtype=torch.float32)
    q = parse_format(f"bfp{m}").quantize(x, backend=REF)
    a = x.abs().max().item()
    if a == 0:
        assert not q.any()
        return
    e = max(-127, math.frexp(a)[1] - 1)
    step = 2.0 ** (e - (m - 2))
    limit = (2 ** (m - 1) - 1) * step
    err = (q.double() - x.double()).abs()
    clamped = x.double().abs() > limit
    assert (err[~clamped] <= step / 2).all()
    assert (q.double()[clamped].abs() == limit).all()


@pytest.mark.parametrize("m", [2, 3, 4, 8])
def test_block_with_exponent_zero_lands_on_multiples_of_the_step(m):
    g = torch.Generator().manual_seed(m)
    x = torch.rand(64, 16, generator=g) * 2 - 1
    x[:, 0] = 1.5  # max in [1, 2): shared exponent 0
    q = parse_format(f"bfp{m}").quantize(x, backend=REF)
    steps = q * 2.0 ** (m - 2)
    assert torch.equal(steps, steps.round())
    assert steps.abs().max() <= 2 ** (m - 1) - 1


@pytest.mark.parametrize("spec", ["bfp2", "bfp4", "fixed8f4", "bfp4e8b1"])
@pytest.mark.slow  # 4,000 draws per format
def test_stochastic_rounding_is_unbiased_and_reproducible(spec):
    fmt = parse_format(spec)
    x = torch.tensor([0.3, -1.7, 0.05, 2.9, 0.1, -0.26, 1.01, -2.0] * 2)
    draws = 4000
    batch = x.repeat(draws, 1)
    g = torch.Generator().manual_seed(0)
    q = fmt.quantize(batch, rounding="stochastic", generator=g, backend=REF)
    mean = q.double().mean(0)
    # each draw is one of two neighbours a step apart: std of the mean <= step / (2 sqrt(n))
    step = (q.double().max(0).values - q.double().min(0).values).clamp(min=1e-12)
    assert ((mean - fmt.quantize(x, backend=REF).double()).abs() <= 2 * step).all()
    # unbiased: within 5 standard errors of x itself, where x is not clamped (bfp2 clamps
    # the block max to 2^e, for instance)
    inside = fmt.quantize(batch, rounding="stochastic", generator=g).abs().amax(0) >= x.abs()
    error = (mean - x.double()).abs()
    assert (error <= 5 * step / (2 * math.sqrt(draws)))[inside].all(), (mean, x)
    assert inside.sum() >= 8
    again = fmt.quantize(batch, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert_bitwise_equal(again, q)
    other = fmt.quantize(batch, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other, q)


def test_stochastic_rounding_only_picks_the_two_neighbours():
    fmt = parse_format("bfp4")
    x = torch.randn(2000, 16, generator=torch.Generator().manual_seed(3))
    down = fmt.quantize(x, backend=REF)
    q = fmt.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(4))
    step = (q - down).abs()
    e = torch.floor(torch.log2(x.abs().amax(-1, keepdim=True)))
    unit = 2.0 ** (e - 2)
    assert ((step == 0) | (step == unit)).all()


@pytest.mark.parametrize(
    "spec, dtype, saturate",
    [
        ("fp16", torch.float16, None),
        ("bf16", torch.bfloat16, None),
        ("e4m3", torch.float8_e4m3fn, 448.0),
        ("e5m2", torch.float8_e5m2, 57344.0),
    ],
)
def test_floating_formats_equal_torch_casts(spec, dtype, saturate):
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(1000, generator=g) * 10.0 ** torch.randint(-8, 8, (1000,), generator=g),
            torch.tensor([0.0, -0.0, 1e-45, -1e-40, 65504.0, 70000.0, 1e6, -1e30, 3e38]),
            torch.tensor([math.inf, -math.inf, math.nan]),
        ]
    )
    got = parse_format(spec).quantize(x, backend=REF)
    cast = x if saturate is None else x.clamp(-saturate, saturate)
    assert_bitwise_equal(got, cast.to(dtype).float())
    if saturate is not None:
        assert got[-3].item() == saturate and got[-2].item() == -saturate  # inf saturates
        assert math.isnan(got[-1].item())


# ------------------------------------------------------------------- edge cases
def test_partial_zero_nan_inf_and_subnormal_blocks():
    x = torch.zeros(5, 20)
    x[0] = torch.linspace(-3, 3, 20)  # blocks of 16 and a partial block of 4
    x[1, 3] = math.nan
    x[2, 17] = -math.inf
    x[3] = torch.tensor([1e-40, -2e-42, 1.4e-45] + [0.0] * 17)  # subnormal block
    x[4, 0] = -0.0
    q = parse_format("bfp4").quantize(x, backend=REF)
    assert_same_values(q, bfp_by_oracle(x, 4, 8, 16, -1))
    assert torch.isnan(q[1, :16]).all() and not torch.isnan(q[1, 16:]).any()
    assert torch.isnan(q[2, 16:]).all() and not torch.isnan(q[2, :16]).any()
    assert not q[4].any() and torch.signbit(q[4, 0])  # -0.0 keeps its sign
    # subnormal block: e is clamped to -127; bfp8's step is 2^-133, so 1e-40 survives coarsely
    q8 = parse_format("bfp8").quantize(x[3], backend=REF)
    assert q8[0].item() == 2.0**-133 and q8[1].item() == 0 and torch.signbit(q8[1])
    assert_same_values(q8, bfp_by_oracle(x[3], 8, 8, 16, -1))


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_any_axis_equals_moving_that_axis_last(axis):
    x = torch.randn(6, 35, 4, generator=torch.Generator().manual_seed(1))
    fmt = parse_format("bfp3e8b8")
    got = fmt.quantize(x, axis=axis, backend=REF)
    expected = fmt.quantize(x.movedim(axis, -1).contiguous(), backend=REF).movedim(-1, axis)
    assert_bitwise_equal(got, expected)
    assert_same_values(got, bfp_by_oracle(x, 3, 8, 8, axis))


def test_non_contiguous_input_and_other_dtypes():
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(2))
    fmt = parse_format("bfp5")
    t = x.t()  # non-contiguous
    assert_bitwise_equal(fmt.quantize(t, axis=0, backend=REF), fmt.quantize(x, axis=1).t())
    half = x.half()
    got = fmt.quantize(half, backend=REF)
    assert got.dtype == torch.float16
    assert_bitwise_equal(got, fmt.quantize(half.float(), backend=REF).half())
    assert fmt.quantize(x.double(), backend=REF).dtype == torch.float64


def test_zero_dim_and_empty_tensors():
    expected = {"bfp4": 3.0, "fixed8": 93 / 32, "fixed8f4": 46 / 16, "fp16": 2.900390625}
    for spec, value in expected.items():
        fmt = parse_format(spec)
        s = fmt.quantize(torch.tensor(2.9), backend=REF)
        assert s.shape == () and s.item() == value
        e = fmt.quantize(torch.empty(0, 5))
        assert e.shape == (0, 5)


def test_huge_and_tiny_values_in_one_block():
    x = torch.tensor([3e38, 1e30, -1e-30, -1e-40, 1.0, -3.4e38] + [0.0] * 10)
    for m in (2, 8, 24):
        q = parse_format(f"bfp{m}").quantize(x, backend=REF)
        assert_same_values(q, bfp_by_oracle(x, m, 8, 16, -1))
        assert torch.isfinite(q).all()
    big = parse_format("bfp8e5").quantize(torch.tensor([1e10, 1.0]), backend=REF)
    assert big[0].item() == 127 * 2.0 ** (15 - 6)  # E=5: exponent saturates at 15


def test_fixed32_on_tiny_values_is_exact():
    """fixed<w> with w > 24: the scale falls below float32's range; the result is still exact."""
    x = torch.tensor([1e-40, -3e-41, 1.4e-45, 0.0])
    q = parse_format("fixed32").quantize(x, backend=REF)
    assert_bitwise_equal(q, x)
