"""The DSQ autograd functions (docs/spec.md §2): a linear layer and an activation-by-activation
product.

Formats and roundings are read from the shared ``QuantConfig`` when the forward pass runs, so a
schedule step takes effect at the next forward; the backward pass uses the points recorded at
forward time (the stash was packed in them). Stochastic rounding draws its noise from the
config's generator in the order the quantizers run.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dsq.formats import Format, PackedTensor

from . import accounting, units
from .config import POINTS, QuantConfig


@dataclasses.dataclass(frozen=True)
class _Point:
    """A quantization point as one call sees it: its format in force and its rounding (with the
    generator that draws stochastic rounding's noise)."""

    fmt: Format
    rounding: str
    generator: torch.Generator | None

    def quantize(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return self.fmt.quantize(x, axis, self.rounding, self.generator)

    def pack(self, x: torch.Tensor, axis: int) -> PackedTensor:
        return self.fmt.pack(x, axis, self.rounding, self.generator)

    def quantize_and_pack(self, x, axis: int, stash: _Point, stash_axis: int):
        """(self.quantize(x, axis), stash.pack(x, stash_axis)): one read of x where the format's
        path fuses the two."""
        return self.fmt.quantize_and_pack(
            x, axis, stash.fmt, stash_axis,
            rounding=self.rounding, stash_rounding=stash.rounding,
            generator=self.generator, stash_generator=stash.generator,
        )  # fmt: skip

    def quantize_chain(self, x, axis: int, second: _Point, second_axis: int):
        """(g, second.quantize(g, second_axis)) with g = self.quantize(x, axis): one pass where
        the format's path fuses the two."""
        return self.fmt.quantize_chain(
            x, axis, second.fmt, second_axis,
            rounding=self.rounding, second_rounding=second.rounding,
            generator=self.generator, second_generator=second.generator,
        )  # fmt: skip


def _points(cfg: QuantConfig, device: torch.device) -> tuple[_Point, _Point, _Point, _Point]:
    """q0..q3 in force now (read at forward time; the backward pass keeps these)."""
    return tuple(_Point(cfg.format(p), *cfg.rounding_of(p, device)) for p in POINTS)


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


# -- under torch.autocast ------------------------------------------------------------------------
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


def _float32(x):
    """``x`` in float32 where autocast may have made it narrower (float64 stays as it is, as
    autocast leaves it)."""
    if isinstance(x, torch.Tensor) and x.dtype in _AUTOCAST_DTYPES:
        return x.float()
    return x


def outside_autocast(operation):
    """A DSQ operation under ``torch.autocast`` runs as autocast's float32 operations do: its
    floating inputs of a lower precision are cast to float32 and autocast is off inside, so its
    GEMMs run in the formats of its config, not autocast's dtype, and it returns float32
    (docs/dsq.md, "Autocast and a patched model"). Outside autocast it runs as written."""

    @functools.wraps(operation)
    def run(*args, **kwargs):
        tensors = (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        tensor = next(tensors, None)
        if tensor is None or not torch.is_autocast_enabled(tensor.device.type):
            return operation(*args, **kwargs)
        args = tuple(_float32(a) for a in args)
        kwargs = {k: _float32(v) for k, v in kwargs.items()}
        with torch.autocast(tensor.device.type, enabled=False):
            return operation(*args, **kwargs)

    return run


def backward_outside_autocast(backward):
    """A DSQ function's backward pass with autocast off, should ``.backward()`` be called inside
    an autocast region (on the CPU the backward pass runs on the caller's thread)."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        grad = next((g for g in grads if isinstance(g, torch.Tensor)), None)
        if grad is None or not torch.is_autocast_enabled(grad.device.type):
            return backward(ctx, *grads)
        with torch.autocast(grad.device.type, enabled=False):
            return backward(ctx, *grads)

    return run


def _by_rows(point: _Point) -> bool:
    """Whether q2 may quantize the incoming gradient a slice of tokens at a time and give the
    whole tensor's values: a scale per block (not one spanning the tensor) and nearest rounding
    (stochastic rounding's noise is drawn for the whole tensor, as it always was)."""
    return point.rounding == "nearest" and not point.fmt.whole_tensor_scale


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

    Each GEMM runs on the unit planned at forward time from its two operands' formats
    (``units.plan``): GEMM1 from (q0, q0), GEMM2 from (q2, q2), GEMM3 from (q3, q1).
    """

    @staticmethod
    def forward(ctx, x2, weight, bias, cfg: QuantConfig, training: bool = True):
        # x2 is [N, K]: dsq_linear flattens outside, so the output is not a view made in here
        f0, f1, f2, f3 = _points(cfg, x2.device)
        k = x2.shape[-1]
        # the three GEMMs take N K M multiply-adds each
        unit_of = functools.partial(
            units.plan,
            device=x2.device,
            setting=cfg.gemm_unit,
            macs=x2.shape[0] * k * weight.shape[0],
        )
        plans = [unit_of(f0.fmt, f0.fmt), unit_of(f2.fmt, f2.fmt), unit_of(f3.fmt, f1.fmt)]
        # the stash: x itself in q1, blocks along the tokens (GEMM3's reduction dimension),
        # taken in the same read of x as q0(x) where the path fuses the two; no stash when no
        # backward can come (evaluation under torch.no_grad)
        if training and ctx.needs_input_grad[1]:
            xq, stash = f0.quantize_and_pack(x2, 1, f1, 0)
        else:
            xq, stash = f0.quantize(x2, 1), None
        wq = f0.quantize(weight, 1)
        y = units.gemm(xq, wq.t(), plans[0], "linear.forward", bias)
        ctx.stash_header, stash_tensors = _stash_header(stash)
        ctx.points = (f2, f3)
        ctx.plans = plans
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *stash_tensors)
        stash_bytes = stash.nbytes if stash is not None else 0
        accounting.note("linear", 1, x2.shape[0], k, weight.shape[0], cfg, stash_bytes, plans)
        return y

    @staticmethod
    @backward_outside_autocast
    def backward(ctx, dy):
        weight, *stash_tensors = ctx.saved_tensors
        f2, f3 = ctx.points
        dx = dw = db = None
        n, m = dy.shape
        if ctx.needs_input_grad[0] and not _by_rows(f2):
            # g = q3(dy) as fetched (blocks along N), then q2(g) (blocks along M): one pass where
            # the path fuses the two
            g, g2 = f3.quantize_chain(dy, 0, f2, 1)
            dx = units.gemm(g2, f2.quantize(weight, 0), ctx.plans[1], "linear.dx")  # blocks on M
            del g2
        else:
            g = f3.quantize(dy, 0)
            if ctx.needs_input_grad[0]:
                # q2(g) a slice of tokens at a time: its blocks lie along M, within a token, so
                # each slice holds the whole tensor's values, and no second copy of g exists (the
                # output layer's [N, vocabulary] gradient is a step's largest tensor)
                w2 = f2.quantize(weight, 0)
                dx = units.gemm_by_rows(lambda rows: f2.quantize(g[rows], 1), n, m, w2,
                                        ctx.plans[1], "linear.dx")  # fmt: skip
        if ctx.needs_input_grad[1]:
            stash = _stash_restore(ctx.stash_header, stash_tensors).unpack()
            if ctx.plans[2].unit == "fp32":  # g^T is a view: nothing to copy, one GEMM
                dw = units.gemm(g.t(), stash, ctx.plans[2], "linear.dw")
            else:  # by rows of dW (output features): the unit's copies of g a slice at a time
                dw = units.gemm_by_rows(lambda rows: g[:, rows].t(), m, n, stash, ctx.plans[2],
                                        "linear.dw")  # fmt: skip
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None, None


class DSQMatmulFunction(torch.autograd.Function):
    """``z = a @ b`` for two activations (attention's ``Q K^T`` and ``P V``), docs/spec.md §2.

    Shapes ``a [..., N, K]``, ``b [..., K, M]``, ``dz [..., N, M]``:

    * forward   ``z = q0(a) @ q0(b)``, blocks along K for both;
    * both operands are stashed in q1, each with blocks along the reduction dimension of the
      backward GEMM it feeds: ``a`` along N (for ``db``), ``b`` along M (for ``da``); ``b`` is
      stashed as ``b^T [..., M, K]``, the layout GEMM ``da`` reads (the same blocks);
    * ``g = q3(dz)`` with blocks along N;
    * ``da [..., N, K] = q2(g) @ stash_b^T``  (reduction over M: ``g`` in q2 along M);
    * ``db [..., K, M] = stash_a^T @ g``      (reduction over N: ``g`` in q3 along N).

    Each operand's q0 and its stash are taken in one read where the path fuses the two: both
    are a quantizer along the last axis and a pack along the one before it (``a`` as it is,
    ``b`` transposed). The units (``units.plan``): forward from (q0, q0), ``da`` from (q2, q1),
    ``db`` from (q1, q3).
    """

    @staticmethod
    def forward(ctx, a, b, cfg: QuantConfig, training: bool = True):
        f0, f1, f2, f3 = _points(cfg, a.device)
        # each matrix of the three GEMMs takes N K M multiply-adds
        macs = a.shape[-2] * a.shape[-1] * b.shape[-1]
        unit_of = functools.partial(units.plan, device=a.device, setting=cfg.gemm_unit, macs=macs)
        plans = [unit_of(f0.fmt, f0.fmt), unit_of(f2.fmt, f1.fmt), unit_of(f1.fmt, f3.fmt)]
        b_t = b.transpose(-1, -2)
        last, before = a.dim() - 1, a.dim() - 2
        if training and ctx.needs_input_grad[1]:
            aq, stash_a = f0.quantize_and_pack(a, last, f1, before)
        else:
            aq, stash_a = f0.quantize(a, last), None
        if training and ctx.needs_input_grad[0]:
            bq_t, stash_b_t = f0.quantize_and_pack(b_t, last, f1, before)
        else:
            bq_t, stash_b_t = f0.quantize(b_t, last), None
        z = units.gemm(aq, bq_t.transpose(-1, -2), plans[0], "matmul.forward")
        header_a, tensors_a = _stash_header(stash_a)
        header_b, tensors_b = _stash_header(stash_b_t)
        ctx.headers = (header_a, len(tensors_a), header_b)
        ctx.points = (f2, f3)
        ctx.plans = plans
        ctx.save_for_backward(*tensors_a, *tensors_b)
        stash_bytes = sum(t.numel() * t.element_size() for t in (*tensors_a, *tensors_b))
        batch = a.numel() // (a.shape[-2] * a.shape[-1]) if a.numel() else 0
        shape = (batch, a.shape[-2], a.shape[-1], b.shape[-1])
        accounting.note("matmul", *shape, cfg, stash_bytes, plans)
        return z

    @staticmethod
    @backward_outside_autocast
    def backward(ctx, dz):
        f2, f3 = ctx.points
        header_a, count_a, header_b = ctx.headers
        saved = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            g, g2 = f3.quantize_chain(dz, dz.dim() - 2, f2, dz.dim() - 1)  # as in the linear
            stash_b_t = _stash_restore(header_b, saved[count_a:]).unpack()
            da = units.gemm(g2, stash_b_t, ctx.plans[1], "matmul.da")
        else:
            g = f3.quantize(dz, dz.dim() - 2)
        if ctx.needs_input_grad[1]:
            stash_a = _stash_restore(header_a, saved[:count_a]).unpack()
            db = units.gemm(stash_a.transpose(-1, -2), g, ctx.plans[2], "matmul.db")
        return da, db, None, None


@outside_autocast
def dsq_linear(x, weight, bias, cfg: QuantConfig):
    """``F.linear`` with DSQ quantization (see ``DSQLinearFunction``)."""
    # grad mode is off inside Function.forward, so whether a backward can come is decided here
    training = torch.is_grad_enabled()
    y = DSQLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, cfg, training)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@outside_autocast
def dsq_matmul(a, b, cfg: QuantConfig):
    """``a @ b`` of two activations with DSQ quantization (see ``DSQMatmulFunction``)."""
    return DSQMatmulFunction.apply(a, b, cfg, torch.is_grad_enabled())
