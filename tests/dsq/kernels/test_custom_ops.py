"""The C kernels as torch custom ops (dsq/kernels/bfp_ops.cpp, ``torch.ops.dsq.*``): torch.compile
traces a function calling them as one graph, with the eager result bit for bit; the profiler
lists them by name; their fake kernels give the outputs' shapes and dtypes without running them;
and a tensor of the wrong dtype, device or layout is a one-line ValueError at the boundary."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dsq.kernels import cpu as c_kernels

pytestmark = pytest.mark.skipif(
    c_kernels.build_failure() is not None, reason=str(c_kernels.build_failure())
)


def quantize_twice(x: torch.Tensor) -> torch.Tensor:
    """A function calling the C quantizer through its public wrapper, with torch ops around it."""
    q = c_kernels.bfp_quantize(x.reshape(-1, 16), 4, 8)
    return c_kernels.fixed_quantize(q * 3.0, 8, 8).reshape(x.shape)


@pytest.mark.slow
def test_torch_compile_traces_the_op_without_a_graph_break():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(quantize_twice)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    assert "torch.ops.dsq.bfp_quantize.default" in code
    assert "torch.ops.dsq.fixed_quantize.default" in code
    compiled = torch.compile(quantize_twice, fullgraph=True, dynamic=False)
    eager = quantize_twice(x)
    out = compiled(x)
    assert torch.equal(out.view(torch.int32), eager.view(torch.int32))


def test_the_profiler_lists_the_op_by_name():
    x = torch.randn(4, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        c_kernels.bfp_quantize(x, 4, 8)
        c_kernels.pack_codes(torch.zeros(32, dtype=torch.uint8), 3)
    names = {event.key for event in profile.key_averages()}
    assert {"dsq::bfp_quantize", "dsq::pack_codes"} <= names


def test_fake_kernels_give_shapes_and_dtypes():
    f32, u8 = torch.float32, torch.uint8
    with FakeTensorMode():
        x2, x3 = torch.empty(6, 16), torch.empty(3, 32, 10)
        codes = torch.empty(37, dtype=u8)
        cases = [
            (c_kernels.bfp_quantize(x2, 4, 8), [((6, 16), f32)]),
            (c_kernels.bfp_quantize_columns(x3, 16, 4, 8), [((3, 32, 10), f32)]),
            (c_kernels.bfp_codes(x2, 4, 8), [((6, 16), u8), ((6,), u8)]),
            (c_kernels.fixed_quantize(x3, 8, 8), [((3, 32, 10), f32)]),
            (c_kernels.fixed_then_bfp(x2, 8, 8, 4, 8, 16), [((6, 16), f32)] * 2),
            (
                c_kernels.bfp_quantize_and_pack(x3, 16, 8, 8, 5, 4, 8, True),
                [((3, 32, 10), f32), ((3 * 10 * 32 * 4 // 8,), u8), ((3, 10, 2), u8)],
            ),
            (
                c_kernels.bfp_quantize_and_pack(x3, 16, 8, 8, 5, 3, 8, False),
                [((3, 32, 10), f32), ((3, 10, 32), u8), ((3, 10, 2), u8)],
            ),
            (c_kernels.pack_codes(codes, 3), [((14,), u8)]),
            (c_kernels.bfp_decode(codes, codes, 2, 20, 16, 4, 8), [((2, 20), f32)]),
        ]
    for outputs, expected in cases:
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        assert [(tuple(t.shape), t.dtype) for t in outputs] == expected


def test_the_fake_kernels_agree_with_the_kernels():
    """torch.library.opcheck: schema, fake kernel and the kernel's outputs agree."""
    g = torch.Generator().manual_seed(1)
    x2, x3 = torch.randn(4, 16, generator=g), torch.randn(2, 16, 8, generator=g)
    codes = torch.randint(0, 8, (40,), dtype=torch.uint8, generator=g)
    calls = [
        (torch.ops.dsq.bfp_quantize.default, (x2, 4, 8)),
        (torch.ops.dsq.bfp_quantize_columns.default, (x3, 16, 4, 8)),
        (torch.ops.dsq.bfp_codes.default, (x2, 4, 8)),
        (torch.ops.dsq.fixed_then_bfp.default, (x2, 8, 8, 4, 8, 16)),
        (torch.ops.dsq.bfp_quantize_and_pack.default, (x3, 16, 8, 8, 8, 4, 8, True)),
        (torch.ops.dsq.pack_codes.default, (codes, 3)),
        (torch.ops.dsq.bfp_decode.default, (codes, codes, 2, 16, 16, 4, 8)),
    ]
    tests = ("test_schema", "test_faketensor")
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=tests)


