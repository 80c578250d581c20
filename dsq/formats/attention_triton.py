"""The tiled attention's two passes on the triton backend (docs/dsq.md, "Attention in tiles"):
the host glue of ``dsq/kernels/attention.py``, as ``compute.py`` is the GEMM kernels' (the engine
reaches the kernels only through formats).

`attention.attention_forward` and `attention.attention_backward` run these where the formats'
quantizers run on the triton backend (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``
with ``DSQ_BACKEND=triton``) and `unsupported_reason` finds nothing the kernels lack; otherwise
the tiled torch kernel runs, and a logged line says why. The values are the torch kernel's: the
same quantized values but where a float32 sum's order moves one across a rounding boundary
(tests/dsq/kernels/test_attention_triton.py states the tolerance).

What the kernels do not hold, and the torch kernel does: stochastic rounding at a point that
quantizes inside them (q0 of ``Pd``, q1, q2, q3), dropout, NVFP4 and static fixed point inside
them, inputs other than float32, heads other than 16, 32, 64 or 128 values wide, tensors of
2^31 elements or more, and blocks that do not divide a tile.
"""

from __future__ import annotations

import torch

from .base import Format

# rows of a query tile and keys of a key tile: multiples of every block the kernels take
TILE = 64

# launch options: no fused multiply-add (a product and a sum each rounded, as torch's)
_OPTS = {"enable_fp_fusion": False}


def point_constants(fmt: Format) -> tuple | None:
    """A point's constexprs for the kernels (family, block, widths), or None where they lack it."""
    from .bfp import BFP
    from .floats import FP32
    from .mx import MX

    if isinstance(fmt, FP32):
        return (0, 0, 0, 0, 0, 0.0, False)
    if isinstance(fmt, BFP):
        if fmt.block is not None and TILE % fmt.block:
            return None
        emax = 2 ** (fmt.exp_bits - 1) - 1
        return (1, fmt.block or 0, fmt.man_bits, 0, emax, 0.0, False)
    if isinstance(fmt, MX):
        if TILE % fmt.block:
            return None
        e = fmt.element
        return (2, fmt.block, e.man_bits, e.emin, e.emax, float(e.max_normal), e.integer)
    return None


def _named(prefix: str, constants: tuple) -> dict:
    names = ("F", "B", "M", "EMIN", "EMAX", "MAXN", "INT")
    return {f"{name}{prefix}": value for name, value in zip(names, constants, strict=True)}


def unsupported_reason(q0, k0, v0, points: tuple, dropout: float, *others) -> str | None:
    """What the Triton kernels lack for this call, or None when they run it; ``points`` are
    q0..q3 as the engine's calls hold them (each with ``fmt`` and ``rounding``), ``others`` the
    backward pass's other tensors."""
    if dropout > 0:
        return "dropout"
    for t in (q0, k0, v0, *others):
        if t.dtype != torch.float32:
            return f"inputs in {t.dtype}"
    for width in (q0.shape[-1], v0.shape[-1]):
        if width < 16 or width > 128 or width & (width - 1):  # wider: a tile's registers spill
            return f"heads of width {width} (they take 16, 32, 64 or 128)"
    b, heads, n, _ = q0.shape
    largest = max(b * heads * n * max(q0.shape[-1], v0.shape[-1]), b * heads * n * k0.shape[2],
                  *(t.numel() for t in (k0, v0)))  # fmt: skip
    if largest >= 2**31:  # their offsets are int32
        return f"a tensor of {largest} elements (at most 2^31 - 1)"
    for i, point in enumerate(points):
        if point_constants(point.fmt) is None:
            return f"q{i}'s format {point.fmt.spec}"
        if point.rounding != "nearest":
            return f"q{i}'s {point.rounding} rounding"
    return None


def _whole(point) -> bool:
    return point.fmt.whole_tensor_scale


def _masks(mask, key_padding, shape, device):
    """(mask kind, the mask as [B, H, N, M] strides' tensor, its strides, key padding int8)."""
    b, h, n, m = shape
    if mask is None:
        kind, tensor, strides = 0, torch.zeros(1, device=device), (0, 0, 0, 0)
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        tensor = mask.to(torch.int8 if kind == 1 else torch.float32).expand(b, h, n, m)
        strides = tensor.stride()
    if key_padding is None:
        padding = torch.zeros(1, dtype=torch.int8, device=device)
    else:
        padding = key_padding.to(torch.int8).contiguous()
    return kind, tensor, strides, padding


