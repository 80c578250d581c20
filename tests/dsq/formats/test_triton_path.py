"""The Triton path equals the reference bit for bit (values, -0.0, NaN positions, packed bytes).

Without a GPU the kernels run under the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1``
is set here (as in conftest.py) before anything imports Triton. With a GPU and the variable
unset, the same tests run the compiled kernels on CUDA tensors (the reference runs there too).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
from helpers.tensors import assert_bitwise_equal  # noqa: E402

pytest.importorskip("triton")

import dsq.kernels.bfp as kernels  # noqa: E402
from dsq.formats import bfp_reference as ref  # noqa: E402
from dsq.formats import bfp_triton as tp  # noqa: E402
from dsq.formats import exact  # noqa: E402
from dsq.formats import fixed_reference as rf  # noqa: E402
from dsq.formats import fixed_triton as tf  # noqa: E402

pytestmark = pytest.mark.slow  # trains, compiles or spawns processes (not in make test-fast)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


# ----------------------------------------------------------------------------- helpers
def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact equality (helpers/tensors.py: dtype, shape, NaN positions, bits, sign of 0)."""
    assert_bitwise_equal(got, want, "triton vs reference")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def check_bfp(x, m, E, B, axis=-1, rounding="nearest", seed=0):
    """quantize, pack bytes and unpack(pack) of the Triton path against the reference."""
    want = ref.bfp_quantize(x, m, E, B, axis, rounding, gen(seed))
    got = tp.bfp_quantize(x, m, E, B, axis, rounding, gen(seed))
    assert_same(got, want)
    want_m, want_e = ref.bfp_pack(x, m, E, B, axis, rounding, gen(seed))
    got_m, got_e = tp.bfp_pack(x, m, E, B, axis, rounding, gen(seed))
    assert got_m.dtype == torch.uint8 and got_e.dtype == torch.uint8
    assert torch.equal(got_m, want_m), "mantissa stream differs"
    assert torch.equal(got_e, want_e), "exponent stream differs"
    shape = tuple(x.shape)
    assert_same(tp.bfp_unpack(got_m, got_e, m, E, B, shape, axis, x.dtype), want)
    return got


def check_fixed(x, w, f, rounding="nearest", seed=0):
    want = rf.fixed_static_quantize(x, w, f, rounding, gen(seed))
    got = tf.fixed_static_quantize(x, w, f, rounding, gen(seed))
    assert_same(got, want)
    want_i, want_n = rf.fixed_static_pack(x, w, f, rounding, gen(seed))
    got_i, got_n = tf.fixed_static_pack(x, w, f, rounding, gen(seed))
    assert torch.equal(got_i, want_i), "integer stream differs"
    assert (got_n is None) == (want_n is None)
    if want_n is not None:
        assert torch.equal(got_n, want_n), "NaN mask stream differs"
    assert_same(tf.fixed_static_unpack(got_i, got_n, w, f, tuple(x.shape), x.dtype), want)
    return got


def wide_random(shape, seed, lo=-150, hi=128):
    """Random signs and mantissas over a wide exponent range, with zeros and exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g))
    r = torch.rand(shape, generator=g)
    ties = (torch.randint(-40, 40, shape, generator=g) + 0.5) * torch.exp2(
        torch.randint(-8, 4, shape, generator=g).float()
    )
    x = torch.where(r < 0.25, ties, x)
    x = torch.where((r >= 0.25) & (r < 0.3), 0.0, x)
    x = torch.where((r >= 0.3) & (r < 0.33), -0.0, x)
    return x.to(DEVICE)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny launch tiles: many programs, blocks straddling program boundaries."""
    monkeypatch.setattr(kernels, "TILE_ELEMS", 64)
    monkeypatch.setattr(kernels, "PACK_GROUPS", 4)
    monkeypatch.setattr(kernels, "ELEM_BLOCK", 64)
    monkeypatch.setattr(kernels, "REDUCE_BLOCK", 32)


