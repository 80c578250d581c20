"""SwiGLU's product ``silu(g) * u``, holding two tensors for the backward pass instead of three
(docs/dsq.md, "What the backward pass holds").

The MLP of Llama-style models is ``down(silu(gate(x)) * up(x))``. Autograd saves three tensors
of the MLP's width for it: silu's input ``g`` for silu's derivative, and the product's operands
``silu(g)`` and ``u`` for the product's. ``silu(g)`` is a function of ``g``: `silu_product`
saves ``g`` and ``u`` only and computes ``silu(g)`` again in the backward pass with the kernel
the forward pass used, so its values, and every gradient, are bit for bit autograd's
(tests/dsq/engine/test_swiglu.py). Under dsq (``stash_scope=gemm``) these tensors are float32,
4 bytes a value, where autocast saves bf16: a third of them is 8 KiB a token for an MLP 2,048
wide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SiluProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, d_out):
        g, u = ctx.saved_tensors
        # the product's gradients as autograd's mul gives them (each the other operand times
        # d_out), then silu's own backward kernel; d_g first, its temporary freed, then d_u
        # made in silu(g)'s own memory (a product is the same either way round): five tensors
        # of the MLP's width alive at once at most, not six
        d_g = d_u = None
        if ctx.needs_input_grad[0]:
            d_g = torch.ops.aten.silu_backward(d_out * u, g)
        if ctx.needs_input_grad[1]:
            d_u = F.silu(g)
            in_place = d_u.shape == d_out.shape and d_u.dtype == torch.result_type(d_u, d_out)
            d_u = d_u.mul_(d_out) if in_place else d_out * d_u
        return d_g, d_u


def silu_product(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u``, its backward pass holding ``g`` and ``u`` only (module docstring)."""
    if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad):
        return F.silu(g) * u
    return _SiluProduct.apply(g, u)