@pytest.mark.parametrize(
    "shape,call",
    [
        ((4, 16), lambda x: c_kernels.bfp_quantize(x, 4, 8)),
        ((2, 16, 2), lambda x: c_kernels.bfp_quantize_columns(x, 16, 4, 8)),
        ((4, 16), lambda x: c_kernels.bfp_codes(x, 4, 8)),
        ((64,), lambda x: c_kernels.fixed_quantize(x, 8, 8)),
        ((64,), lambda x: c_kernels.fixed_then_bfp(x, 8, 8, 4, 8, 16)),
        ((1, 16, 4), lambda x: c_kernels.bfp_quantize_and_pack(x, 16, 8, 8, 4, 4, 8, True)),
    ],
)
def test_a_wrong_dtype_device_or_layout_is_a_one_line_error(shape, call):
    x = torch.randn(shape)
    for wrong, got in (
        (x.to(torch.float16), "float16 on cpu"),
        (x.to("meta"), "float32 on meta"),
        (x.to_sparse(), "float32 on cpu (Sparse layout)"),
    ):
        with pytest.raises(
            ValueError, match=r"^dsq::\w+ needs a float32 CPU tensor, got "
        ) as error:
            call(wrong)
        assert str(error.value).endswith(f"got {got}") and "\n" not in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_tensor_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^dsq::bfp_quantize needs a float32 CPU tensor, got "):
        c_kernels.bfp_quantize(torch.zeros(4, 16, device="cuda"), 4, 8)


