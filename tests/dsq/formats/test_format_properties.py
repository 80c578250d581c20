"""Property tests: every format on any input, on every path (docs/formats.md).

Hypothesis draws a format (every family and code width), a tensor (rank 0 to 4, sizes around
the block length, every axis, fp16/bf16/fp32/fp64, contiguous, transposed, sliced or expanded,
with NaN, infinities, -0.0 and subnormals mixed in) and checks:

* quantize on the c, compile and triton backends equals the reference bit for bit (BFP and
  fixed point on non-empty tensors: the floating formats and empty tensors have one
  implementation, the same on every backend, so those tests leave them out; see ``PATH_SPECS``);
* ``pack(x, axis).unpack()`` equals ``quantize(x, axis)`` bit for bit on every path;
* the packed payload bytes are identical on every path;
* ``nbytes`` is exactly what the layout in docs/formats.md adds up to;
* stochastic rounding with a seeded generator agrees across paths and takes the same draws.

The budget is small on purpose: torch.compile builds kernels per format and shape class (the
CPU backends draw from a short list of formats chosen to reach every packing code path), and
the Triton interpreter is slow, so its tensors stay at a few hundred elements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from unittest import mock

import pytest
import torch
from helpers.tensors import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsq.formats import parse_format, reference
from dsq.formats.backends import BACKENDS, select_backend, unavailable_reason
from dsq.formats.base import registered_formats
from dsq.formats.bfp import BFP
from dsq.formats.fixed import FixedDynamic, FixedStatic
from dsq.formats.floats import FP32, FloatCast

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (conftest)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def backend_param(name: str, device: str = "cpu"):
    """``name`` as a test parameter, skipped with the reason where the backend cannot run."""
    reason = unavailable_reason(name, device)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


CPU_BACKENDS = [backend_param("c"), backend_param("compile")]
needs_triton = pytest.mark.skipif(
    unavailable_reason("triton", TRITON_DEVICE) is not None,
    reason=str(unavailable_reason("triton", TRITON_DEVICE)),
)


def budget(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same examples every run: reproducible, and compiled once
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ----------------------------------------------------------------------------- formats
FLOAT_SPECS = ["fp32", "fp16", "bf16", "e4m3", "e5m2"]
BLOCKS = (1, 7, 16, 32)

bfp_specs = st.builds(
    "bfp{}e{}b{}".format, st.integers(2, 24), st.integers(2, 10), st.sampled_from(BLOCKS)
) | st.sampled_from(["bfp4", "bfp16", "BFP8e5", "bfp3b7"])  # defaults and case in the grammar
fixed_dynamic_specs = st.integers(2, 32).map("fixed{}".format)
fixed_static_specs = st.integers(2, 32).flatmap(
    lambda w: st.integers(0, w - 1).map(lambda f: f"fixed{w}f{f}")
)
quantizer_specs = bfp_specs | fixed_dynamic_specs | fixed_static_specs  # stochastic rounding
all_specs = quantizer_specs | st.sampled_from(FLOAT_SPECS)
# What the per-backend tests (c, compile and triton against the reference) draw: the floating
# formats are left out rather than routed, since they are torch's casts on every backend
# (floats.py: only the backend's name is checked,
# test_an_unknown_backend_is_refused_by_every_format),
# and the per-backend cases are never empty (empty=False), since an empty tensor runs on the
# reference whatever the backend (test_empty_tensors_pack_and_unpack_on_the_reference): either
# would compare the reference with itself. The reference test draws both.
PATH_SPECS = quantizer_specs

# Formats for the CPU backends, whose torch.compile kernels compile each one (several seconds
# apiece, per shape class): between them they reach every code container (8-, 16- and 32-bit
# codes), the byte view of 8- and 16-bit codes, the 64-bit word plan and the byte gather of the
# unpacker, E of 2, 5, 8 and 10, blocks of one element, short and long blocks, whole-tensor blocks
# (with wrapping 32-bit codes) and static fixed point above 26 bits. Most are also in
# test_compiled_path.py, whose compiled kernels a full test run reuses. The floating formats are
# the same casts on every backend.
COMPILED_SPECS = [
    "bfp16e2b7",  # 16-bit codes: the stream is a byte view of them; heavy exponent clamping
    "bfp8",  # 8-bit codes: the stream is the codes themselves
    "bfp11",  # 16-bit container, odd width: byte gather
    "bfp24e10b33",  # 32-bit container; subnormal exponents are kept
    "bfp3e5b1",  # word plan; one block per element
    "fixed32",
    "fixed8f4",
    "fixed32f30",
]
COMPILED_STOCHASTIC_SPECS = ["bfp2", "bfp16e2b7", "fixed8f4", "fixed12"]


# ----------------------------------------------------------------------------- tensors
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# NaN, infinities, signed zeros, float32 subnormals (and 2^-126, the smallest normal), an fp16
# subnormal, a float64 subnormal, the float32 and fp16 maxima, a float64 value beyond float32
SPECIALS = [
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1e-40,
    -1.4e-45,
    2.0**-126,
    -5.9e-8,
    1e-310,
    3.4028235e38,
    -65504.0,
    1e300,
]
VIEWS = ["contiguous", "transposed", "sliced", "expanded"]


@dataclasses.dataclass
class Case:
    spec: str
    x: torch.Tensor = dataclasses.field(repr=False)
    axis: int
    how: str  # how x was made: enough to rebuild it by hand from a failure report

    @property
    def fmt(self):
        return parse_format(self.spec)


def wide_values(shape, seed: int, lo: int, hi: int) -> torch.Tensor:
    """float64 values with exponents in [lo, hi], exact ties (k + 1/2) 2^j, zeros and -0.0."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(lo, hi + 1, shape, generator=g).double()
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(exps)
    ties = (torch.randint(-64, 64, shape, generator=g) + 0.5).double() * torch.exp2(exps - 4)
    r = torch.rand(shape, generator=g, dtype=torch.float64)
    x = torch.where(r < 0.2, ties, x)
    x = torch.where((r >= 0.2) & (r < 0.27), 0.0, x)
    return torch.where((r >= 0.27) & (r < 0.3), -0.0, x)


