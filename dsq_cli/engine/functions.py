"""The DSQ autograd functions (docs/spec.md §2): a linear layer and an activation-by-activation
product.

Formats are read from the shared ``QuantConfig`` when the forward pass runs, so a schedule step
takes effect at the next forward; the backward pass uses the formats recorded at forward time
(the stash was packed in them).
"""

from __future__ import annotations

import torch

from dsq_cli.formats import Format, PackedTensor

from . import accounting
from .config import QuantConfig


def _formats(cfg: QuantConfig) -> tuple[Format, Format, Format, Format]:
    return cfg.format("q0"), cfg.format("q1"), cfg.format("q2"), cfg.format("q3")


def _stash_header(packed: PackedTensor | None):
    """(header, payload tensors): the payload goes through ``save_for_backward`` so autograd
    owns it (freed after backward, kept under ``retain_graph``); the header is a few Python ints."""
    if packed is None:
        return None, []
    names = tuple(packed.payload)
    header = (packed.fmt, packed.shape, packed.dtype, packed.axis, names)
    return header, [packed.payload[n] for n in names]


def _stash_restore(header, tensors) -> PackedTensor:
    fmt, shape, dtype, axis, names = header
    return PackedTensor(fmt, shape, dtype, axis, dict(zip(names, tensors)))


class DSQLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with the four DSQ quantization points.

    Shapes: ``x`` is flattened to ``[N, K]`` (N tokens), ``W`` is ``[M, K]``, ``dy`` ``[N, M]``.
    Each GEMM input is quantized with blocks along that GEMM's reduction dimension:

    * GEMM1 (forward)  ``y[N, M]  = q0(x)[N, K] @ q0(W)[M, K]^T``  blocks along K for both.
    * GEMM2 (backward) ``dx[N, K] = q2(g)[N, M] @ q2(W)[M, K]``    blocks along M for both,
      where ``g = q3(dy)`` (blocks along N) is the incoming gradient as fetched from DRAM.
    * GEMM3 (backward) ``dW[M, K] = g[N, M]^T @ stash[N, K]``      blocks along N: ``g`` in q3,
      and the stash is ``x`` packed in q1 (blocks along N), unpacked here and freed after.

    ``db = sum_N g``. ``dx`` leaves unquantized (the layer upstream applies its own q3). Master
    weights, bias and everything outside the GEMMs stay fp32. With every point ``fp32`` this is
    ``F.linear`` in value and gradient.
    """

    @staticmethod
    def forward(ctx, x2, weight, bias, cfg: QuantConfig, training: bool = True):
        # x2 is [N, K]: dsq_linear flattens outside, so the output is not a view made in here
        f0, f1, f2, f3 = _formats(cfg)
        k = x2.shape[-1]
        xq = f0.quantize(x2, axis=1)
        wq = f0.quantize(weight, axis=1)
        if bias is None:
            y = xq @ wq.t()
        else:
            y = torch.addmm(bias, xq, wq.t())
        # the stash: x itself in q1, blocks along the tokens (GEMM3's reduction dimension)
        # (no stash when no backward can come: evaluation under torch.no_grad)
        stash = f1.pack(x2, axis=0) if training and ctx.needs_input_grad[1] else None
        ctx.stash_header, stash_tensors = _stash_header(stash)
        ctx.formats = (f2, f3)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *stash_tensors)
        stash_bytes = stash.nbytes if stash is not None else 0
        accounting.note("linear", 1, x2.shape[0], k, weight.shape[0], cfg, stash_bytes)
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, *stash_tensors = ctx.saved_tensors
        f2, f3 = ctx.formats
        g = f3.quantize(dy, axis=0)  # as fetched: blocks along N
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = f2.quantize(g, axis=1) @ f2.quantize(weight, axis=0)  # blocks along M
        if ctx.needs_input_grad[1]:
            stash = _stash_restore(ctx.stash_header, stash_tensors).unpack()
            dw = g.t() @ stash
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None, None


class DSQMatmulFunction(torch.autograd.Function):
    """``z = a @ b`` for two activations (attention's ``Q K^T`` and ``P V``), docs/spec.md §2.

    Shapes ``a [..., N, K]``, ``b [..., K, M]``, ``dz [..., N, M]``:

    * forward   ``z = q0(a) @ q0(b)``, blocks along K for both;
    * both operands are stashed in q1, each with blocks along the reduction dimension of the
      backward GEMM it feeds: ``a`` along N (for ``db``), ``b`` along M (for ``da``);
    * ``g = q3(dz)`` with blocks along N;
    * ``da [..., N, K] = q2(g) @ stash_b^T``  (reduction over M: ``g`` in q2 along M);
    * ``db [..., K, M] = stash_a^T @ g``      (reduction over N: ``g`` in q3 along N).
    """

    @staticmethod
    def forward(ctx, a, b, cfg: QuantConfig, training: bool = True):
        f0, f1, f2, f3 = _formats(cfg)
        z = f0.quantize(a, axis=-1) @ f0.quantize(b, axis=-2)
        header_a, tensors_a = _stash_header(
            f1.pack(a, axis=-2) if training and ctx.needs_input_grad[1] else None
        )
        header_b, tensors_b = _stash_header(
            f1.pack(b, axis=-1) if training and ctx.needs_input_grad[0] else None
        )
        ctx.headers = (header_a, len(tensors_a), header_b)
        ctx.formats = (f2, f3)
        ctx.save_for_backward(*tensors_a, *tensors_b)
        stash_bytes = sum(t.numel() * t.element_size() for t in (*tensors_a, *tensors_b))
        batch = a.numel() // (a.shape[-2] * a.shape[-1]) if a.numel() else 0
        accounting.note("matmul", batch, a.shape[-2], a.shape[-1], b.shape[-1], cfg, stash_bytes)
        return z

    @staticmethod
    def backward(ctx, dz):
        f2, f3 = ctx.formats
        g = f3.quantize(dz, axis=-2)
        header_a, count_a, header_b = ctx.headers
        saved = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            stash_b = _stash_restore(header_b, saved[count_a:]).unpack()
            da = f2.quantize(g, axis=-1) @ stash_b.transpose(-1, -2)
        if ctx.needs_input_grad[1]:
            stash_a = _stash_restore(header_a, saved[:count_a]).unpack()
            db = stash_a.transpose(-1, -2) @ g
        return da, db, None, None


def dsq_linear(x, weight, bias, cfg: QuantConfig):
    """``F.linear`` with DSQ quantization (see ``DSQLinearFunction``)."""
    # grad mode is off inside Function.forward, so whether a backward can come is decided here
    training = torch.is_grad_enabled()
    y = DSQLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, cfg, training)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dsq_matmul(a, b, cfg: QuantConfig):
    """``a @ b`` of two activations with DSQ quantization (see ``DSQMatmulFunction``)."""
    return DSQMatmulFunction.apply(a, b, cfg, torch.is_grad_enabled())