def test_codes_and_shapes_are_checked_at_the_boundary():
    with pytest.raises(ValueError, match=r"^dsq::pack_codes needs a uint8 CPU tensor, got int64"):
        c_kernels.pack_codes(torch.zeros(8, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"^dsq::pack_codes needs a width of 1 to 8 bits, got 9"):
        c_kernels.pack_codes(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match=r"^dsq::bfp_quantize needs a 2-D tensor, got shape"):
        c_kernels.bfp_quantize(torch.zeros(16), 4, 8)
    with pytest.raises(ValueError, match=r"^dsq::bfp_codes needs man_bits of 2 to 8, got 9$"):
        c_kernels.bfp_codes(torch.zeros(2, 16), 9, 8)  # codes of one byte each
    with pytest.raises(ValueError, match="60 values are not whole blocks of 16"):
        c_kernels.fixed_then_bfp(torch.zeros(60), 8, 8, 4, 8, 16)


# (call, message): an integer argument outside what the kernels hold (bfp_cpu.c's header:
# 2 <= m <= 23, 1 <= E <= 8, codes of m <= 8, blocks of at least 1)
BAD_ARGUMENTS = {
    "bfp_quantize m 30": (
        lambda t: c_kernels.bfp_quantize(t.x2, 30, 8),
        "dsq::bfp_quantize needs man_bits of 2 to 23, got 30",
    ),
    "bfp_quantize E 0": (
        lambda t: c_kernels.bfp_quantize(t.x2, 4, 0),
        "dsq::bfp_quantize needs exp_bits of 1 to 8, got 0",
    ),
    "columns block 0": (
        lambda t: c_kernels.bfp_quantize_columns(t.x3, 0, 4, 8),
        "dsq::bfp_quantize_columns needs block of at least 1, got 0",
    ),
    "columns m 1": (
        lambda t: c_kernels.bfp_quantize_columns(t.x3, 16, 1, 8),
        "dsq::bfp_quantize_columns needs man_bits of 2 to 23, got 1",
    ),
    "fixed w 24": (
        lambda t: c_kernels.fixed_quantize(t.flat, 24, 8),
        "dsq::fixed_quantize needs man_bits of 2 to 23, got 24",
    ),
    "chain E 9": (
        lambda t: c_kernels.fixed_then_bfp(t.flat, 8, 8, 4, 9, 16),
        "dsq::fixed_then_bfp needs s_exp of 1 to 8, got 9",
    ),
    "chain block 0": (
        lambda t: c_kernels.fixed_then_bfp(t.flat, 8, 8, 4, 8, 0),
        "dsq::fixed_then_bfp needs s_block of at least 1, got 0",
    ),
    "pair stash m 9": (
        lambda t: c_kernels.bfp_quantize_and_pack(t.x3, 16, 8, 8, 8, 9, 8, False),
        "dsq::bfp_quantize_and_pack needs p_man of 2 to 8, got 9",
    ),
    "pair m 30": (
        lambda t: c_kernels.bfp_quantize_and_pack(t.x3, 16, 30, 8, 8, 4, 8, True),
        "dsq::bfp_quantize_and_pack needs q_man of 2 to 23, got 30",
    ),
    "decode m 9": (
        lambda t: c_kernels.bfp_decode(t.codes, t.codes, 2, 16, 16, 9, 8),
        "dsq::bfp_decode needs man_bits of 2 to 8, got 9",
    ),
    "pack width 0": (
        lambda t: c_kernels.pack_codes(t.codes, 0),
        "dsq::pack_codes needs a width of 1 to 8 bits, got 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_format_the_kernels_do_not_hold_is_a_one_line_error(case):
    """Widths and block lengths are checked at the boundary (formerly bfp_quantize(x, 30, 8)
    returned wrong values): the op and its fake kernel (what torch.compile traces with) refuse
    them with the same one-line ValueError."""
    call, message = BAD_ARGUMENTS[case]
    for mode in (contextlib.nullcontext(), FakeTensorMode()):
        with mode:
            tensors = SimpleNamespace(
                x2=torch.zeros(4, 16),
                x3=torch.zeros(2, 16, 8),
                flat=torch.zeros(64),
                codes=torch.zeros(40, dtype=torch.uint8),
            )
            with pytest.raises(ValueError) as error:
                call(tensors)
        assert str(error.value) == message, type(mode).__name__


def test_the_ops_follow_torchs_thread_count():
    """Each call passes torch's thread count to the kernels: results on one and two threads are
    the same bits (above the kernels' parallel threshold)."""
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            runs.append(c_kernels.bfp_quantize(x, 4, 8))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32))


def _gemm_unavailable() -> str | None:
    from dsq.kernels import onednn

    return onednn.unavailable_reason()


@pytest.mark.skipif(_gemm_unavailable() is not None, reason=str(_gemm_unavailable()))
def test_the_gemm_ops_trace_check_and_have_fake_kernels():
    from dsq.kernels import onednn

    a = torch.randint(-8, 8, (1, 5, 7)).float()
    b = torch.randint(-8, 8, (1, 7, 3)).float().transpose(1, 2).contiguous().transpose(1, 2)

    def product(a, b):
        pa, _ = torch.ops.dsq.to_bf16.default(a, [1, 8, 8])
        pb, _ = torch.ops.dsq.to_bf16.default(b, [1, 8, 8])
        return torch.ops.dsq.gemm_bf16.default(pa, pb)[:, :5, :3]

    assert torch.equal(product(a, b), a @ b)
    explained = torch._dynamo.explain(product)(a, b)
    assert explained.graph_break_count == 0
    with FakeTensorMode():
        fb = torch.empty(1, 7, 3).transpose(1, 2).contiguous()
        padded, fits = torch.ops.dsq.to_bf16.default(fb.transpose(1, 2), [1, 8, 8])
        assert (
            padded.dtype == torch.bfloat16
            and padded.shape == (1, 8, 8)
            and fits.dtype == torch.bool
        )
        assert padded.stride() == (64, 1, 8)  # b's memory order: its columns contiguous
        out = onednn.gemm_bf16(torch.empty(2, 8, 8, dtype=torch.bfloat16), padded.expand(2, 8, 8))
        assert out.shape == (2, 8, 8) and out.dtype == torch.float32
    assert onednn.to_bf16(b, (1, 8, 8)).stride() == (64, 1, 8)
    with pytest.raises(
        ValueError, match=r"^dsq::gemm_bf16 needs a bfloat16 CPU tensor, got float32 on cpu$"
    ):
        onednn.gemm_bf16(a, b)
    with pytest.raises(
        ValueError, match=r"^dsq::to_bf16 needs a float32 CPU tensor, got float32 on meta$"
    ):
        onednn.to_bf16(a.to("meta"), (1, 8, 8))


@pytest.mark.skipif(_gemm_unavailable() is not None, reason=str(_gemm_unavailable()))
def test_the_split_op_traces_checks_and_has_a_fake_kernel():
    from dsq.kernels import onednn

    a = torch.randint(-(2**15), 2**15, (1, 5, 7)).float()  # 16 significant bits: a pair of bf16
    b = torch.randint(-8, 8, (1, 7, 3)).float()

    def product(a, b):
        hi, lo, _ = torch.ops.dsq.split_bf16.default(a, [1, 8, 8])
        pb, _ = torch.ops.dsq.to_bf16.default(b, [1, 8, 8])
        out = torch.ops.dsq.gemm_bf16.default(hi, pb) + torch.ops.dsq.gemm_bf16.default(lo, pb)
        return out[:, :5, :3]

    assert torch.equal(product(a, b), a @ b)
    assert torch._dynamo.explain(product)(a, b).graph_break_count == 0
    with FakeTensorMode():
        fa = torch.empty(1, 7, 5).transpose(1, 2)  # columns contiguous
        hi, lo, fits = torch.ops.dsq.split_bf16.default(fa, [1, 8, 8])
        assert hi.shape == lo.shape == (1, 8, 8) and hi.dtype == lo.dtype == torch.bfloat16
        assert hi.stride() == lo.stride() == (64, 1, 8) and fits.dtype == torch.bool
    real = onednn.split_bf16(a.transpose(1, 2).contiguous().transpose(1, 2), (1, 8, 8))
    assert real[0].stride() == real[1].stride() == (64, 1, 8)  # as the fake says
    with pytest.raises(
        ValueError, match=r"^dsq::split_bf16 needs a float32 CPU tensor, got float64 on cpu$"
    ):
        onednn.split_bf16(a.double(), (1, 8, 8))
    with pytest.raises(ValueError, match=r"^dsq::split_bf16: a padded shape \[1, 4, 8\] smaller"):
        onednn.split_bf16(a, (1, 4, 8))