@st.composite
def shapes_and_axes(draw, block: int, max_numel: int, empty: bool = True):
    """Rank 0 to 4, sizes 0 (unless not ``empty``), 1, 2, B-1, B, B+1 and larger (at most
    ``max_numel`` elements) and an axis, negative or not. The blocked axis's length is drawn
    first, from the sizes where blocking changes: one element, one short of a block, a block,
    one over."""
    rank = draw(st.sampled_from([1, 2, 3, 4, 2, 3, 0]))
    axis = draw(st.integers(-max(rank, 1), max(rank, 1) - 1))
    sizes = [1, block + 1, max(block - 1, 2), block, 2, 2 * block + 3, 37]
    shape = [1] * rank
    numel = 1
    dims = list(range(rank))
    if rank:
        dims.remove(axis % rank)
        dims.insert(0, axis % rank)
    for dim in dims:
        fits = [s for s in sizes if numel * s <= max_numel]
        shape[dim] = draw(st.sampled_from(fits))
        numel *= shape[dim]
    if empty and rank and draw(st.integers(0, 9)) == 9:  # now and then an empty tensor
        shape[draw(st.integers(0, rank - 1))] = 0
    return tuple(shape), axis


@st.composite
def cases(draw, specs, max_numel: int, device: str = "cpu", empty: bool = True):
    """A format from ``specs``, an axis and a tensor on ``device`` (see the module docstring);
    never an empty one unless ``empty``."""
    spec = draw(specs)
    fmt = parse_format(spec)
    block = getattr(fmt, "block", None) or 16
    shape, axis = draw(shapes_and_axes(block, max_numel, empty))
    rank = len(shape)
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    lo = draw(st.integers(-24, 8) | st.integers(-150, 120))  # ordinary magnitudes, or any
    hi = min(127, lo + draw(st.sampled_from([0, 3, 10, 40, 280])))
    specials = draw(
        st.lists(st.tuples(st.integers(0, 2**16), st.sampled_from(SPECIALS)), max_size=3)
    )
    view = draw(st.sampled_from(VIEWS)) if rank else "contiguous"
    dim = draw(st.integers(0, rank - 1)) if rank else 0
    other = (dim + 1 + draw(st.integers(0, rank - 2))) % rank if rank >= 2 else dim

    def make(base_shape):
        values = wide_values(base_shape, seed, lo, hi)
        if dtype == torch.float16:  # saturate: infinities come from the specials only
            values = values.clamp(-65504, 65504)
        flat = values.view(-1)
        for position, value in specials:
            if flat.numel():
                flat[position % flat.numel()] = value
        return values.to(dtype).to(device)

    if view == "transposed" and rank >= 2:
        swapped = list(shape)
        swapped[dim], swapped[other] = shape[other], shape[dim]
        x = make(tuple(swapped)).transpose(dim, other)
        view = f"transposed({dim}, {other})"
    elif view == "sliced":
        big = list(shape)
        big[dim] = 2 * shape[dim] + 1
        index = [slice(None)] * rank
        index[dim] = slice(1, None, 2)
        x = make(tuple(big))[tuple(index)]
        view = f"sliced(dim {dim}, 1::2)"
    elif view == "expanded":
        small = list(shape)
        small[dim] = 1
        x = make(tuple(small)).expand(shape)
        view = f"expanded(dim {dim})"
    else:
        x = make(shape)
        view = "contiguous"
    assert tuple(x.shape) == shape
    how = (
        f"shape={shape} stride={x.stride()} dtype={dtype} {view}; "
        f"wide_values(seed={seed}, lo={lo}, hi={hi}) with specials {specials}"
    )
    return Case(spec, x, axis, how)


