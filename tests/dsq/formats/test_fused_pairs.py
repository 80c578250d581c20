"""The fused pairs of the engine, bit for bit against the two calls they replace:
``quantize_and_pack`` (a GEMM input and its stash, from one read) and ``quantize_chain`` (an
incoming gradient as fetched, then as a GEMM input), on every backend: the reference (two calls),
c, compile and triton (the Triton kernels under ``TRITON_INTERPRET=1`` on CPU, conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import assert_bitwise_equal
from test_packing import edge_tensor, with_nonfinite

from dsq.formats import backends, parse_format
from dsq.formats.backends import default_backend, unavailable_reason

pytestmark = pytest.mark.slow  # compiles kernels and runs the Triton interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _skip_unless(name: str, device: str = "cpu"):
    reason = unavailable_reason(name, device)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


# the default CPU backend (DSQ_BACKEND's, else auto's) has fused kernels
needs_fused_cpu = pytest.mark.skipif(
    default_backend("cpu") == "reference", reason="the CPU backend in use has no fused kernels"
)
BACKENDS = [
    "reference",
    pytest.param("c", marks=_skip_unless("c")),
    pytest.param("compile", marks=_skip_unless("compile")),
    pytest.param("triton", marks=_skip_unless("triton", DEVICE)),
]

# (tensor shape, what it exercises): rows that fill whole stash blocks, a partial last block
# (padding not stored), a leading batch dimension (attention operands), a single row
SHAPES = [(48, 32), (37, 48), (3, 21, 32), (1, 48)]
# and for quantize_and_pack, a partial last block of the quantizer along the rows (an attention
# product over 34 tokens), alone and in a batch of matrices
PAIR_SHAPES = [*SHAPES, (40, 34), (3, 21, 34)]


def fuses(backend: str, shape, pair) -> bool:
    """Whether ``backend`` runs the pair in its fused kernel (docs/formats.md, "Fused pairs"):
    every fast backend when the quantizer's blocks tile the rows; with a partial last block, the
    c backend only, where its kernels hold both formats (stash codes of at most 8 bits)."""
    fmt, stash = (parse_format(s) for s in pair)
    if backend == "reference":
        return False
    if shape[-1] % fmt.block == 0:
        return True
    return backend == "c" and stash.man_bits <= 8


def _tensor(shape, nonfinite: bool, backend: str = "reference") -> torch.Tensor:
    x = edge_tensor(shape, seed=sum(shape))
    x = with_nonfinite(x) if nonfinite and x.numel() > 90 else x
    return x.to(DEVICE) if backend == "triton" else x


def _spy(monkeypatch, backend: str, name: str) -> list[int]:
    """Count the calls of the backend's fused kernel (``quantize_and_pack`` or
    ``quantize_chain`` of the bfp family), so that a test knows it ran (the reference has
    none: its pairs are the two calls)."""
    calls: list[int] = []
    if backend == "reference":
        return calls
    original = backends.kernel("bfp", name, backend)

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setitem(backends._KERNELS, (backend, "bfp", name), spy)
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", PAIR_SHAPES)
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("pair", [("bfp8", "bfp2"), ("bfp8", "bfp4"), ("bfp4e6b8", "bfp11b4")])
def test_quantize_and_pack_equals_the_two_calls(backend, shape, nonfinite, pair, monkeypatch):
    fmt, stash = (parse_format(s) for s in pair)
    x = _tensor(shape, nonfinite, backend)
    last, before = x.dim() - 1, x.dim() - 2
    calls = _spy(monkeypatch, backend, "quantize_and_pack")
    values, packed = fmt.quantize_and_pack(x, last, stash, before, backend=backend)
    assert bool(calls) == fuses(backend, shape, pair)  # the fused kernel ran where it applies
    expected = stash.pack(x, before, backend="reference")
    assert_bitwise_equal(values, fmt.quantize(x, last, backend="reference"), "values")
    assert (packed.fmt, packed.shape, packed.dtype, packed.axis) == (
        stash,
        expected.shape,
        expected.dtype,
        expected.axis,
    )
    for name, stream in expected.payload.items():
        assert torch.equal(packed.payload[name], stream), name
    assert_bitwise_equal(packed.unpack(), stash.quantize(x, before, backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("pair", [("fixed16", "bfp8"), ("fixed8", "bfp3"), ("fixed24", "bfp6e5b8")])
@pytest.mark.parametrize("scale", [1.0, 1e-36])
def test_quantize_chain_equals_the_two_calls(backend, shape, nonfinite, pair, scale, monkeypatch):
    first, second = (parse_format(s) for s in pair)
    x = _tensor(shape, nonfinite, backend) * scale  # 1e-36: the power is near the subnormals
    calls = _spy(monkeypatch, backend, "quantize_chain")
    g, g2 = first.quantize_chain(x, 0, second, x.dim() - 1, backend=backend)
    assert bool(calls) == (backend != "reference")
    expected = first.quantize(x, 0, backend="reference")
    assert_bitwise_equal(g, expected, "first")
    assert_bitwise_equal(g2, second.quantize(expected, x.dim() - 1, backend="reference"), "second")


@needs_fused_cpu
@pytest.mark.parametrize(
    "fmt, axis, stash, stash_axis, why",
    [
        ("bfp8", 0, "bfp2", 1, "the quantizer's blocks are not along the last axis"),
        ("fixed16", 1, "bfp2", 0, "a whole-tensor quantizer"),
        ("bfp8", 1, "fixed8", 0, "a whole-tensor stash"),
        ("bfp8", 1, "e4m3", 0, "a stash that is not BFP"),
        ("bfp8b5", 1, "bfp11", 0, "blocks of 5 do not tile 32 columns (C: 11-bit stash codes)"),
    ],
)
def test_pairs_the_kernel_does_not_cover_run_as_two_calls(
    fmt, axis, stash, stash_axis, why, monkeypatch
):
    fmt, stash = parse_format(fmt), parse_format(stash)
    x = _tensor((40, 32), False)
    calls = _spy(monkeypatch, default_backend("cpu"), "quantize_and_pack")
    values, packed = fmt.quantize_and_pack(x, axis, stash, stash_axis)
    assert not calls, why
    # the values against the reference (not the backend's own unfused calls)
    assert_bitwise_equal(values, fmt.quantize(x, axis, backend="reference"))
    expected = stash.pack(x, stash_axis, backend="reference")
    assert (packed.fmt, packed.axis) == (stash, expected.axis)
    for name, stream in expected.payload.items():
        assert torch.equal(packed.payload[name], stream), name
    assert_bitwise_equal(packed.unpack(), stash.quantize(x, stash_axis, backend="reference"))


@needs_fused_cpu
def test_new_batch_lengths_reuse_the_fused_kernels():
    """Token counts vary from batch to batch; they must not compile a kernel each (two sizes are
    compiled apart at most: one block of rows, and the dynamic case)."""
    fmt, stash = parse_format("bfp8"), parse_format("bfp3")
    for n in (40, 56):  # warm up: one block is specialised, more than one is dynamic
        fmt.quantize_and_pack(torch.randn(n, 32), 1, stash, 0)
        parse_format("fixed16").quantize_chain(torch.randn(n, 32), 0, fmt, 1)
    torch._dynamo.utils.counters.clear()
    for n in (72, 99, 130, 301):
        fmt.quantize_and_pack(torch.randn(n, 32), 1, stash, 0)
        parse_format("fixed16").quantize_chain(torch.randn(n, 32), 0, fmt, 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("which", ["first", "second", "both"])
def test_stochastic_pairs_are_the_two_calls_in_order(which, monkeypatch):
    """A pair with stochastic rounding at either point is the two calls, drawing noise in their
    order from each point's generator; the fused kernels (nearest only) do not run."""
    x = _tensor((48, 32), False)
    r1 = "stochastic" if which in ("first", "both") else "nearest"
    r2 = "stochastic" if which in ("second", "both") else "nearest"
    bfp8, bfp2, fixed16 = parse_format("bfp8"), parse_format("bfp2"), parse_format("fixed16")
    calls = _spy(monkeypatch, default_backend("cpu"), "quantize_and_pack")

    def gens():
        g = torch.Generator().manual_seed(7)
        return g, g  # one generator for both points, as the engine's config shares one

    g1, g2 = gens()
    values, packed = bfp8.quantize_and_pack(
        x, 1, bfp2, 0, rounding=r1, stash_rounding=r2, generator=g1, stash_generator=g2
    )
    assert not calls
    g1, g2 = gens()  # the expected values: the two calls on the reference, in the same order
    assert_bitwise_equal(values, bfp8.quantize(x, 1, r1, g1, backend="reference"))
    assert_bitwise_equal(packed.unpack(), bfp2.quantize(x, 0, r2, g2, backend="reference"))
    g1, g2 = gens()
    first, second = fixed16.quantize_chain(
        x, 0, bfp8, 1, rounding=r1, second_rounding=r2, generator=g1, second_generator=g2
    )
    g1, g2 = gens()
    expected = fixed16.quantize(x, 0, r1, g1, backend="reference")
    assert_bitwise_equal(first, expected)
    assert_bitwise_equal(second, bfp8.quantize(expected, 1, r2, g2, backend="reference"))
