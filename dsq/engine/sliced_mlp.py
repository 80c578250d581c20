"""A Llama-style MLP, ``y = down(silu(gate(x)) * up(x))``, run a slice of tokens at a time
(docs/dsq.md, "The MLP in slices").

The definition, `swiglu_definition`, is three DSQ linear layers around `silu_product`. Its
backward pass holds, for each token, the stashes of ``x`` (once per layer that reads it) and of
the product ``p``, and ``g = gate(x)`` and ``u = up(x)`` in float32; its forward pass makes
``g``, ``u``, ``p`` and ``p``'s quantized copies, each as wide as the MLP, for every token at once.
`sliced_swiglu` computes the same values holding ``x`` alone for the backward pass, and making
nothing of the MLP's width for more than one slice of tokens at a time.

Shapes: ``x [N, K]`` (N tokens), the gate's and up's weights ``[F, K]``, the down's ``[K, F]``,
``dy [N, K]``. With the GEMMs and blocks of `DSQLinearFunction`, per slice ``r`` of the rows:

* forward:   ``g_r = q0(x_r) q0(W_g)^T``, ``u_r = q0(x_r) q0(W_u)^T``      blocks along K
             ``p_r = silu(g_r) * u_r``
             ``y_r = q0(p_r) q0(W_d)^T``                                   blocks along F
  saved: ``x`` as it is, and nothing of the MLP's width;
* backward:  ``h = q3(dy)``, blocks along N, whole (``dy`` is K wide); then per slice ``g_r``,
  ``u_r`` and ``p_r`` again (the forward's values), and
             ``dp_r  = q2(h_r) q2(W_d)``                                   blocks along K
             ``dW_d += h_r^T q1(p_r)``                                     blocks along N
             ``dg_r  = silu'(g_r) u_r dp_r``, ``du_r = silu(g_r) dp_r``      (`silu_product`'s)
             ``a_r = q3(dg_r)``, ``b_r = q3(du_r)``                          blocks along N
             ``dx_r  = q2(a_r) q2(W_g) + q2(b_r) q2(W_u)``                   blocks along F
             ``dW_g += a_r^T q1(x_r)``, ``dW_u += b_r^T q1(x_r)``              blocks along N
  and each bias's gradient the sum over N of its layer's ``h``, ``a`` or ``b``.

Slices start on multiples of every format's block, so no block along N straddles two, and
hold at least 64 rows (`units.row_slices`). A format whose scale spans the tensor (``fixed<w>``,
NVFP4) is given the whole tensor's largest magnitude (`parts`): found directly for ``x`` and
``h``, which exist whole, and by a pass over the slices first for the tensors that exist a slice
at a time (``p`` in the forward pass; ``dg``, ``du`` and, for q2, their q3 in the backward pass).
So every quantized value is the definition's: ``y`` and ``dx`` are the definition's bit for bit
where its GEMMs give each row the same bits in a slice as in the whole (the bf16 unit does; a
float32 GEMM of fewer than about 192 rows may round a row's sum differently:
`units.gemm_by_rows`), and the weight and bias gradients differ from it in the order of their
float32 sums over slices (summed in float32 for a narrower model too, then rounded once, as one
GEMM rounds). Under autocast the two layers' input gradients are added in the input's dtype, as
autograd adds the gradients of its two casts. Where such a tensor holds a NaN or an infinity,
which a scale spanning the tensor spreads to every value, that call runs the definition instead
(from the one float32 copy of the input, under autocast), as it does for no tokens at all.

Every point must round to nearest: stochastic rounding draws its noise for a whole tensor.

The price is time: the backward pass runs the gate's and up's forward GEMMs again (and, for a
pass that finds a largest magnitude, those and the down layer's input-gradient GEMM once more),
as activation checkpointing of the MLP alone would. In a checkpointed layer's run again, where
no backward reads the MLP's output, the forward pass computes none of it (`unread_outputs`).
`accounting` notes the definition's three layers, with the definition's stash bytes (none where
it would pack no stash); the tally (`units.tally`) counts each kind of GEMM of each layer once a
call of the function that runs it, the gate's and up's forward GEMMs again in the backward pass,
whatever passes for a largest magnitude ran besides.

Under ``stash_scope=all`` the definition's saved activations and products are held by the
rules (``bfp8``, derivative codes), while the slices compute them again exactly: there the two
differ by those rules' rounding, and the MLP's gradients are ``stash_scope=gemm``'s.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from . import accounting, units, unread_outputs
from .config import POINTS, QuantConfig
from .functions import (
    _AUTOCAST_DTYPES,
    _Point,
    _points,
    backward_outside_autocast,
    dsq_linear,
    outside_autocast,
)
from .parts import finite_largest_magnitude, largest_magnitude, quantize_chain_part, quantize_part
from .spec import sliced_mlp_rounding_error
from .swiglu import silu_product

# the values of the MLP's width in one slice (4 MiB in float32): a few such tensors are alive at
# once, whatever the batch, and the GEMMs stay large enough to run at their unit's rate
SLICE_ELEMENTS = 2**20


def swiglu_definition(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg: QuantConfig):
    """``down(silu(gate(x)) * up(x))`` with three DSQ linear layers: what `sliced_swiglu`
    computes."""
    g = dsq_linear(x, w_gate, b_gate, cfg)
    u = dsq_linear(x, w_up, b_up, cfg)
    return dsq_linear(silu_product(g, u), w_down, b_down, cfg)


def slice_rows(n: int, width: int, formats) -> int:
    """Rows of a slice: about `SLICE_ELEMENTS` values of the MLP's ``width``, a multiple of every
    format's block and of `units.SLICE_ROWS`, at most ``n``."""
    multiple = units.SLICE_ROWS
    for fmt in formats:
        multiple = math.lcm(multiple, getattr(fmt, "block", None) or 1)
    return max(1, min(n, max(multiple, SLICE_ELEMENTS // max(1, width) // multiple * multiple)))


def check_rounding(points) -> None:
    """ValueError unless every point rounds to nearest (module docstring)."""
    stochastic = [f"q{i}" for i, p in enumerate(points) if p.rounding != "nearest"]
    if stochastic:
        raise sliced_mlp_rounding_error(stochastic)


def _whole(point: _Point) -> bool:
    return point.fmt.whole_tensor_scale


def _amax_of(point: _Point, x: torch.Tensor):
    """The largest magnitude of a whole ``x`` where ``point``'s scale spans the tensor, else
    None (`quantize_part`'s ``amax``)."""
    return largest_magnitude(x) if _whole(point) else None


def _rows_of(point: _Point, x: torch.Tensor, axis: int):
    """A function of a slice ``r`` giving ``point.quantize(x, axis)[r]``. ``x`` is a tensor that
    exists whole and may be the caller's (never written to): where ``point``'s scale spans the
    tensor it is quantized whole once, else a slice at a time."""
    if _whole(point):
        whole = point.quantize(x, axis)
        return lambda r: whole[r]
    return lambda r: point.quantize(x[r], axis)


@dataclasses.dataclass
class _Layers:
    """One call's points, plans and slices, and its three layers' weights and biases."""

    points: tuple[_Point, _Point, _Point, _Point]
    plans: list
    slices: list[slice]
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [F, K], up [F, K], down [K, F]
    biases: tuple

    @classmethod
    def of(cls, x2, weights, biases, points, cfg: QuantConfig) -> _Layers:
        f0, f1, f2, f3 = points
        n, k = x2.shape
        width = weights[0].shape[0]
        # the three layers take N K F multiply-adds each: one plan a GEMM kind serves them all,
        # the one the definition's layers make
        plans = [units.plan(a.fmt, b.fmt, x2.device, cfg.gemm_unit, n * k * width)
                 for a, b in ((f0, f0), (f2, f2), (f3, f1))]  # fmt: skip
        slices = units.row_slices(n, slice_rows(n, width, [p.fmt for p in points]))
        return cls(points, plans, slices, tuple(weights), tuple(biases))

    def forward_gemms(self, layers: int = 3):
        """The forward GEMMs of the first ``layers`` of gate, up and down (the backward pass
        needs gate's and up's alone), each run a slice of rows at a time."""
        f0 = self.points[0]
        return [units.RowsOfGemm(f0.quantize(w, 1).t(), self.plans[0], b)
                for w, b in zip(self.weights[:layers], self.biases[:layers])]  # fmt: skip

    def activations(self, x0_of, r, gemms):
        """(g_r, u_r, p_r) of slice ``r``; ``x0_of`` gives q0(x)'s rows."""
        x0 = x0_of(r)
        g, u = gemms[0](x0), gemms[1](x0)
        del x0
        return g, u, F.silu(g) * u

    def largest(self, parts):
        """(the largest magnitude over the slices of each tensor ``parts(r)`` gives, whether
        every value was finite); at the first NaN or infinity, (None, False): the caller runs
        the definition."""
        found = None
        for r in self.slices:
            amaxes = [finite_largest_magnitude(t) for t in parts(r)]
            if any(amax is None for amax in amaxes):
                return None, False
            amaxes = torch.stack(amaxes)
            found = amaxes if found is None else torch.maximum(found, amaxes)
        return list(found), True


class SlicedSwiGLUFunction(torch.autograd.Function):
    """`sliced_swiglu` (module docstring)."""

    @staticmethod
    def forward(ctx, x2, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg: QuantConfig,
                training: bool, narrow: torch.dtype | None):  # fmt: skip
        points = _points(cfg, x2.device)
        check_rounding(points)
        f0, f1 = points[0], points[1]
        weights, biases = (w_gate, w_up, w_down), (b_gate, b_up, b_down)
        layers = _Layers.of(x2, weights, biases, points, cfg)
        ctx.points, ctx.cfg, ctx.narrow = points, cfg, narrow
        ctx.biases = tuple(b is not None for b in biases)
        # the definition packs a layer's stash where a backward pass can come and its weight
        # needs a gradient
        stashed = [training and ctx.needs_input_grad[1 + i] for i in range(3)]
        _note(x2, weights, points, layers, cfg, stashed)
        if x2.shape[0] == 0:  # no slice to run
            return _forward_whole(ctx, x2, weights, biases, cfg)
        gemms = x0_of = amax_p = None
        if _whole(f0) or _whole(f1):  # p's largest magnitude, a pass over the slices first
            gemms, x0_of = layers.forward_gemms(), _rows_of(f0, x2, 1)
            found, finite = layers.largest(lambda r: layers.activations(x0_of, r, gemms)[2:])
            if not finite:
                return _forward_whole(ctx, x2, weights, biases, cfg)
            (amax_p,) = found
        ctx.whole = False
        ctx.amax_p = amax_p if _whole(f1) else None
        # x as it is, the slices' values made again from it: a stash_scope=all hook leaves it be
        x2.dsq_held_as_is = True
        ctx.save_for_backward(x2, *weights, *(b for b in biases if b is not None))
        # a checkpointed layer run again for its backward pass, which reads no value of y
        # (the gate's weight as passed, a parameter: where a read output is marked)
        unread = None
        if training:
            unread = unread_outputs.placeholder(x2.shape[0], w_down.shape[0], x2, w_gate)
        if unread is not None:
            for gemm in gemms or ():  # the pass for p's largest magnitude ran them
                gemm.count("linear.forward")
            return unread
        if gemms is None:
            gemms, x0_of = layers.forward_gemms(), _rows_of(f0, x2, 1)
        y = x2.new_empty(x2.shape[0], w_down.shape[0])
        for r in layers.slices:
            p = layers.activations(x0_of, r, gemms)[2]
            y[r] = gemms[2](quantize_part(f0, p, 1, amax_p if _whole(f0) else None))
            del p
        for gemm in gemms:
            gemm.count("linear.forward")
        return y

    @staticmethod
    @backward_outside_autocast
    def backward(ctx, dy):
        x2, *rest = ctx.saved_tensors
        weights = tuple(rest[:3])
        rest = iter(rest[3:])
        biases = tuple(next(rest) if has else None for has in ctx.biases)
        if ctx.whole:
            return _backward_whole(ctx, dy, x2, weights, biases)
        f0, f1, f2, f3 = ctx.points
        w_gate, w_up, w_down = weights
        layers = _Layers.of(x2, weights, biases, ctx.points, ctx.cfg)
        gemms = layers.forward_gemms(2)  # gate and up: the product again
        x0_of, x1_of = _rows_of(f0, x2, 1), _rows_of(f1, x2, 0)
        h = f3.quantize(dy, 0)  # q3(dy), whole: blocks along N
        h2_of = _rows_of(f2, h, 1)
        dp_of = units.RowsOfGemm(f2.quantize(w_down, 0), layers.plans[1])

        def gradients(r):
            """(dg_r, du_r, p_r): the product's gradients and the product."""
            g, u, p = layers.activations(x0_of, r, gemms)
            dp = dp_of(h2_of(r))
            d_g = torch.ops.aten.silu_backward(dp * u, g)
            d_u = F.silu(g).mul_(dp)
            return d_g, d_u, p

        amax_dg = amax_du = amax_a = amax_b = None
        if _whole(f3):
            found, finite = layers.largest(lambda r: gradients(r)[:2])
            if not finite:
                return _backward_whole(ctx, dy, x2, weights, biases)
            amax_dg, amax_du = found
        if _whole(f2):

            def quantized(r):
                d_g, d_u = gradients(r)[:2]
                return quantize_part(f3, d_g, 0, amax_dg), quantize_part(f3, d_u, 0, amax_du)

            found, finite = layers.largest(quantized)
            if not finite:
                return _backward_whole(ctx, dy, x2, weights, biases)
            amax_a, amax_b = found
        wanted = ctx.needs_input_grad
        dx_of = [units.RowsOfGemm(f2.quantize(w, 0), layers.plans[1]) for w in (w_gate, w_up)]
        dw_of = [units.RowsOfGemm(None, layers.plans[2]) for _ in range(3)]  # gate, up, down
        dx = x2.new_empty(x2.shape) if wanted[0] else None
        dw, db = [None] * 3, [None] * 3
        for r in layers.slices:
            d_g, d_u, p = gradients(r)
            if wanted[3]:
                p1 = quantize_part(f1, p, 0, ctx.amax_p)
                dw[2] = _add(dw[2], dw_of[2](_float32(h[r].t()), _float32(p1)))
                del p1
            del p
            a, a2 = quantize_chain_part(f3, f2, d_g, amax_dg, amax_a)
            b, b2 = quantize_chain_part(f3, f2, d_u, amax_du, amax_b)
            del d_g, d_u
            if wanted[0]:
                dx_g, dx_u = dx_of[0](a2), dx_of[1](b2)
                if ctx.narrow is not None:
                    # under autocast each layer's float32 input was a cast of the narrower x, and
                    # autograd adds the two casts' gradients in x's dtype
                    dx_g, dx_u = dx_g.to(ctx.narrow), dx_u.to(ctx.narrow)
                dx[r] = dx_g.add_(dx_u)
                del dx_g, dx_u
            del a2, b2
            if wanted[1] or wanted[2]:
                x1 = _float32(x1_of(r))
                if wanted[1]:
                    dw[0] = _add(dw[0], dw_of[0](_float32(a.t()), x1))
                if wanted[2]:
                    dw[1] = _add(dw[1], dw_of[1](_float32(b.t()), x1))
                del x1
            for i, grad in enumerate((a, b, h[r])):
                if wanted[4 + i]:
                    db[i] = _add(db[i], grad.float().sum(0))
            del a, b
        for gemm in gemms:  # the forward's, run again
            gemm.count("linear.forward")
        for gemm in (dp_of, *dx_of):
            gemm.count("linear.dx")
        for gemm in dw_of:
            gemm.count("linear.dw")
        # the sums over slices were float32; each gradient in its parameter's dtype
        dw = [None if g is None else g.to(w.dtype) for g, w in zip(dw, weights)]
        db = [None if g is None else g.to(b.dtype) for g, b in zip(db, biases)]
        return dx, *dw, *db, None, None, None


def _float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (a weight gradient's part, summed over slices in float32 as one GEMM
    sums it, not rounded to a narrower dtype slice by slice)."""
    return x if x.dtype == torch.float32 else x.float()


def _add(total, part):
    return part if total is None else total.add_(part)


def _note(x2, weights, points, layers: _Layers, cfg: QuantConfig, stashed) -> None:
    """The definition's three GEMM records (`accounting.note`), each with the bytes of its stash
    where ``stashed`` says the definition packs one: a stash of the definition's shape in q1
    (packed on the meta device: shapes, no values)."""
    if not accounting.noting():
        return
    f1 = points[1]
    n, k = x2.shape
    width = weights[0].shape[0]
    meta = torch.empty(n, k, device="meta", dtype=x2.dtype)  # q1 fp32 holds the input's dtype
    x_bytes = f1.fmt.pack(meta, 0).nbytes
    p_bytes = f1.fmt.pack(meta.new_empty(n, width), 0).nbytes
    shapes = ((x_bytes, width, k), (x_bytes, width, k), (p_bytes, k, width))
    for (stash_bytes, m, kk), packs in zip(shapes, stashed, strict=True):
        accounting.note("linear", 1, n, kk, m, cfg, stash_bytes if packs else 0, layers.plans)


def _forward_whole(ctx, x2, weights, biases, cfg):
    """The definition's forward pass (a NaN or an infinity where a scale spans a tensor the
    slices make): the backward pass runs the definition too."""
    ctx.whole = True
    with accounting.recomputation():  # noted as the definition's already
        y = swiglu_definition(x2, *weights, *biases, cfg)
    x2.dsq_held_as_is = True
    ctx.save_for_backward(x2, *weights, *(b for b in biases if b is not None))
    return y


def _backward_whole(ctx, dy, x2, weights, biases):
    """The definition's gradients, its forward pass run again whole (under autocast, from the
    one float32 copy of ``x``: the two layers' input gradients added in float32, where autograd
    adds the casts' in ``x``'s dtype)."""
    x = x2.detach().requires_grad_(ctx.needs_input_grad[0])
    inputs = (x, *weights, *biases)
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
    # the formats the forward pass ran (a schedule may have stepped since)
    formats = {point: p.fmt for point, p in zip(POINTS, ctx.points, strict=True)}
    cfg = QuantConfig(**formats, gemm_unit=ctx.cfg.gemm_unit)
    with torch.enable_grad(), accounting.recomputation():
        y = swiglu_definition(*inputs, cfg)
        grads = torch.autograd.grad(y, [inputs[i] for i in wanted], dy, allow_unused=True)
    out = [None] * (len(inputs) + 3)  # and the config's, training's and narrow's
    for i, grad in zip(wanted, grads):
        out[i] = grad
    return tuple(out)


def sliced_swiglu(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg: QuantConfig):
    """`swiglu_definition`'s values, a slice of tokens at a time (module docstring)."""
    narrow = None
    if x.dtype in _AUTOCAST_DTYPES and torch.is_autocast_enabled(x.device.type):
        narrow = x.dtype  # autocast casts it to float32 for each layer (`outside_autocast`)
    return _sliced_swiglu(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg, narrow)


@outside_autocast
def _sliced_swiglu(x, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg: QuantConfig, narrow):
    # grad mode is off inside Function.forward, so whether a backward can come is decided here
    training = torch.is_grad_enabled()
    x2 = x.reshape(-1, x.shape[-1])
    y = SlicedSwiGLUFunction.apply(x2, w_gate, w_up, w_down, b_gate, b_up, b_down, cfg, training,
                                   narrow)  # fmt: skip
    unread_outputs.note(y)
    return y.reshape(*x.shape[:-1], w_down.shape[0])
