"""Packed storage (docs/spec.md §1.2): unpack(pack(x)) == quantize(x) bit for bit, and the bytes
held are what bits_per_value promises."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tensors import assert_bitwise_equal

from dsq.formats import exact, parse_format

ALL_SPECS = [
    "fp32",
    "fp16",
    "bf16",
    "e4m3",
    "e5m2",
    "bfp2",
    "bfp3",
    "bfp4",
    "bfp6",
    "bfp8",
    "bfp16",
    "bfp24",
    "bfp5e5b7",
    "bfp3e10b1",
    "bfp4e8b64",
    "fixed2",
    "fixed8",
    "fixed16",
    "fixed25",
    "fixed32",
    "fixed2f0",
    "fixed8f4",
    "fixed16f8",
    "fixed27f3",
    "fixed32f30",
]


def edge_tensor(shape=(6, 48), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)
    flat = x.view(-1)
    flat[:16] = 0.0
    flat[16] = -0.0
    flat[20:24] = torch.tensor([1e-40, -1e-42, 1.4e-45, -3e-39])
    flat[40] = 3.3e38
    flat[41] = -1e-30
    return x


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[50] = math.nan
    x.view(-1)[70] = math.inf
    x.view(-1)[90] = -math.inf
    return x


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("axis", [-1, 0])
def test_unpack_of_pack_equals_quantize(spec, nonfinite, axis):
    fmt = parse_format(spec)
    x = edge_tensor()
    if nonfinite:
        x = with_nonfinite(x)
    packed = fmt.pack(x, axis=axis, backend="reference")
    expected = fmt.quantize(x, axis, backend="reference")
    assert_bitwise_equal(packed.unpack(backend="reference"), expected)


# each format compiles its stochastic kernels: make test-fast keeps one bfp and one fixed format
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("bfp2", marks=pytest.mark.slow),
        "bfp4",
        "fixed8f4",
        pytest.param("fixed12", marks=pytest.mark.slow),
    ],
)
def test_stochastic_pack_matches_stochastic_quantize(spec):
    """The default path's stochastic pack, bytes and unpacked values, against the reference's
    pack and quantize with the same seed (not against the default path's own quantize)."""
    fmt = parse_format(spec)
    x = edge_tensor(seed=3)

    def seeded():
        return torch.Generator().manual_seed(9)

    p = fmt.pack(x, rounding="stochastic", generator=seeded())
    want = fmt.pack(x, rounding="stochastic", generator=seeded(), backend="reference")
    assert p.payload.keys() == want.payload.keys()
    for name, stream in want.payload.items():
        assert torch.equal(p.payload[name], stream), name
    q = fmt.quantize(x, rounding="stochastic", generator=seeded(), backend="reference")
    assert_bitwise_equal(p.unpack(), q)


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 32), (4096,), (10, 45)])
def test_nbytes_is_within_bits_per_value(spec, shape):
    """nbytes <= numel * bits_per_value / 8 + a small constant when the axis length is a multiple
    of the block; otherwise each row's partial block adds one exponent (docs/formats.md)."""
    fmt = parse_format(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    packed = fmt.pack(x, backend="reference")
    bound = x.numel() * fmt.bits_per_value / 8
    block = getattr(fmt, "block", None)
    if block is not None:  # BFP: exactly the mantissa bits plus E bits per (row, block)
        n = shape[-1]
        rows = x.numel() // n
        exps = rows * math.ceil(n / block)
        assert packed.nbytes == math.ceil(x.numel() * fmt.man_bits / 8) + math.ceil(
            exps * fmt.exp_bits / 8
        )
        if n % block:
            bound += rows * fmt.exp_bits / 8
    assert packed.nbytes <= bound + 2, (packed.nbytes, bound)
    if fmt.bits_per_value < 32:
        assert packed.nbytes < x.numel() * 4  # really smaller than float32


def test_pack_really_shrinks_memory():
    x = torch.randn(1 << 16)
    packed = parse_format("bfp4").pack(x, backend="reference")
    assert packed.nbytes == (1 << 16) * 4 // 8 + (1 << 16) // 16  # 4 bits + 1 byte per 16
    assert packed.nbytes * 7 <= x.numel() * x.element_size()  # 7x fewer bytes than fp32


def test_static_fixed_nan_mask_only_when_needed():
    fmt = parse_format("fixed8f4")
    assert "nan_mask" not in fmt.pack(torch.randn(100)).payload
    x = torch.randn(100)
    x[7] = math.inf
    packed = fmt.pack(x)
    assert "nan_mask" in packed.payload and math.isnan(packed.unpack()[7].item())


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 8, 9, 13, 16, 24, 31, 32])
def test_pack_bits_layout(width):
    """Stream bit b is bit (b % 8) of byte b // 8; code i occupies bits [i w, (i + 1) w)."""
    g = torch.Generator().manual_seed(width)
    codes = torch.randint(0, 2**width, (37,), generator=g, dtype=torch.int64)
    stream = exact.pack_bits(codes, width)
    assert stream.numel() == math.ceil(37 * width / 8)
    bits = "".join(format(b, "08b")[::-1] for b in stream.tolist())  # LSB first per byte
    for i, code in enumerate(codes.tolist()):
        assert int(bits[i * width : (i + 1) * width][::-1], 2) == code
    assert torch.equal(exact.unpack_bits(stream, width, 37), codes)


def test_bfp_payload_layout_by_hand():
    """bfp4 of docs/spec.md §1.1's example: exponent byte e + 127 = 128; sign-magnitude codes."""
    x = torch.tensor([0.3, -1.7, 0.05, 2.9] + [0.0] * 12)
    p = parse_format("bfp4").pack(x, backend="reference")
    assert p.payload["exponents"].tolist() == [128]
    # q = [1, -3, 0, 6, 0...] -> codes 0b0001, 0b1011, 0, 0b0110: bytes (c0 | c1 << 4), ...
    assert p.payload["mantissas"].tolist()[:2] == [0x01 | 0xB << 4, 0x00 | 0x6 << 4]
    nan_block = parse_format("bfp4").pack(torch.tensor([math.nan] + [1.0] * 15))
    assert nan_block.payload["exponents"].tolist() == [255]
