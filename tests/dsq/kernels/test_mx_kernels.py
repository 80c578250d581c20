"""The C kernels of the MX formats and NVFP4 (dsq/kernels/mx_cpu.c, docs/formats.md "The C
kernels"): bit for bit the reference at every float32 binade, on 1 and 2 threads, their ops
checked at the boundary with fake kernels for torch.compile, and built apart per source text.
tests/dsq/formats/test_mx_formats.py compares every backend with the reference on its edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tensors import assert_bitwise_equal

from dsq.formats import parse_format
from dsq.formats.backends import unavailable_reason
from dsq.kernels import cpu, mx_cpu

pytestmark = pytest.mark.skipif(
    unavailable_reason("c", "cpu") is not None or mx_cpu.build_failure() is not None,
    reason=str(unavailable_reason("c", "cpu") or mx_cpu.build_failure()),
)
SPECS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8", "nvfp4"]


def every_binade(seed: int) -> torch.Tensor:
    """Rows of 96 float32 values, each row's values within a few binades of 2^e for e from -149
    to 127 (subnormals, the largest finite values), random mantissas and signs, zeros of both
    signs; a NaN and an infinity in two rows."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.arange(-149, 128, 3).double()
    spread = torch.randint(-6, 1, (len(exponents), 96), generator=g).double()
    mantissas = 1 + torch.rand(len(exponents), 96, generator=g, dtype=torch.float64)
    signs = torch.where(torch.rand(len(exponents), 96, generator=g) < 0.5, -1.0, 1.0).double()
    x = (signs * mantissas * torch.exp2((exponents[:, None] + spread).clamp(-149, 127))).float()
    x[:, 7] = 0.0
    x[:, 8] = -0.0
    x[10, 50] = math.nan
    x[20, 3] = -math.inf
    return x


@pytest.mark.parametrize("spec", [*SPECS, "mxfp8_e4m3b16", "mxfp4_e2m1b5"])
def test_the_kernels_equal_the_reference_at_every_binade(spec):
    fmt = parse_format(spec)
    x = every_binade(1)
    for axis in (1, 0):
        expected = fmt.quantize(x, axis, backend="reference")
        assert_bitwise_equal(fmt.quantize(x, axis, backend="c"), expected, spec)
        packed, reference = fmt.pack(x, axis, backend="c"), fmt.pack(x, axis, backend="reference")
        for name, stream in reference.payload.items():
            assert torch.equal(packed.payload[name], stream), (spec, name)
        assert_bitwise_equal(packed.unpack(backend="c"), expected, spec)


@pytest.mark.parametrize("spec", ["mxfp4_e2m1", "mxfp6_e3m2", "nvfp4"])
def test_results_do_not_depend_on_the_thread_count(spec):
    fmt = parse_format(spec)
    x = torch.randn(300, 700, generator=torch.Generator().manual_seed(2))  # above the parallel size
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fmt.quantize(x, backend="c"), fmt.pack(x, 0, backend="c").payload["elements"]
        torch.set_num_threads(2)
        two = fmt.quantize(x, backend="c"), fmt.pack(x, 0, backend="c").payload["elements"]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


E4M3 = (8, 3, -6, 8, 448.0, False)


def BYTES(n: int) -> torch.Tensor:  # noqa: N802 (reads as a constructor in the table below)
    return torch.zeros(n, dtype=torch.uint8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: mx_cpu.mx_quantize(torch.zeros(2, 32, dtype=torch.float16), 32, E4M3),
         "dsq::mx_quantize needs a float32 CPU tensor, got float16 on cpu"),
        (lambda: mx_cpu.mx_quantize(torch.zeros(64), 32, E4M3),
         "dsq::mx_quantize needs a 2-D tensor, got shape [64]"),
        (lambda: mx_cpu.mx_pack(torch.zeros(2, 32), 32, (5, *E4M3[1:])),
         "dsq::mx_pack needs bits of 4, 6 or 8, got 5"),
        (lambda: mx_cpu.mx_decode(BYTES(3), BYTES(2), torch.zeros(256), 2, 32, 32, 8),
         "dsq::mx_decode: a stream of 3 bytes holds fewer than 64 codes"),
        (lambda: mx_cpu.nvfp4_quantize(torch.zeros(2, 16), torch.ones(2)),
         "dsq::nvfp4_quantize needs a tensor scale of one value, got 2"),
    ],
)  # fmt: skip
def test_the_ops_check_their_arguments_in_one_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value).splitlines()[0] == message


