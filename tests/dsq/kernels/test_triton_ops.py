"""The Triton launches as torch custom ops (dsq/kernels/triton_ops.py): every ``dsq::triton_*``
op passes ``torch.library.opcheck`` (schema, fake kernel against the launch's outputs, autograd
registration, ahead-of-time dispatch) and a function calling a format's Triton kernels traces
under torch.compile as one graph. Without a GPU the launches run under the Triton interpreter."""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import dsq.kernels.bfp as bfp_kernels  # noqa: E402
import dsq.kernels.mx as mx_kernels  # noqa: E402
from dsq.formats import parse_format  # noqa: E402

pytestmark = pytest.mark.slow  # the interpreter runs each launch in Python

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def x_of(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@functools.cache
def cases():
    x, u = x_of(96), torch.rand(96, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    m, e = bfp_kernels.bfp_pack(x, None, 48, 4, 8, 16)
    ints, mask = bfp_kernels.fixed_pack(x, None, 8, 4)
    codes = torch.randint(0, 16, (37,), dtype=torch.uint8).to(DEVICE)
    rows = x_of(6, 40)
    mx_codes, mx_scales = mx_kernels.mx_blocks(rows, 32, (8, 3, -6, 8, 448.0, False), True)
    return {
        "bfp_quantize_blocks": (x, u, 48, 4, 8, 16),
        "bfp_quantize_global": (x, None, 6, 8),
        "bfp_pack": (x, None, 48, 3, 8, 16),
        "pack_codes": (codes, 4),
        "bfp_unpack": (m, e, 96, 48, 4, 8, 16, torch.device(DEVICE)),
        "fixed_quantize": (x, u, 8, 4),
        "fixed_pack": (x, None, 8, 4),
        "fixed_unpack": (ints, mask, 96, 8, 4, torch.device(DEVICE)),
        "bfp_quantize_and_pack": (x_of(2, 32, 16), [8, 8, 16], [2, 8, 16]),
        "bfp_quantize_chain": (x_of(4, 32), 16, 8, 8, 8, 16),
        "mx_values": (rows, 32, 8, 3, -6, 8, 448.0, False),
        "mx_codes": (rows, 32, 8, 3, -6, 8, 448.0, False),
        "nvfp4_values": (rows, torch.ones(1, device=DEVICE)),
        "nvfp4_codes": (rows, torch.ones(1, device=DEVICE)),
        "mx_decode": (
            mx_codes.reshape(-1),
            torch.arange(256.0, device=DEVICE),
            torch.ones(mx_scales.numel(), device=DEVICE),
            6,
            40,
            32,
        ),  # fmt: skip
    }


# the ops' names; their arguments are built when a test runs (the interpreter runs launches)
OPS = ("bfp_quantize_blocks", "bfp_quantize_global", "bfp_pack", "pack_codes", "bfp_unpack",
       "fixed_quantize", "fixed_pack", "fixed_unpack", "bfp_quantize_and_pack",
       "bfp_quantize_chain", "mx_values", "mx_codes", "nvfp4_values", "nvfp4_codes",
       "mx_decode")  # fmt: skip


@pytest.mark.parametrize("name", OPS)
def test_every_triton_launch_is_an_op_whose_fake_agrees(name):
    assert sorted(cases()) == sorted(OPS)
    op = getattr(torch.ops.dsq, f"triton_{name}").default
    torch.library.opcheck(op, cases()[name])


def test_a_bfp_stash_on_the_triton_backend_traces_as_one_graph():
    fmt = parse_format("bfp4")
    x = x_of(8, 48)

    def round_trip(x):
        return fmt.pack(x, axis=-1, backend="triton").unpack(backend="triton")

    eager = round_trip(x)
    explained = torch._dynamo.explain(round_trip)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert "torch.ops.dsq.triton_bfp_pack" in explained.graphs[0].code
    compiled = torch.compile(round_trip, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(compiled(x).view(torch.int32), eager.view(torch.int32))
