"""`sliced_swiglu` computes `swiglu_definition`'s values a slice of tokens at a time: the output
and the input's gradient bit for bit, the weights' and biases' gradients to float32 summation
order; its backward pass holds the input alone, and its forward pass nothing of the MLP's width
beyond a slice."""

from __future__ import annotations

import pytest
import torch

from dsq.engine import QuantConfig, record_gemms, sliced_mlp
from dsq.engine.sliced_mlp import slice_rows, sliced_swiglu, swiglu_definition

N, K, WIDTH = 300, 64, 96
# each point's format family: block scales (the paper's dsq, its stash scheduled), a scale
# spanning the tensor at every point (every first pass runs), MX and NVFP4 (blocks of 32 and 16
# under a tensor scale), and wider blocks of BFP at q3
POINTS = {
    "dsq": dict(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16"),
    "fixed": dict(q0="fixed16", q1="fixed8", q2="fixed12", q3="fixed16"),
    "nvfp4-mx": dict(q0="nvfp4", q1="mxfp4_e2m1", q2="nvfp4", q3="nvfp4"),
    "bfp": dict(q0="bfp4", q1="bfp3", q2="bfp6", q3="bfp8b64"),
    "fp32": dict(),
}


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 64 tokens (every format's block divides 64): 300 tokens are four whole slices
    and a shorter last one."""
    monkeypatch.setattr(sliced_mlp, "SLICE_ELEMENTS", 64 * WIDTH)


def operands(bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, N // 3, K, generator=gen) * 2).requires_grad_()
    weights = [torch.randn(WIDTH, K, generator=gen) * 0.1, torch.randn(WIDTH, K, generator=gen)
               * 0.1, torch.randn(K, WIDTH, generator=gen) * 0.1]  # fmt: skip
    biases = [None] * 3
    if bias:
        biases = [torch.randn(n, generator=gen) for n in (WIDTH, WIDTH, K)]
    params = [t.requires_grad_() for t in (*weights, *biases) if t is not None]
    dy = torch.randn(3, N // 3, K, generator=gen)
    return x, weights, biases, params, dy


def run(function, cfg, bias=False, x_of=None):
    x, weights, biases, params, dy = operands(bias)
    if x_of is not None:
        with torch.no_grad():
            x_of(x)
    y = function(x, *weights, *biases, cfg)
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y.detach(), grads[0], grads[1:]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("points", list(POINTS))
def test_values_and_gradients_are_the_definitions(points, bias, small_slices):
    cfg = QuantConfig(**POINTS[points])
    assert len(range(0, N, slice_rows(N, WIDTH, [cfg.format(p) for p in POINTS["dsq"]]))) == 5
    y, dx, dparams = run(sliced_swiglu, cfg, bias)
    want_y, want_dx, want_dparams = run(swiglu_definition, cfg, bias)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    for got, want in zip(dparams, want_dparams, strict=True):
        # sums over N in five parts: float32 rounding of sums of about 300 terms
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_one_slice_is_the_definition_bit_for_bit():
    cfg = QuantConfig(**POINTS["dsq"])
    got, want = run(sliced_swiglu, cfg, True), run(swiglu_definition, cfg, True)
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def infinity_in_one_token(x):
    x[0, 5, 3] = float("inf")


def overflow_in_one_token(x):
    x[0, 5] = 1e30  # finite, but its g and u are near 1e30, their product inf


@pytest.mark.parametrize(
    "points, x_of, spread",
    [("dsq", infinity_in_one_token, "dW"), ("fixed", overflow_in_one_token, "y")],
)
def test_a_nan_a_whole_scale_would_spread_gives_the_definitions_values(
    points, x_of, spread, small_slices
):
    """A token's infinity or overflow makes a NaN or an infinity in one slice of ``dg`` (the
    backward's pass for its largest magnitude, under ``dsq``) or of ``p`` (the forward's, under
    ``fixed``); a scale spanning the tensor spreads it to every value of the definition's
    q3(dg) or q0(p), so the call runs the definition."""
    cfg = QuantConfig(**POINTS[points])
    y, dx, dparams = run(sliced_swiglu, cfg, x_of=x_of)
    want_y, want_dx, want_dparams = run(swiglu_definition, cfg, x_of=x_of)
    for got, want in zip((y, dx, *dparams), (want_y, want_dx, *want_dparams), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # spread by the one scale, as the definition spreads it
    assert bool((dparams[0] if spread == "dW" else y).isnan().all())


def test_its_backward_pass_holds_the_input_alone(small_slices):
    cfg = QuantConfig(**POINTS["dsq"])
    x, weights, biases, params, dy = operands(False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = sliced_swiglu(x, *weights, *biases, cfg)
    wide = [t for t in saved if t.shape[-1] == WIDTH and not t.requires_grad]
    assert wide == []  # nothing of the MLP's width
    held = [t for t in saved if t.shape == (N, K)]
    assert len(held) == 1 and torch.equal(held[0], x.reshape(N, K))
    assert {id(t) for t in saved} - {id(held[0])} <= {id(w) for w in weights}
    y.backward(dy)


def forward_peak(function, cfg, tokens: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, K, generator=gen).requires_grad_()
    weights = [torch.randn(*s, generator=gen).requires_grad_()
               for s in ((WIDTH, K), (WIDTH, K), (K, WIDTH))]  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = function(x, *weights, None, None, None, cfg)
    running = peak = 0
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(records, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    del y
    return peak


def test_its_forward_pass_makes_nothing_of_the_width_beyond_a_slice(small_slices):
    """The definition's forward makes g, u, their product and its quantized copy for every
    token; the slices make them for 64 tokens at a time, so the peak is the output and the
    quantized weights, plus a few slices."""
    cfg = QuantConfig(**POINTS["dsq"])
    tokens = 2048
    sliced = forward_peak(sliced_swiglu, cfg, tokens)
    whole = forward_peak(swiglu_definition, cfg, tokens)
    output, width = tokens * K * 4, tokens * WIDTH * 4
    weights = 3 * K * WIDTH * 4
    assert sliced < output + 2 * weights + 8 * 64 * WIDTH * 4
    assert whole > output + 2 * width


def test_stochastic_rounding_is_refused():
    with pytest.raises(ValueError, match="quant.mlp=sliced .* stochastic rounding \\(at q1\\)"):
        QuantConfig(**POINTS["dsq"], mlp="sliced", rounding={"q1": "stochastic"})
    cfg = QuantConfig(**POINTS["dsq"], rounding={"q3": "stochastic"})
    with pytest.raises(ValueError, match="stochastic rounding \\(at q3\\)"):
        run(sliced_swiglu, cfg)


def test_the_accounting_notes_the_definitions_records(small_slices):
    cfg = QuantConfig(**POINTS["dsq"])
    with record_gemms() as sliced:
        run(sliced_swiglu, cfg)
    with record_gemms() as whole:
        run(swiglu_definition, cfg)
    assert sliced.gemms == whole.gemms and len(whole.gemms) == 3
    assert sliced.stash_bytes == whole.stash_bytes > 0


def run_in(dtype, function, cfg, autocast: bool):
    """A run whose input is ``dtype``: under bf16 autocast with float32 weights, or without
    autocast with the weights in ``dtype`` too (a bf16 model)."""
    x, weights, biases, params, dy = operands(True)
    x = x.detach().to(dtype).requires_grad_()
    if not autocast:
        weights = [w.detach().to(dtype).requires_grad_() for w in weights]
        biases = [b.detach().to(dtype).requires_grad_() for b in biases]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = function(x, *weights, *biases, cfg)
    grads = torch.autograd.grad(y, [x, *weights, *biases], dy.to(y.dtype))
    return y.detach(), grads[0], grads[1:]


def test_a_bf16_models_records_hold_its_stash_in_its_dtype(small_slices):
    """With q1 fp32 the definition stashes a bf16 input at 2 bytes a value: so do the records."""
    cfg = QuantConfig(q0="bfp8", q1="fp32", q2="bfp8", q3="fixed16")
    stash = {}
    for function in (sliced_swiglu, swiglu_definition):
        with record_gemms() as record:
            run_in(torch.bfloat16, function, cfg, autocast=False)
        stash[function] = [g.stash_bytes for g in record.gemms]
    assert stash[sliced_swiglu] == stash[swiglu_definition]
    assert stash[sliced_swiglu][0] == N * K * 2


@pytest.mark.parametrize(
    "dtype, autocast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_under_autocast_and_in_a_bf16_model_it_computes_what_the_definition_computes(
    dtype, autocast, small_slices
):
    """Under autocast each layer casts a bf16 input to float32 on its own, and autograd adds the
    two casts' gradients in bf16; in a bf16 model the weight gradients are summed over slices in
    float32 and rounded once, as one GEMM rounds."""
    cfg = QuantConfig(**POINTS["dsq"])
    y, dx, dparams = run_in(dtype, sliced_swiglu, cfg, autocast)
    want_y, want_dx, want_dparams = run_in(dtype, swiglu_definition, cfg, autocast)
    assert y.dtype == want_y.dtype and dx.dtype == dtype
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    for got, want in zip(dparams, want_dparams, strict=True):
        assert got.dtype == want.dtype
        # float32 sums in another order, then each rounded to the parameter's dtype: at most one
        # step of it apart
        step = 2.0**-7 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), rtol=step,
                                   atol=step * float(want.float().abs().max()))  # fmt: skip


@pytest.mark.parametrize("tokens", [0, 1, 65, 129])
def test_a_last_slice_of_a_few_rows_joins_the_one_before_and_no_tokens_run(tokens, small_slices):
    """A GEMM of 1 to 8 rows may run another kernel than a larger one, with other bits: a short
    last slice joins the one before, so the output and dx stay the definition's bit for bit."""
    cfg = QuantConfig(**POINTS["fixed"])
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(tokens, K, generator=gen)
    weights0 = [torch.randn(*s, generator=gen) * 0.1 for s in ((WIDTH, K), (WIDTH, K), (K, WIDTH))]
    dy = torch.randn(tokens, K, generator=gen)

    def grads_of(function):
        x = x0.clone().requires_grad_()
        weights = [w.clone().requires_grad_() for w in weights0]
        y = function(x, *weights, None, None, None, cfg)
        return y.detach(), *torch.autograd.grad(y, [x, *weights], dy)

    got, want = grads_of(sliced_swiglu), grads_of(swiglu_definition)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for a, b in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max() + 1))
    slices = sliced_mlp.units.row_slices(tokens, 64)
    assert all(s.stop - s.start >= min(64, tokens) for s in slices)


