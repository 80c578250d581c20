"""The CPU backends against the reference, bit for bit: quantize, the packed bytes themselves,
and unpack; every test runs twice, on the c backend (the C kernels where they hold the format)
and on the compile backend (the torch.compile kernels alone);
tests/dsq/kernels/test_c_kernels.py covers the C kernels' edges."""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import assert_bitwise_equal
from test_packing import edge_tensor, with_nonfinite

from dsq.formats import exact, parse_format
from dsq.formats.backends import unavailable_reason

pytestmark = pytest.mark.slow

# Each format compiles once (a few seconds each on 2 cores): the list covers every code path:
# word packing (m divides 64, or fits a 64-bit word), the byte gather (odd m > 8), E != 8,
# odd and long blocks, whole-tensor blocks with m <= 24 and m > 24, static fixed up to 32 bits.
SPECS = [
    "bfp2",
    "bfp3",
    "bfp4",
    "bfp6",
    "bfp8",
    "bfp11",
    "bfp24e10b33",
    "bfp5e4b3",
    "fixed8",
    "fixed16",
    "fixed32",
    "fixed8f4",
    "fixed32f30",
    "fixed2f0",
]


@pytest.fixture(params=["c", "compile"])
def backend(request):
    """The CPU backend under test (a test taking it runs once per backend)."""
    if unavailable_reason(request.param, "cpu"):
        pytest.skip(unavailable_reason(request.param, "cpu"))
    return request.param


@pytest.fixture
def both(backend):
    """fn(name) -> (fn("reference"), fn(the backend under test))."""
    return lambda fn: (fn("reference"), fn(backend))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("case", ["finite", "nonfinite", "partial", "transposed", "half"])
def test_backend_equals_reference(spec, case, both, backend):
    fmt = parse_format(spec)
    x, axis = edge_tensor((6, 48)), -1
    if case == "nonfinite":
        x = with_nonfinite(x)
    elif case == "partial":
        x, axis = edge_tensor((5, 7, 37), seed=2), 1  # axis of 7: one partial block per row
    elif case == "transposed":
        x, axis = edge_tensor((40, 24), seed=4).t(), 0
    elif case == "half":
        x = edge_tensor((6, 48), seed=5).clamp(-6e4, 6e4).half()
    ref_q, fast_q = both(lambda b: fmt.quantize(x, axis=axis, backend=b))
    assert_bitwise_equal(fast_q, ref_q, f"{spec} quantize")
    ref_p, fast_p = both(lambda b: fmt.pack(x, axis=axis, backend=b))
    assert ref_p.payload.keys() == fast_p.payload.keys()
    for name in ref_p.payload:
        assert torch.equal(fast_p.payload[name], ref_p.payload[name]), f"{spec} {name} bytes"
    assert_bitwise_equal(fast_p.unpack(backend=backend), ref_q, f"{spec} unpack")


@pytest.mark.parametrize("spec", ["bfp2", "bfp4", "fixed8f4", "fixed12"])
def test_backend_stochastic_equals_reference(spec, both):
    fmt = parse_format(spec)
    x = edge_tensor((8, 64), seed=7)
    ref_q, fast_q = both(
        lambda b: fmt.quantize(
            x, rounding="stochastic", generator=torch.Generator().manual_seed(5), backend=b
        )
    )
    assert_bitwise_equal(fast_q, ref_q)
    ref_p, fast_p = both(
        lambda b: fmt.pack(
            x, rounding="stochastic", generator=torch.Generator().manual_seed(5), backend=b
        )
    )
    for name in ref_p.payload:
        assert torch.equal(fast_p.payload[name], ref_p.payload[name])


def test_stochastic_underflow_corner(backend):
    """A tiny negative value far below its block's max: v underflows in float32. With u = 0,
    floor(v + u) = -1 exactly; the float32 path must not round it to 0."""
    fmt = parse_format("bfp2")
    x = torch.tensor([1e30, -1e-30] + [0.0] * 14).repeat(4096, 1)
    g = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    ref_q = fmt.quantize(x, rounding="stochastic", generator=g(), backend="reference")
    fast_q = fmt.quantize(x, rounding="stochastic", generator=g(), backend=backend)
    assert_bitwise_equal(fast_q, ref_q)


@pytest.mark.parametrize("spec, axis", [("bfp4", -1), ("bfp4", 0), ("fixed16", 0), ("fixed8f4", 0)])
def test_new_batch_lengths_reuse_the_compiled_kernels(spec, axis, backend):
    """Translation batches vary in length: new token counts (rows, or blocks along the tokens
    for a stash) must not recompile quantize, pack or unpack."""
    import torch._dynamo.utils as dynamo_utils

    fmt = parse_format(spec)

    def run(tokens):
        x = torch.randn(tokens, 64)
        fmt.quantize(x, axis=axis, backend=backend)
        fmt.pack(x, axis=axis, backend=backend).unpack(backend=backend)

    for tokens in (40, 77, 100):  # warm up, including the first dynamic recompile
        run(tokens)
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    for tokens in (123, 301, 517, 1000):
        run(tokens)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("kernels", ["c", "compile"])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12])
def test_stream_stage_equals_reference_pack_bits(width, kernels):
    """The bit packing alone, every narrow width (one-byte codes read as int64 words below 8
    bits, the byte gather above), on counts that leave a partial word and a partial byte."""
    from dsq.formats import backend_compile as compiled

    if kernels == "c" and unavailable_reason("c", "cpu"):
        pytest.skip(unavailable_reason("c", "cpu"))
    if kernels == "c":
        from dsq.formats import backend_c  # packs one-byte codes in C

        pack_codes = backend_c.pack_codes
    else:
        pack_codes = compiled.code_stream

    g = torch.Generator().manual_seed(width)
    dtype = torch.uint8 if width <= 8 else torch.int16
    for count in (1, 7, 8, 9, 4099):
        codes = torch.randint(0, 2**width, (count,), generator=g).to(dtype)
        stream = pack_codes(codes, width)
        assert torch.equal(stream, exact.pack_bits(codes, width)), (width, count)
        unpacked = compiled.unpack_codes(stream, width, count)
        assert torch.equal(unpacked.to(torch.int64), codes.to(torch.int64)), (width, count)
    whole = torch.randint(0, 2**width, (17,), generator=g).to(dtype)
    sliced = whole[1:9]  # 8 codes at an offset of 1: no int64 view of it in place
    assert torch.equal(pack_codes(sliced, width), exact.pack_bits(sliced, width))


def test_auto_picks_the_c_backend_on_cpu(monkeypatch):
    from dsq.formats import default_backend

    if unavailable_reason("c", "cpu"):
        pytest.skip(unavailable_reason("c", "cpu"))
    monkeypatch.delenv("DSQ_BACKEND", raising=False)
    assert default_backend("cpu") == "c"