def test_the_fake_kernels_give_the_kernels_shapes():
    x = torch.randn(3, 70)
    s = mx_cpu.nvfp4_scale(x)
    cases = [
        (torch.ops.dsq.mx_quantize.default, (x, 32, *E4M3)),
        (torch.ops.dsq.mx_pack.default, (x, 32, 4, 1, 0, 2, 6.0, False)),
        (torch.ops.dsq.nvfp4_pack.default, (x, s)),
        (torch.ops.dsq.nvfp4_quantize.default, (x, s)),
    ]
    for op, args in cases:
        real = op(*args)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in fake], op


def test_torch_compile_traces_the_ops_without_a_graph_break():
    x = torch.randn(4, 64)

    def step(t):
        s = mx_cpu.nvfp4_scale(t)
        return mx_cpu.mx_quantize(t * 2, 32, E4M3) + mx_cpu.nvfp4_quantize(t, s)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), step(x))


def test_an_edited_source_builds_apart(tmp_path):
    """The build folder's name hashes the sources: an edited mx_cpu.c is another build."""
    edited = tmp_path / "mx_cpu.c"
    edited.write_bytes(mx_cpu.SOURCES[1].read_bytes() + b"\n")
    flags = [*cpu.FLAGS, *cpu.VARIANTS[0]]
    before = cpu.build_key(mx_cpu.SOURCES, flags)
    after = cpu.build_key((mx_cpu.SOURCES[0], edited, mx_cpu.SOURCES[2]), flags)
    assert before != after
    assert before == cpu.build_key(mx_cpu.SOURCES, flags)
    assert before != cpu.build_key(cpu.SOURCES, flags)  # and apart from the BFP kernels'


PAIRS = [
    ("mxfp8_e4m3", "mxfp4_e2m1"),
    ("mxfp8_e4m3", "mxfp6_e3m2"),
    ("mxfp8_e4m3", "mxfp8_e4m3"),
    ("nvfp4", "nvfp4"),
    ("nvfp4", "mxfp6_e3m2"),
    ("mxint8b16", "nvfp4"),
]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("shape", [(40, 64), (3, 37, 50), (2, 70, 33)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_fused_pair_equals_the_two_calls(pair, shape, layout, monkeypatch):
    """fmt.quantize_and_pack(x, last, stash, before) on the c backend runs its one kernel (a
    partial last block of rows and of columns, an operand seen through a transpose) and equals
    fmt.quantize and stash.pack on the reference, payload byte for byte."""
    from dsq.formats import backends

    fmt, stash = (parse_format(s) for s in pair)
    x = every_binade(3)[: math.prod(shape) // 96 + 1].reshape(-1)[: math.prod(shape)]
    x = x.reshape(shape)
    if layout == "transposed":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    calls = []
    original = backends.kernel(fmt.family, "quantize_and_pack", "c")
    spy = lambda *args: calls.append(1) or original(*args)  # noqa: E731
    monkeypatch.setitem(backends._KERNELS, ("c", fmt.family, "quantize_and_pack"), spy)
    last, before = x.dim() - 1, x.dim() - 2
    values, packed = fmt.quantize_and_pack(x, last, stash, before, backend="c")
    assert calls == [1]
    assert_bitwise_equal(values, fmt.quantize(x, last, backend="reference"))
    expected = stash.pack(x, before, backend="reference")
    assert packed.payload.keys() == expected.payload.keys()
    for name, stream in expected.payload.items():
        assert torch.equal(packed.payload[name], stream), name
    assert_bitwise_equal(packed.unpack(), stash.quantize(x, before, backend="reference"))
