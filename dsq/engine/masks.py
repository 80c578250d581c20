"""ReLU and dropout that save one bit per value for the backward pass (docs/dsq.md, "What the
backward pass holds").

Both backward passes read only a mask: ReLU's gradient passes where its output is positive,
dropout's where the value was kept. PyTorch saves that mask as a full tensor, ReLU's output
(4 bytes a value in float32) and dropout's scaled noise (4 bytes a value on the CPU, a bool byte
on a GPU). These functions compute the same outputs with the same operators, save the mask
packed eight values to a byte, and rebuild in the backward pass exactly what PyTorch's would
have read: values and gradients are bit for bit those of ``torch.relu`` and ``F.dropout``,
under every stash scope and format (tests/dsq/engine/test_masks.py). A patched model uses them
wherever its layers call ReLU or dropout (`dsq.engine.patch`, `dsq.integrations`).

Dropout follows ``F.dropout``'s own dispatch so that it draws the same random numbers: on the
CPU, ATen's ``_dropout_impl`` (a float noise tensor ``bernoulli_(1 - p)`` divided by ``1 - p``,
then ``x * noise``); on a GPU the fused ``native_dropout`` (its output and bool mask).
"""

from __future__ import annotations

import sys

import torch

_LITTLE_ENDIAN = sys.byteorder == "little"
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, eight values a byte, value ``i`` in bit ``i % 8`` of byte
    ``i // 8`` (row-major; the last byte padded with zeros)."""
    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if _LITTLE_ENDIAN:
        # eight bools (bytes of 0 or 1) read as one int64, byte j at bit 8j: fold bit 8j down
        # to bit j in three shifts
        word = flat.view(torch.uint8).view(torch.int64)
        word = word | (word >> 7)
        word = word | (word >> 14)
        word = word | (word >> 28)
        return (word & 0xFF).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool tensor of ``shape`` that `pack_bits` packed."""
    numel = shape.numel()
    if _LITTLE_ENDIAN:
        # the inverse spread: bit j of the byte to bit 8j of an int64, read as eight bools
        word = packed.to(torch.int64)
        word = (word | (word << 28)) & 0x0000000F0000000F
        word = (word | (word << 14)) & 0x0003000300030003
        word = (word | (word << 7)) & 0x0101010101010101
        flat = word.view(torch.uint8).view(torch.bool)
    else:
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
        flat = ((packed.unsqueeze(1) & weights) != 0).reshape(-1)
    return flat[:numel].reshape(shape)


class ReLUFunction(torch.autograd.Function):
    """``torch.relu(x)``; the backward pass passes the gradient where the output is not at most
    0 (ATen's ``threshold_backward(grad, result, 0)``: positive or NaN), from the packed bits."""

    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.shape = y.shape
        ctx.save_for_backward(pack_bits(~(y <= 0)))
        return y

    @staticmethod
    def backward(ctx, grad):
        (bits,) = ctx.saved_tensors
        return torch.where(unpack_bits(bits, ctx.shape), grad, 0.0)


class DropoutFunction(torch.autograd.Function):
    """``F.dropout(x, p, training=True)`` with its mask saved as bits (see the module's
    docstring for the two paths)."""

    @staticmethod
    def forward(ctx, x, p: float):
        ctx.p, ctx.shape, ctx.fused = p, x.shape, _fused(x)
        if ctx.fused:
            y, keep = torch.native_dropout(x, p, True)
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)
            noise.div_(1 - p)
            y = x * noise
            keep = noise != 0
        ctx.save_for_backward(pack_bits(keep))
        return y

    @staticmethod
    def backward(ctx, grad):
        (bits,) = ctx.saved_tensors
        keep = unpack_bits(bits, ctx.shape)
        if ctx.fused:
            return torch.ops.aten.native_dropout_backward(grad, keep, 1 / (1 - ctx.p)), None
        # the noise the forward pass multiplied by, rebuilt with the same operators
        noise = keep.to(grad.dtype if grad.is_floating_point() else torch.float32)
        noise.div_(1 - ctx.p)
        return grad * noise, None


def _fused(x: torch.Tensor) -> bool:
    """Whether ``F.dropout`` takes ATen's fused kernel for ``x`` (its
    ``is_fused_kernel_acceptable``: an accelerator tensor)."""
    return x.device.type not in ("cpu", "meta") and x.numel() > 0


def dsq_relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu`` whose backward pass holds one bit per value (in place: ``F.relu`` itself)."""
    if inplace or not torch.is_grad_enabled() or not x.requires_grad:
        return torch.relu_(x) if inplace else torch.relu(x)
    return ReLUFunction.apply(x)


def dsq_dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` whose backward pass holds one bit per value; what ``F.dropout`` does where
    no mask is kept (evaluation, p of 0 or 1, no gradient, in place)."""
    if (
        not training
        or not 0 < p < 1
        or inplace
        or not torch.is_grad_enabled()
        or not x.requires_grad
        or not x.is_floating_point()
    ):
        return torch.nn.functional.dropout(x, p, training, inplace)
    return DropoutFunction.apply(x, p)