def edge_rows() -> torch.Tensor:
    """One edge case per row of 16 (bfp blocks along the last axis)."""
    nan, inf = math.nan, math.inf
    rows = [
        [0.0] * 16,
        [-0.0] * 16,
        [0.0, -0.0] * 8,
        [1.0, nan] + [2.0] * 14,
        [inf] + [1.0] * 15,
        [-inf, 0.0] + [-3.0] * 14,
        [1e-40, -1e-40, 1.4e-45, -1.4e-45, 0.0, -0.0, 5e-39, 1.1754942e-38] * 2,
        [1.4e-45] * 16,
        [3.4e38, -3.4e38, 1.0, -1e-38, 3.4028235e38, 1e30, 0.0, -0.0] * 2,
        [1e30, 1e-30, -1e-40, -1e30, 1.0, -1.0, 2.5e29, -0.0] * 2,
        # ties at bfp4 (max 4 -> step 1) and bfp8 (max 64 -> step 1)
        [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 4.0, 0.25, 0.75, -0.75, 5.5, 6.5, 7.5, -7.5],
        [64.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 62.5, 63.5, -63.5, 33.5, 0.0, -0.0, 1.0, 2.0],
        [-0.3, 0.3, 2.9, -1.7, 0.05, 0.0, -0.0, 1e-3, -1e-3, 0.1, -0.1, 0.2, -0.2, 0.4, -0.4, 1.0],
        [2.0**-126, -(2.0**-127), 2.0**-149, 2.0**-130, -(2.0**-140), 0.0, -0.0, 2.0**-128] * 2,
        [2.0**127, 2.0**127 * 1.5, -(2.0**126), 1.0, -1.0, 2.0**100, 0.0, -0.0] * 2,
    ]
    return torch.tensor(rows, dtype=torch.float32, device=DEVICE)


# ----------------------------------------------------------------------------- BFP formats
@pytest.mark.parametrize("m", [2, 3, 4, 8, 16, 24])
@pytest.mark.parametrize("E", [2, 5, 8, 10])
@pytest.mark.parametrize("B", [1, 3, 16, 33])
def test_bfp_formats(m, E, B):
    x = wide_random((3, 41), seed=m * 100 + E * 10 + B, lo=-40, hi=40)
    check_bfp(x, m, E, B, axis=(m + E + B) % 2)


@pytest.mark.parametrize("m", [2, 4, 8, 24])
@pytest.mark.parametrize("E", [2, 8, 10])
def test_bfp_wide_range_and_stochastic(m, E):
    x = wide_random((5, 20), seed=m + E)
    check_bfp(x, m, E, 16, axis=1)
    check_bfp(x, m, E, 3, axis=0, rounding="stochastic", seed=m * E)


def test_bfp_beyond_spec_widths():
    """m > 25 with E < 8 (not a spec format): the clamp bound 2^(m-1)-1 is no float32."""
    for m, E, B in [(30, 4, 16), (32, 2, 3), (26, 5, 1)]:
        check_bfp(wide_random((3, 20), seed=m, lo=-20, hi=20), m, E, B, axis=1)
        check_bfp(edge_rows(), m, E, B, axis=1, rounding="stochastic", seed=m)