def test_what_needs_no_gradient_gets_none_and_the_records_say_no_stash(small_slices):
    """Frozen gate and down weights and an input that needs no gradient: the definition packs
    no stash for those layers and returns no gradient for them, and so do the slices."""
    cfg = QuantConfig(**POINTS["dsq"])

    def run_frozen(function):
        x, weights, _, _, dy = operands(False)
        x = x.detach()
        weights[0].requires_grad_(False)
        weights[2].requires_grad_(False)
        with record_gemms() as record:
            y = function(x, *weights, None, None, None, cfg)
        (grad,) = torch.autograd.grad(y, [weights[1]], dy)
        return grad, [g.stash_bytes for g in record.gemms]

    got, got_stash = run_frozen(sliced_swiglu)
    want, want_stash = run_frozen(swiglu_definition)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert got_stash == want_stash and want_stash[0] == want_stash[2] == 0 < want_stash[1]
    with torch.no_grad(), record_gemms() as record:
        x, weights, _, _, _ = operands(False)
        sliced_swiglu(x, *weights, None, None, None, cfg)
    assert [g.stash_bytes for g in record.gemms] == [0, 0, 0]


def test_the_tally_counts_each_kind_of_each_layer_once_a_call(small_slices):
    from dsq.engine import units

    cfg = QuantConfig(**POINTS["dsq"])
    before = units.tally()
    run(sliced_swiglu, cfg)
    ran = units.merge_tallies(units.tally(), units.negated(before))
    counts = {kind: sum(by_unit.values()) for kind, by_unit in ran.items()}
    # the forward's three, and gate's and up's again in the backward pass (down's output is not
    # needed there); dx of each layer; dW of each layer
    assert counts == {"linear.forward": 5, "linear.dx": 3, "linear.dw": 3}


@pytest.mark.parametrize(
    "formats, width, rows",
    [
        (["bfp8", "bfp2"], 96, 10880),  # 2^20 / 96 = 10,922 values a row: 170 blocks of 64
        (["bfp8b256"], 1408, 512),  # 744 rows, down to a multiple of 256
        (["mxfp8_e4m3"], 2**21, 64),  # wider than a slice: one block of rows
        (["bfp8"], 96, 100),  # fewer tokens than a slice: all of them
    ],
)
def test_slices_start_on_every_blocks_boundary(formats, width, rows):
    from dsq.formats import parse_format

    tokens = 100 if rows == 100 else 10**6
    assert slice_rows(tokens, width, [parse_format(f) for f in formats]) == rows
