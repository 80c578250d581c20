"""The tiled attention's Triton kernels (dsq/kernels/attention.py) against the torch kernel they
transcribe (dsq/engine/attention.py, itself tested against the explicit path), under the Triton
interpreter on CPU tensors.

Tolerance: every quantized value is the torch kernel's but where a float32 sum in another order
(the softmax's denominator and its backward's row sums, summed tile by tile here) carries a value
across a rounding boundary of its format: then it moves by one quantum, and may move the value
quantized from it (q2 of q3's) by one quantum of that format. With ``fixed16`` (one scale for the
tensor, a quantum 2^-15 of its largest magnitude) a move reaches 3e-5 of a result's largest
magnitude: ``CLOSE`` allows 1e-4 everywhere but in the few elements a moved 8-bit block value
reaches (a quantum 2^-7 of its block's largest, 4.5e-4 of dQ's largest seen here), which
``RARE`` allows within ``FAR`` of the largest magnitude. Without a quantizer (fp32) only the
order of sums differs, a few units in the last place.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.attention import MASKS, cfg_of, inputs, mask_keywords

pytest.importorskip("triton")

from dsq.engine.attention import dsq_attention  # noqa: E402
from dsq.warn_once import warn_once

pytestmark = pytest.mark.slow  # the interpreter runs each program in Python

CLOSE, RARE, FAR = 1e-4, 0.01, 1e-2
# a preset of each family the kernels hold: BFP with fixed16 gradients, MX, fixed16 everywhere
# (whole-tensor scales in both passes), and fp32
PRESETS = ("dsq", "mx_dsq", "fixed16", "fp32")


def attention_and_grads(preset, keywords, shape, **changes):
    q, k, v, d_out = inputs(**shape)
    out = dsq_attention(q, k, v, cfg_of(preset, **changes), **keywords)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


def on_both(monkeypatch, preset, kind, scaling=0.25, **shape):
    """(the Triton kernels' output and gradients, the torch kernel's)."""
    n, m = shape.get("n", 75), shape.get("m", 75)
    keywords = mask_keywords(kind, 2, n, m) | {"scaling": scaling}
    monkeypatch.setenv("DSQ_BACKEND", "triton")
    got = attention_and_grads(preset, keywords, shape)
    monkeypatch.delenv("DSQ_BACKEND")
    return got, attention_and_grads(preset, keywords, shape)


def assert_close(got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        error = (a - b).abs() / b.abs().max().clamp_min(1e-30)
        assert (error > CLOSE).float().mean().item() <= RARE, name
        assert error.max().item() <= FAR, name


@pytest.mark.parametrize(("preset", "kind"), [("dsq", kind) for kind in MASKS] + [
    (preset, kind) for preset in PRESETS[1:] for kind in ("causal", "boolean")
])  # fmt: skip
def test_the_triton_kernels_are_the_torch_kernels_to_summation_order(monkeypatch, preset, kind,
                                                                     caplog):  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="dsq.engine.attention"):
        got, want = on_both(monkeypatch, preset, kind)
    assert not caplog.records  # they ran: no line saying the torch kernel did
    assert_close(got, want)


@pytest.mark.parametrize(("n", "m", "heads", "kv_heads"), [(40, 70, 4, 1), (130, 9, 2, 2)])
@pytest.mark.parametrize("preset", ["dsq", "mx_dsq"])
def test_odd_lengths_and_groups(monkeypatch, preset, n, m, heads, kv_heads):
    """Tiles that end past the sequence, keys fewer than a block, a group of four query heads."""
    got, want = on_both(monkeypatch, preset, "boolean", n=n, m=m, heads=heads, kv_heads=kv_heads)
    assert_close(got, want)


@pytest.mark.parametrize("kind", ["additive", "padding"])
def test_a_scaling_that_is_not_a_power_of_two_and_wider_heads(monkeypatch, kind):
    """Heads of 32 at their default scaling 32^-0.5: the scores and their gradients are scaled
    tile by tile, not folded into an operand."""
    got, want = on_both(monkeypatch, "dsq", kind, scaling=None, n=50, m=50, d=32, e=32)
    assert_close(got, want)


def test_their_gemms_are_counted_as_float32(monkeypatch):
    from dsq.engine import units

    before = units.tally()
    on_both(monkeypatch, "dsq", "causal", n=40, m=40)
    ran = units.merge_tallies(units.tally(), units.negated(before))
    assert ran["matmul.forward"]["fp32"] >= 2 and ran["matmul.da"]["fp32"] >= 2


def test_the_causal_rule_and_a_tile_of_keys_past_the_queries(monkeypatch):
    got, want = on_both(monkeypatch, "dsq", "causal", n=70, m=140)
    assert_close(got, want)


@pytest.mark.parametrize(("preset", "changes", "lacks"), [
    ("nvfp4_dsq", {}, "q0's format nvfp4"),
    ("dsq", {"rounding": {"q2": "stochastic"}}, "q2's stochastic rounding"),
])  # fmt: skip
def test_a_call_the_kernels_do_not_hold_runs_the_torch_kernel_and_says_so(
    monkeypatch, caplog, preset, changes, lacks
):

    warn_once.cache_clear()
    monkeypatch.setenv("DSQ_BACKEND", "triton")
    with caplog.at_level(logging.WARNING, logger="dsq.engine.attention"):
        got = attention_and_grads(preset, {"causal": True}, {}, **changes)
    assert [r.getMessage() for r in caplog.records] == [
        "dsq: attention runs its torch kernel on the triton backend here: the Triton kernels do "
        f"not hold {lacks}"
    ]
    assert all(torch.isfinite(t).all() for t in got)


def test_the_ops_pass_opcheck_on_the_triton_backend(monkeypatch):
    """The custom ops dsq::attention_forward and _backward, where they run the Triton kernels."""
    from dsq.engine.attention import points_text

    monkeypatch.setenv("DSQ_BACKEND", "triton")
    cfg = cfg_of("dsq")
    q, k, v, d_out = (t.detach() for t in inputs(n=40, m=40))
    points = points_text(cfg)
    rest = (None, None, points, cfg.gemm_unit, 0.25, True, 0.0, 0, 0, 0)
    torch.library.opcheck(torch.ops.dsq.attention_forward.default, (q.clone(), k, v, *rest))
    backward_args = (d_out, q.clone(), k, q, k, v, None, *rest)
    torch.library.opcheck(torch.ops.dsq.attention_backward.default, backward_args)