def _bits(amax: torch.Tensor | None, device) -> torch.Tensor:
    """The int32 bits of a float32 largest magnitude (a whole-tensor scale's), or zeros."""
    if amax is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return amax.to(torch.float32).reshape(1).view(torch.int32)


def _common(q0, k0, mask, key_padding, scaling, causal, folded):
    b, heads, n, d = q0.shape
    kv_heads, m = k0.shape[1], k0.shape[2]
    kind, tensor, strides, padding = _masks(mask, key_padding, (b, heads, n, m), q0.device)
    args = (tensor, *strides, padding, n, m, heads, kv_heads, scaling)
    flags = {"MASK_KIND": kind, "CAUSAL": causal and mask is None, "HAS_KP": key_padding
             is not None, "FOLDED": folded, "BM": TILE, "BN": TILE}  # fmt: skip
    return args, flags, -(-n // TILE), -(-m // TILE)


def forward(q0, k0, v0, mask, key_padding, points, scaling: float, causal: bool, folded: bool):
    """(O, amax of Pd or None) as `attention.attention_forward`; ``q0`` already scaled where
    ``folded``."""
    from dsq.kernels.attention import _forward_kernel

    b, heads, n, d = q0.shape
    e = v0.shape[-1]
    q0, k0, v0 = q0.contiguous(), k0.contiguous(), v0.contiguous()
    args, flags, q_tiles, _ = _common(q0, k0, mask, key_padding, scaling, causal, folded)
    f0 = _named("0", point_constants(points[0].fmt))
    amax = None
    if _whole(points[0]) or _whole(points[1]):
        parts = torch.zeros(b * heads * q_tiles, dtype=torch.int32, device=q0.device)
        _forward_kernel[(b * heads, q_tiles)](q0, k0, v0, q0, parts, parts, *args, D=d, E=e,
                                              AMAX=True, **flags, **f0, **_OPTS)  # fmt: skip
        amax = parts.amax().reshape(1).view(torch.float32).reshape(())
    out = q0.new_empty(b, heads, n, e)
    g0 = _bits(amax if _whole(points[0]) else None, q0.device)
    _forward_kernel[(b * heads, q_tiles)](q0, k0, v0, out, g0, g0, *args, D=d, E=e, AMAX=False,
                                          **flags, **f0, **_OPTS)  # fmt: skip
    return out, amax


def backward(g_out, g2_out, q0, k0, q1, k1, v1, amax_pd, mask, key_padding, points,
             scaling: float, causal: bool, folded: bool):  # fmt: skip
    """(dQ, dK, dV) as `attention.attention_backward`, from ``g_out`` = q3(dO) and ``g2_out`` =
    q2(g_out) (times the scaling where ``folded``, as ``q0``)."""
    from dsq.kernels.attention import _keys_kernel, _rows_kernel

    b, heads, n, d = q0.shape
    kv_heads, m, e = k0.shape[1], k0.shape[2], v1.shape[-1]
    q0, k0, q1, k1, v1 = (t.contiguous() for t in (q0, k0, q1, k1, v1))
    g_out, g2_out = g_out.contiguous(), g2_out.contiguous()
    args, flags, q_tiles, k_tiles = _common(q0, k0, mask, key_padding, scaling, causal, folded)
    f1, f2, f3 = (_named(str(i), point_constants(points[i].fmt)) for i in (1, 2, 3))
    stats = q0.new_empty(b * heads, 3, n)
    parts = torch.zeros(b * heads * q_tiles, dtype=torch.int32, device=q0.device)
    dq = torch.empty_like(q0)
    zero = _bits(None, q0.device)
    grid = (b * heads, q_tiles)

    def rows(mode, g2, g3):
        _rows_kernel[grid](q0, k0, v1, g2_out, k1, stats, parts, dq, g2, g3, *args, D=d, E=e,
                           MODE=mode, **flags, **f2, **f3, **_OPTS)  # fmt: skip
        return parts.amax().reshape(1)

    rows(0, zero, zero)
    g3 = rows(1, zero, zero) if _whole(points[3]) else zero
    g2 = rows(2, zero, g3) if _whole(points[2]) else zero
    rows(3, g2, g3)
    dk_t = k0.new_empty(b, kv_heads, d, m)
    dv = k0.new_empty(b, kv_heads, m, e)
    g1 = _bits(amax_pd if _whole(points[1]) else None, q0.device)
    _keys_kernel[(b * kv_heads, k_tiles)](
        q0, k0, v1, g_out, g2_out, q1, stats, dk_t, dv, g1, g3, *args, D=d, E=e, **flags, **f1,
        **f3, **_OPTS,
    )  # fmt: skip
    return dq, dk_t.transpose(-1, -2), dv