@pytest.mark.parametrize(
    "m,E,B", [(4, 8, 16), (4, 8, 3), (8, 2, 16), (2, 5, 1), (24, 10, 33), (16, 8, 16), (3, 4, 5)]
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bfp_edge_values(m, E, B, rounding):
    x = edge_rows()
    check_bfp(x, m, E, B, axis=1, rounding=rounding, seed=7)
    check_bfp(x, m, E, B, axis=0, rounding=rounding, seed=8)


@pytest.mark.parametrize(
    "shape,axis",
    [((), 0), ((1,), 0), ((7,), 0), ((7,), -1), ((3, 17), 0), ((3, 17), 1), ((2, 3, 40), 0),
     ((2, 3, 40), 1), ((2, 3, 40), 2), ((4, 1, 5), 1), ((2, 16), 1), ((2, 48), 1)],
)  # fmt: skip
def test_bfp_shapes_axes(shape, axis):
    x = wide_random(shape, seed=len(shape) * 10 + axis, lo=-20, hi=20)
    check_bfp(x, 4, 8, 16, axis)
    check_bfp(x, 3, 5, 3, axis, rounding="stochastic", seed=3)
    check_bfp(x, 8, 8, None, axis)


def test_bfp_non_contiguous_and_dtypes():
    base = wide_random((24, 10), seed=11, lo=-12, hi=12)
    check_bfp(base.t(), 4, 8, 16, axis=1)  # transposed
    check_bfp(base.t(), 4, 8, 16, axis=0, rounding="stochastic", seed=1)
    check_bfp(base[::2, 1::3], 5, 6, 3, axis=0)  # strided
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = base.to(dtype)
        assert check_bfp(x, 4, 8, 16, axis=0).dtype == dtype
        check_bfp(x, 8, 8, None, axis=0, rounding="stochastic", seed=2)
    # float64 inputs that are not float32 values: rounded to float32 first, as the reference
    x64 = torch.tensor([1 + 2.0**-30, 3.0000000001, -1e-300, 1e300], dtype=torch.float64)
    check_bfp(x64.to(DEVICE), 8, 8, 16, axis=0)


@pytest.mark.parametrize("E", [2, 8, 10])
def test_bfp_many_programs(small_tiles, E):
    """Tiny tiles: blocks and bytes straddle program boundaries, partial blocks in every row."""
    for shape, B, m in [((9, 50), 16, 3), ((4, 70), 33, 5), ((6, 37), 3, 4), ((5, 64), 16, 8)]:
        x = wide_random(shape, seed=B + m + E, lo=-30, hi=30)
        check_bfp(x, m, E, B, axis=1)
        check_bfp(x, m, E, B, axis=0, rounding="stochastic", seed=B)


# ----------------------------------------------------------------------------- dynamic fixed
@pytest.mark.parametrize("w", [2, 8, 16, 24, 25, 31, 32])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fixed_dynamic(w, rounding):
    x = wide_random((4, 33), seed=w, lo=-30, hi=10)
    check_bfp(x, w, 8, None, axis=0, rounding=rounding, seed=w)
    check_bfp(edge_rows()[6:8], w, 8, None, axis=0, rounding=rounding, seed=w)  # subnormals


def test_fixed_dynamic_edges(small_tiles):
    rows = edge_rows()
    for i in range(rows.shape[0]):
        check_bfp(rows[i], 32, 8, None, axis=0)
        check_bfp(rows[i], 4, 8, None, axis=0, rounding="stochastic", seed=i)
    check_bfp(torch.tensor(2.5, device=DEVICE), 8, 8, None, axis=0)  # 0-dim
    check_bfp(wide_random((7, 19), seed=5, lo=-140, hi=-120), 25, 8, None, axis=0)


# ----------------------------------------------------------------------------- static fixed
@pytest.mark.parametrize(
    "w,f", [(8, 4), (16, 8), (32, 30), (2, 0), (24, 0), (25, 24), (26, 3), (31, 0), (32, 0)]
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fixed_static(w, f, rounding):
    x = wide_random((4, 21), seed=w + f, lo=-8 - f, hi=w - f + 4)
    check_fixed(x, w, f, rounding, seed=f)
    check_fixed(edge_rows(), w, f, rounding, seed=w)
    steps = (torch.arange(-12, 12, device=DEVICE) + 0.5) * 2.0**-f  # ties
    check_fixed(steps, w, f, rounding)


def test_fixed_static_shapes_dtypes(small_tiles):
    check_fixed(torch.tensor(-0.0, device=DEVICE), 8, 4)  # 0-dim, -0.0 -> +0.0
    check_fixed(torch.tensor(math.nan, device=DEVICE), 8, 4)
    x = wide_random((10, 13), seed=3, lo=-10, hi=10)
    check_fixed(x.t(), 8, 4)
    check_fixed(x[:, ::3], 12, 5, "stochastic", seed=4)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        check_fixed(x.to(dtype), 16, 8)
    check_fixed(torch.full((5,), 1e10, device=DEVICE), 32, 0)  # clamp to 2^31-1
    check_fixed(torch.full((5,), -1e10, device=DEVICE), 32, 0)


# ----------------------------------------------------------------------------- crafted noise
@pytest.mark.parametrize("u_value", [0.0, 1.0 - 2.0**-24, 0.5])
def test_stochastic_extreme_noise(monkeypatch, u_value):
    """u = 0 (tiny negatives must floor to -1 even where float32 underflows) and u = 1 - 2^-24."""

    def noise(x, generator):
        return torch.full(x.shape, u_value, dtype=torch.float32, device=x.device)

    monkeypatch.setattr(exact, "uniform_noise", noise)  # every backend draws through it
    rows = edge_rows()
    tiny = torch.tensor(
        [[1e30, -1e-30, -1e-40, -1.4e-45, 1e-30, 1.4e-45, -0.0, 0.0, -1.0, -(2.0**-40)] * 2],
        device=DEVICE,
    )
    for m, E, B in [(4, 8, 16), (24, 8, 16), (8, 10, 3), (2, 2, 5)]:
        check_bfp(rows, m, E, B, axis=1, rounding="stochastic")
        check_bfp(tiny, m, E, B, axis=1, rounding="stochastic")
    check_bfp(tiny, 32, 8, None, axis=0, rounding="stochastic")
    for w, f in [(8, 4), (32, 30), (2, 0)]:
        check_fixed(rows, w, f, rounding="stochastic")
        check_fixed(tiny, w, f, rounding="stochastic")


# ----------------------------------------------------------------------------- randomized
def test_random_fuzz(small_tiles):
    g = torch.Generator().manual_seed(1234)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    for case in range(40):
        nd = pick([0, 1, 2, 3])
        shape = tuple(int(s) for s in torch.randint(1, 11, (nd,), generator=g))
        lo = pick([-150, -30, 0])
        x = wide_random(shape, seed=case, lo=lo, hi=min(128, lo + pick([20, 60, 278])))
        axis = pick(list(range(nd))) if nd else 0
        dtype = pick([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64])
        x = x.to(dtype)
        rounding = pick(["nearest", "stochastic"])
        if case % 4 == 0:
            check_bfp(x, pick([2, 7, 16, 25, 32]), 8, None, axis, rounding, seed=case)
        else:
            m, E, B = pick([2, 3, 5, 12, 24]), pick([2, 3, 8, 9, 10]), pick([1, 2, 4, 7, 16, 33])
            check_bfp(x, m, E, B, axis, rounding, seed=case)
        w = pick([2, 5, 8, 17, 26, 32])
        check_fixed(x, w, pick(range(w)), rounding, seed=case)


def test_bad_rounding_rejected():
    with pytest.raises(ValueError):
        tp.bfp_quantize(torch.ones(4, device=DEVICE), 4, 8, 16, 0, "up", None)


# ----------------------------------------------------------------------------- through the API
# No floating format here: fp16 & co. are torch's casts on every path (floats.py checks only the
# backend's name, test_format_properties.py's test_an_unknown_backend_is_refused_by_every_format),
# so their backend="triton" would be the reference compared with itself.
@pytest.mark.parametrize("spec", ["bfp4", "bfp3e5b7", "fixed12", "fixed8f4"])
def test_format_api_on_the_triton_backend(spec):
    """parse_format(...).quantize / pack / unpack with backend="triton" end to end."""
    from dsq.formats import parse_format

    fmt = parse_format(spec)
    x = torch.randn(5, 40, generator=gen(1), device=DEVICE)
    x[1, 3] = -0.0
    want = fmt.quantize(x, axis=1, backend="reference")
    assert_same(fmt.quantize(x, axis=1, backend="triton"), want)
    packed = fmt.pack(x, axis=1, backend="triton")
    ref_packed = fmt.pack(x, axis=1, backend="reference")
    for name, stream in ref_packed.payload.items():
        assert torch.equal(packed.payload[name], stream), name
    assert_same(packed.unpack(backend="triton"), want)
