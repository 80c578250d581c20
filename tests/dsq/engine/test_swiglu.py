"""`silu_product` is autograd's ``F.silu(g) * u`` bit for bit, in value and both gradients, and
holds two tensors for the backward pass where autograd holds three."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsq.engine.swiglu import silu_product


def operands(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(3, 17, 96, generator=gen) * 4).to(dtype).requires_grad_()
    u = torch.randn(3, 17, 96, generator=gen).to(dtype).requires_grad_()
    return g, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_product_and_its_gradients_are_autograds_bit_for_bit(dtype):
    g, u = operands(dtype)
    d_out = torch.randn(g.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = F.silu(g) * u
    want_grads = torch.autograd.grad(want, (g, u), d_out)
    got = silu_product(g, u)
    got_grads = torch.autograd.grad(got, (g, u), d_out)
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_its_backward_pass_has_five_tensors_of_the_width_alive_at_most():
    """g and u (saved), the incoming gradient and the two gradients: the product's temporary
    is freed before the second gradient is made, in silu(g)'s own memory."""
    from torch.profiler import ProfilerActivity, profile

    g, u = operands()
    out = silu_product(g, u)
    d_out = torch.randn(g.shape, generator=torch.Generator().manual_seed(1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = torch.autograd.grad(out, (g, u), d_out)
    running = peak = 0
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(records, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    width = g.numel() * g.element_size()
    # beyond g, u and d_out, two at a time: d_out * u and d_g, then d_g and d_u (silu(g) and d_u
    # beside d_g would be three)
    assert 2 * width <= peak < 2.5 * width
    assert running == 2 * width and len(grads) == 2  # what is left: the two gradients


def test_operands_that_broadcast_get_autograds_gradients_to_rounding():
    """A broadcast ``g`` gets its gradient summed over the broadcast rows after silu's
    derivative, where autograd sums before it: the same to float32 rounding, not bit for bit."""
    g = torch.randn(1, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    u = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    d_out = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(F.silu(g) * u, (g, u), d_out)
    got = torch.autograd.grad(silu_product(g, u), (g, u), d_out)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_it_holds_two_tensors_where_autograd_holds_three():
    def saved(function) -> int:
        count = 0

        def pack(t):
            nonlocal count
            count += 1
            return t

        g, u = operands()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            function(g, u)
        return count

    assert saved(lambda g, u: F.silu(g) * u) == 3
    assert saved(silu_product) == 2


def test_one_operand_needing_no_gradient_gets_none_and_no_grad_saves_nothing():
    g, u = operands()
    got = torch.autograd.grad(silu_product(g, u.detach()).sum(), g)[0]
    want = torch.autograd.grad((F.silu(g) * u.detach()).sum(), g)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        out = silu_product(g, u)
    assert out.grad_fn is None and torch.equal(out, F.silu(g.detach()) * u.detach())