# ----------------------------------------------------------------------------- checks
def documented_nbytes(fmt, x: torch.Tensor, axis: int) -> int:
    """The payload size that docs/formats.md ("Packed layout") adds up to."""
    numel = x.numel()
    if numel == 0:
        return 0  # empty tensors pack to empty streams
    if isinstance(fmt, FloatCast):
        # fp32 is the identity and keeps the input's own dtype (float64 stays exact)
        itemsize = x.element_size() if isinstance(fmt, FP32) else torch.finfo(fmt.dtype).bits // 8
        return numel * itemsize
    if isinstance(fmt, FixedStatic):
        # the mask is there when the float32 input (what the math sees) holds NaN or infinity
        nonfinite = not bool(torch.isfinite(x.to(torch.float32)).all())
        return math.ceil(numel * fmt.width / 8) + (math.ceil(numel / 8) if nonfinite else 0)
    if isinstance(fmt, FixedDynamic):
        return math.ceil(numel * fmt.man_bits / 8) + 1  # one 8-bit exponent
    assert isinstance(fmt, BFP)
    n = x.shape[axis] if x.dim() else 1
    blocks = (numel // n) * math.ceil(n / fmt.block)  # a partial block per row is a block
    return math.ceil(numel * fmt.man_bits / 8) + math.ceil(blocks * fmt.exp_bits / 8)


def payload_names(fmt, x: torch.Tensor) -> set[str]:
    if isinstance(fmt, FloatCast):
        return {"values"}
    if isinstance(fmt, FixedStatic):
        if x.numel() and not bool(torch.isfinite(x.to(torch.float32)).all()):
            return {"integers", "nan_mask"}
        return {"integers"}
    return {"mantissas", "exponents"}


def check_packed(packed, fmt, x: torch.Tensor, axis: int) -> None:
    """Header, payload names and dtypes, and nbytes as documented."""
    assert packed.fmt == fmt and packed.shape == tuple(x.shape) and packed.dtype == x.dtype
    assert set(packed.payload) == payload_names(fmt, x)
    for name, tensor in packed.payload.items():
        if isinstance(fmt, FloatCast):
            assert tensor.dtype == (x.dtype if isinstance(fmt, FP32) else fmt.dtype)
            assert tensor.shape == x.shape
        else:  # a bit stream: compact bytes, not a view into a bigger buffer of codes
            assert tensor.dtype == torch.uint8 and tensor.dim() == 1, name
            assert tensor.is_contiguous(), f"{name} stream has stride {tensor.stride()}"
    assert packed.nbytes == documented_nbytes(fmt, x, axis)


def payload_bytes(packed) -> dict[str, torch.Tensor]:
    """Each payload tensor as raw bytes (NaN payloads compare too, unlike torch.equal)."""
    return {
        name: t.contiguous().reshape(-1).view(torch.uint8).cpu()
        for name, t in packed.payload.items()
    }


def assert_same_payload(got, want, msg: str) -> None:
    got_bytes, want_bytes = payload_bytes(got), payload_bytes(want)
    assert got_bytes.keys() == want_bytes.keys(), msg
    for name, stream in want_bytes.items():
        assert torch.equal(got_bytes[name], stream), f"{msg}: {name} bytes differ"


def check_path_against_reference(case: Case, path: str) -> None:
    fmt, x, axis = case.fmt, case.x, case.axis
    want = fmt.quantize(x, axis, backend="reference")
    assert_bitwise_equal(fmt.quantize(x, axis, backend=path), want, f"{path} quantize")
    want_packed = fmt.pack(x, axis, backend="reference")
    packed = fmt.pack(x, axis, backend=path)
    check_packed(packed, fmt, x, axis)
    assert_same_payload(packed, want_packed, f"{path} pack")
    assert_bitwise_equal(packed.unpack(backend=path), want, f"{path} unpack")
    # the reference's streams are exactly nbytes long (a fast path's may sit in a larger buffer)
    assert_bitwise_equal(want_packed.unpack(backend=path), want, f"{path} unpack of reference")


# ----------------------------------------------------------------------------- properties
@budget(200)
@given(case=cases(all_specs, max_numel=600))
@pytest.mark.slow  # hypothesis over every format, a few seconds
def test_reference_pack_unpack_and_nbytes(case):
    """On the reference: quantize keeps shape and dtype, is idempotent on float32, and
    unpack(pack(x)) is quantize(x) bit for bit with exactly the documented bytes."""
    fmt, x, axis = case.fmt, case.x, case.axis
    q = fmt.quantize(x, axis, backend="reference")
    assert q.shape == x.shape and q.dtype == x.dtype
    if x.dtype == torch.float32:  # the values of a format are fixed points of its quantizer
        assert_bitwise_equal(fmt.quantize(q, axis, backend="reference"), q, "idempotent")
    packed = fmt.pack(x, axis, backend="reference")
    check_packed(packed, fmt, x, axis)
    assert_bitwise_equal(packed.unpack(backend="reference"), q, "unpack(pack)")
    if getattr(fmt, "block", 0) is None or isinstance(fmt, FixedStatic):
        # fixed<w> has one block for the whole tensor and fixed<w>f<f> no blocks: axis is moot
        other = fmt.pack(x, 0 if axis % max(x.dim(), 1) else -1, backend="reference")
        assert_same_payload(other, packed, "another axis")
    if isinstance(fmt, FloatCast):  # stochastic rounding is defined for BFP and fixed point
        with pytest.raises(ValueError, match="nearest"):
            fmt.quantize(x, axis, "stochastic", torch.Generator())


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("spec", COMPILED_SPECS)
@budget(20)
@given(data=st.data())
def test_cpu_backend_equals_reference(backend, spec, data):
    case = data.draw(cases(st.just(spec), max_numel=600, empty=False), label="case")
    check_path_against_reference(case, backend)
    # the automatic choice on CPU (DSQ_BACKEND's, else the c backend) round-trips too
    fmt, x, axis = case.fmt, case.x, case.axis
    want = fmt.quantize(x, axis, backend="reference")
    assert_bitwise_equal(fmt.quantize(x, axis), want, "automatic quantize")
    assert_bitwise_equal(fmt.pack(x, axis).unpack(), want, "automatic pack and unpack")


@pytest.mark.slow
@needs_triton
@budget(150)
@given(
    case=cases(PATH_SPECS, max_numel=240, device=TRITON_DEVICE, empty=False),
    small_tiles=st.booleans(),
)
def test_triton_backend_equals_reference(case, small_tiles):
    import dsq.kernels.bfp as kernels

    # tiny launch tiles: many programs even for small tensors, blocks straddling programs
    tiles = dict(TILE_ELEMS=64, PACK_GROUPS=4, ELEM_BLOCK=64, REDUCE_BLOCK=32)
    with mock.patch.multiple(kernels, **tiles) if small_tiles else contextlib.nullcontext():
        check_path_against_reference(case, "triton")


def check_stochastic(case: Case, path: str, seed: int) -> None:
    fmt, x, axis = case.fmt, case.x, case.axis
    device = x.device

    def run(method, backend):
        generator = torch.Generator(device=device).manual_seed(seed)
        result = method(x, axis, "stochastic", generator, backend=backend)
        return result, generator.get_state()

    want, want_state = run(fmt.quantize, "reference")
    got, state = run(fmt.quantize, path)
    assert_bitwise_equal(got, want, f"{path} stochastic quantize")
    assert torch.equal(state, want_state), "a different number of random draws"
    want_packed, _ = run(fmt.pack, "reference")
    assert_bitwise_equal(want_packed.unpack(backend="reference"), want, "reference unpack")
    packed, state = run(fmt.pack, path)
    assert torch.equal(state, want_state), "pack took a different number of random draws"
    check_packed(packed, fmt, x, axis)
    assert_same_payload(packed, want_packed, f"{path} stochastic pack")
    assert_bitwise_equal(packed.unpack(backend=path), want, f"{path} stochastic unpack")


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("spec", COMPILED_STOCHASTIC_SPECS)
@budget(10)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_cpu_backend_stochastic_rounding_agrees(backend, spec, data, seed):
    case = data.draw(cases(st.just(spec), max_numel=600, empty=False), label="case")
    check_stochastic(case, backend, seed)


@pytest.mark.slow
@needs_triton
@budget(80)
@given(
    case=cases(PATH_SPECS, max_numel=240, device=TRITON_DEVICE, empty=False),
    seed=st.integers(0, 2**31),
)
def test_triton_stochastic_rounding_agrees(case, seed):
    check_stochastic(case, "triton", seed)


# ----------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["bfp8", "bfp16"])
@pytest.mark.parametrize("shape, axis", [((7, 1), 1), ((1, 7), 0)])
@pytest.mark.slow  # torch.compile and Triton kernels
def test_pack_along_an_axis_of_length_one(backend, spec, shape, axis):
    """One element per row: the stored codes are a strided slice of the padded blocks, which
    8- and 16-bit codes (whose stream is a byte view of them) must not leak into the stream."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    if unavailable_reason(backend, device):
        pytest.skip(unavailable_reason(backend, device))
    fmt = parse_format(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    packed = fmt.pack(x, axis=axis, backend=backend)
    check_packed(packed, fmt, x, axis)
    assert_same_payload(packed, fmt.pack(x, axis=axis, backend="reference"), backend)
    assert_bitwise_equal(packed.unpack(backend=backend), fmt.quantize(x, axis, backend="reference"))


@pytest.mark.parametrize("spec", ["bfp4", "fixed8", "fixed8f4", "e4m3"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_empty_tensors_pack_and_unpack_on_the_reference(spec, shape):
    """Empty tensors pack to empty streams, and unpacking them gives them back. Whatever the
    backend, they run on the reference (nothing to compute, and the fast paths assume
    an element), so this asserts that routing instead of comparing the reference with itself
    once per backend name (the per-path property tests draw no empty tensors)."""
    fmt = parse_format(spec)
    x = torch.empty(shape)
    for backend in (None, *BACKENDS):
        assert select_backend(x, backend) is reference, backend
    packed = fmt.pack(x, axis=-1, backend="reference")
    check_packed(packed, fmt, x, -1)  # the header, the payload's names and dtypes, nbytes == 0
    assert packed.nbytes == 0 and all(t.numel() == 0 for t in packed.payload.values())
    out = packed.unpack(backend="reference")
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert_bitwise_equal(out, fmt.quantize(x, -1, backend="reference"), "empty")


UNKNOWN_BACKEND = "'bogus'; choose one of auto, reference, compile, c, triton"
ONE_SPEC_PER_FORMAT = [*FLOAT_SPECS, "bfp4", "fixed8", "fixed8f4", "mxfp4_e2m1", "nvfp4"]


def test_one_spec_per_format_covers_the_registry():
    assert {type(parse_format(s)) for s in ONE_SPEC_PER_FORMAT} == set(registered_formats())


@pytest.mark.parametrize("spec", ONE_SPEC_PER_FORMAT)
@pytest.mark.parametrize("shape", [(3, 16), (0, 16)])
def test_an_unknown_backend_is_refused_by_every_format(spec, shape, monkeypatch):
    """``backend="bogus"`` (or ``DSQ_BACKEND=bogus``) is a ValueError naming the choices, on
    every format (the floating ones too, whose casts are the same on every path) and every
    call that takes a backend, empty tensors included."""
    fmt = parse_format(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    calls = {
        "quantize": lambda backend: fmt.quantize(x, 1, backend=backend),
        "pack": lambda backend: fmt.pack(x, 1, backend=backend),
        "unpack": lambda backend: fmt.pack(x, 1, backend="reference").unpack(backend=backend),
        "quantize_and_pack": lambda backend: fmt.quantize_and_pack(x, 1, fmt, 0, backend=backend),
        "quantize_chain": lambda backend: fmt.quantize_chain(x, 1, fmt, 0, backend=backend),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(f"unknown backend {UNKNOWN_BACKEND}")):
            call("bogus")
            pytest.fail(f"{spec}.{name} accepted backend='bogus'")
    monkeypatch.setenv("DSQ_BACKEND", "bogus")
    for name, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(f"unknown DSQ_BACKEND {UNKNOWN_BACKEND}")):
            call(None)
            pytest.fail(f"{spec}.{name} accepted DSQ_BACKEND=bogus")
