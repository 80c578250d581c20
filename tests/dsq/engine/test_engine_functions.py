"""docs/spec.md §2: dsq_linear and dsq_matmul against F.linear (all points fp32) and against a
written-out computation of the four quantization points."""

from __future__ import annotations

import pytest
import torch

from dsq.engine import QuantConfig, dsq_linear, dsq_matmul
from dsq.formats import parse_format


def q(spec, t, axis):
    return parse_format(spec).quantize(t, axis=axis, backend="reference")


def linear_by_hand(x, w, b, dy, q0, q1, q2, q3):
    """docs/spec.md §2 written out: every operand quantized along its own GEMM's reduction axis."""
    k, m = x.shape[-1], w.shape[0]
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, m)
    y = q(q0, x2, 1) @ q(q0, w, 1).t() + b
    g = q(q3, dy2, 0)
    dx = q(q2, g, 1) @ q(q2, w, 0)
    dw = g.t() @ q(q1, x2, 0)
    db = g.sum(0)
    return y.reshape(*x.shape[:-1], m), dx.reshape(x.shape), dw, db


def run_linear(x, w, b, dy, cfg):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_()
    y = dsq_linear(x, w, b, cfg)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def data(shape_x=(3, 7, 40), m=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape_x, generator=g)
    w = torch.randn(m, shape_x[-1], generator=g) / 6
    b = torch.randn(m, generator=g)
    dy = torch.randn(*shape_x[:-1], m, generator=g)
    return x, w, b, dy


def test_all_fp32_equals_f_linear_in_value_and_gradients():
    x, w, b, dy = data()
    got = run_linear(x, w, b, dy, QuantConfig())
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(dy)
    torch.testing.assert_close(got[0], yr.detach(), rtol=0, atol=0)
    for a, e in zip(got[1:], (xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(a, e)  # same products, possibly another summation order


def test_gradcheck_float64_all_fp32():
    x, w, b, _ = data((2, 3, 5), m=4)
    cfg = QuantConfig()
    args = tuple(t.double().requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: dsq_linear(x, w, b, cfg), args)


@pytest.mark.parametrize(
    "points",
    [
        ("bfp8", "bfp4", "bfp8", "fixed16"),  # stash_bfp
        ("bfp8", "bfp2", "bfp8", "fixed16"),  # dsq's first level
        ("fixed16", "fixed8", "fixed16", "fixed16"),  # stash_fixed
        ("bfp6e8b16", "bfp3e8b8", "e4m3", "bf16"),
        ("fp32", "bfp4", "fp32", "fp32"),
    ],
)
@pytest.mark.parametrize("shape_x", [(3, 7, 40), (37, 48)])  # partial blocks along N and K
def test_quantized_points_equal_the_written_out_computation(points, shape_x):
    x, w, b, dy = data(shape_x, m=20)
    cfg = QuantConfig(*points)
    got = run_linear(x, w, b, dy, cfg)
    expected = linear_by_hand(x, w, b, dy, *points)
    for name, a, e in zip(("y", "dx", "dW", "db"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)


def test_schedule_step_changes_the_stash_format_of_the_next_forward():
    x, w, b, dy = data()
    cfg = QuantConfig(q1={"levels": ["bfp2", "bfp8"], "patience": 1})
    low = run_linear(x, w, b, dy, cfg)
    cfg.step(1.0)
    cfg.step(1.0)  # stall: q1 moves to bfp8
    high = run_linear(x, w, b, dy, cfg)
    assert torch.equal(low[0], high[0])  # forward unaffected (q0 fp32)
    expected_high = linear_by_hand(x, w, b, dy, "fp32", "bfp8", "fp32", "fp32")
    torch.testing.assert_close(high[2], expected_high[2], rtol=0, atol=0)
    assert not torch.equal(low[2], high[2])


def matmul_by_hand(a, b, dz, q0, q1, q2, q3):
    z = q(q0, a, -1) @ q(q0, b, -2)
    g = q(q3, dz, -2)
    da = q(q2, g, -1) @ q(q1, b, -1).transpose(-1, -2)
    db = q(q1, a, -2).transpose(-1, -2) @ g
    return z, da, db


@pytest.mark.parametrize("points", [("fp32",) * 4, ("bfp8", "bfp4", "bfp8", "fixed16")])
def test_matmul_equals_the_written_out_computation(points):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 19, 32, generator=g)
    b = torch.randn(4, 32, 21, generator=g)
    dz = torch.randn(4, 19, 21, generator=g)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    z = dsq_matmul(ar, br, QuantConfig(*points))
    z.backward(dz)
    ez, eda, edb = matmul_by_hand(a, b, dz, *points)
    for name, got, exp in zip(("z", "da", "db"), (z.detach(), ar.grad, br.grad), (ez, eda, edb)):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, msg=name)


def test_stash_is_held_packed_between_forward_and_backward():
    x, w, b, _ = data((64, 256), m=32)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = dsq_linear(xr, wr, b, QuantConfig(q1="bfp4"))
    node = y.grad_fn  # past the reshape view, to the DSQ node
    while type(node).__name__ != "DSQLinearFunctionBackward":
        node = node.next_functions[0][0]
    weight, *stash = node.saved_tensors  # what autograd really holds for backward
    assert weight is wr or torch.equal(weight, wr)
    held = sum(t.numel() * t.element_size() for t in stash)
    assert held == 64 * 256 * 4.5 / 8  # 4.5 bits per value instead of 32
    assert all(t.dtype == torch.uint8 for t in stash)


def test_no_stash_is_packed_when_no_backward_can_come():
    from dsq.engine import record_gemms

    x, w, b, _ = data((16, 64), m=32)
    w.requires_grad_()
    cfg = QuantConfig(q0="bfp8", q1="bfp4")
    with torch.no_grad(), record_gemms() as record:
        y = dsq_linear(x, w, b, cfg)
        dsq_matmul(x.reshape(4, 4, 64), x.reshape(4, 64, 4), cfg)
    assert record.count("linear") == 1 and record.count("matmul") == 1
    assert record.stash_bytes == 0
    assert torch.equal(y, q("bfp8", x, 1) @ q("bfp8", w.detach(), 1).t() + b)
    with record_gemms() as record:
        dsq_linear(x, w, b, cfg)
    assert record.stash_bytes == 16 * 64 * 4.5 / 8


def test_under_autocast_an_operation_casts_only_autocasts_dtypes_wherever_its_tensors_are():
    """A DSQ operation under torch.autocast finds the device from keyword tensors too, casts
    bf16 and fp16 inputs to float32, and leaves float64 as autocast leaves it."""
    from dsq.engine.functions import outside_autocast

    seen = {}

    @outside_autocast
    def operation(*args, **kwargs):
        seen["dtypes"] = [t.dtype for t in (*args, *kwargs.values())]
        seen["autocast"] = torch.is_autocast_enabled("cpu")

    half, double = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        operation(a=half, b=double)
    assert seen == {"dtypes": [torch.float32, torch.float64], "autocast": False}
    with torch.autocast("cpu", torch.bfloat16):
        operation(double, torch.ones(2, dtype=torch.float16))
    assert seen == {"dtypes": [torch.float64, torch.float32], "autocast": False}


@pytest.mark.parametrize(
    "points, sliced",
    [
        (("bfp8", "bfp2", "bfp8", "fixed16"), True),  # dsq's first level
        (("mxfp8_e4m3", "mxfp4_e2m1", "mxfp8_e4m3", "fixed16"), True),
        (("nvfp4", "nvfp4", "nvfp4", "nvfp4"), False),  # q2's scale spans the tensor: whole
    ],
)
def test_the_gradient_gemms_run_by_slices_of_rows_with_the_whole_tensors_values(
    monkeypatch, points, sliced
):
    """dx by slices of tokens, dW by slices of output features where its unit converts g (a
    bf16 unit; in float32 g^T is a view, one GEMM): the written-out values, and no copy of
    either GEMM's operand is whole (q2(g) and g^T's conversions come a slice at a time)."""
    from dsq.engine import units

    monkeypatch.setattr(units, "SLICE_ELEMENTS", 1)  # one SLICE_ROWS slice at a time
    shapes, shared = [], []
    real = units._gemm

    def spy(a, b, how, bias, b_ready=None):
        shapes.append(a.shape)
        shared.append((how.unit, b_ready is not None))
        return real(a, b, how, bias, b_ready)

    monkeypatch.setattr(units, "_gemm", spy)
    x, w, b, dy = data((200, 48), m=150)
    before = units.tally()
    got = run_linear(x, w, b, dy, QuantConfig(*points))
    ran = units.merge_tallies(units.tally(), units.negated(before))
    expected = linear_by_hand(x, w, b, dy, *points)
    for name, a, e in zip(("y", "dx", "dW", "db"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)
    backward = shapes[1:]  # after the forward GEMM
    dw_unit = shared[-1][0]
    # a last slice of fewer than 64 rows joins the one before (units.row_slices)
    dw_slices = [64, 86] if dw_unit in ("bf16", "bf16x2") else [150]
    if sliced:
        assert [s[0] for s in backward] == [64, 64, 72] + dw_slices
    else:
        assert [s[0] for s in backward] == [200] + dw_slices
    # a slice's GEMM on the bf16 units takes the shared operand converted once for all slices
    slices = shared[1:] if sliced else shared[2:]
    assert all(ready == (unit in ("bf16", "bf16x2")) for unit, ready in slices), slices
    assert {kind: sum(n.values()) for kind, n in ran.items()} == {
        "linear.forward": 1,
        "linear.dx": 1,
        "linear.dw": 1,
    }  # a GEMM counted once, whatever its slices


def test_a_sliced_gemm_on_the_bf16_unit_converts_the_shared_operand_once(monkeypatch):
    """gemm_by_rows on the CPU's bf16 units: the second operand is converted once for all
    slices (`compute.prepared_b`), and the result is the whole GEMM's, bit for bit."""
    from dsq.engine import units
    from dsq.kernels import onednn

    if "bf16" not in units.offered_units(torch.device("cpu")):
        pytest.skip("this CPU has no bf16 unit (AVX512-BF16 or AMX)")
    bfp8 = parse_format("bfp8")
    g = torch.Generator().manual_seed(0)
    a = bfp8.quantize(torch.randn(300, 96, generator=g), -1)
    b = bfp8.quantize(torch.randn(96, 80, generator=g), 0)
    how = units.plan(bfp8, bfp8, torch.device("cpu"), "auto", 10**9)
    assert how.unit == "bf16"
    whole = units.gemm(a, b, how, "test")
    converted = []
    real = onednn.to_bf16
    monkeypatch.setattr(
        onednn, "to_bf16", lambda x, shape: converted.append(x.shape) or real(x, shape)
    )
    monkeypatch.setattr(units, "SLICE_ELEMENTS", 1)  # slices of SLICE_ROWS rows
    sliced = units.gemm_by_rows(lambda rows: a[rows], 300, 96, b, how, "test")
    assert torch.equal(sliced, whole)
    assert [tuple(s) for s in converted].count((1, 96, 80)) == 1  # b, once
    # and each of the four slices of a (the last 44 rows joined to the one before)
    assert len(converted) == 1 + 4
