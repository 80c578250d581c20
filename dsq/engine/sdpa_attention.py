"""Attention in torch's fused kernel, in bf16, on DSQ's inputs (docs/dsq.md, "Attention in
torch's fused kernel"): the rule ``quant.attention=sdpa_bf16``.

With ``q [B, H, N, d]``, ``k [B, Hkv, M, d]``, ``v [B, Hkv, M, e]``:

    Q0, K0, V0 = bf16(q0(Q)), bf16(q0(K)), bf16(q0(V))   blocks along d, d and the keys, as
                                                          the explicit path quantizes them
    O = float32(scaled_dot_product_attention(Q0, K0, V0))  torch's kernel: S = Q0 K0^T in
                                                          float32 sums, the softmax in float32,
                                                          P rounded to bf16 for P V0

Backward: ``dO`` rounded to bf16, torch's kernel's gradients (dS formed in float32, rounded to
bf16 for its two GEMMs), and ``dQ``, ``dK``, ``dV`` returned as float32 to the projections,
straight through the quantizer (as every DSQ GEMM's input gradient passes its q0). So the
attention's products are bf16 products, the rest of the layer DSQ's: ``P`` is not quantized in
q0, and neither dO nor dS in q2 or q3. A q0 whose values bf16 cannot hold (``fixed16``, a
float32 point) is rounded to bf16 on top (dsq's bfp8 and every MX and NVFP4 element fit).

What the backward pass holds is what torch's kernel saves: ``Q0``, ``K0``, ``V0`` and ``O`` in
bf16 and one float32 per query row and head (the log-sum-exp). Under ``stash_scope=all``
(`patch.held_as_saved`) ``Q0``, ``K0`` and ``V0`` are packed in q0 where q0's values are bf16
numbers, which gives back the same values, and ``O`` and the log-sum-exp are held as they are:
a narrower copy of either would change the gradient the kernel computes, not only round it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import accounting, units
from .attention import repeat_heads
from .config import POINTS, QuantConfig
from .functions import _points, backward_outside_autocast, outside_autocast
from .patch import held_as_saved

# the products' formats as the cost model reads them: bf16 inputs at every point
_BF16_POINTS = dict.fromkeys(POINTS, "bf16")


class _Bf16Products:
    """What `accounting.note` reads of a config (``current()``): the two products in bf16."""

    @staticmethod
    def current() -> dict[str, str]:
        return dict(_BF16_POINTS)


class _InputsInQ0(torch.autograd.Function):
    """``(bf16(q0(Q)), bf16(q0(K)), bf16(q0(V)))``; the gradients pass straight through to
    float32. The backward pass counts the kernel's four backward GEMMs (two of each product)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):
        f0 = _points(cfg, q.device)[0]
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return tuple(f0.quantize(x, axis).to(torch.bfloat16)
                     for x, axis in ((q, -1), (k, -1), (v, -2)))  # fmt: skip

    @staticmethod
    @backward_outside_autocast
    def backward(ctx, dq, dk, dv):
        units.count("matmul.da", "bf16", 2)
        units.count("matmul.db", "bf16", 2)
        grads = (None if g is None else g.to(dtype) for g, dtype in zip((dq, dk, dv), ctx.dtypes))
        return (*grads, None)


def _takes_enable_gqa() -> bool:
    """Whether torch's kernel reads grouped key/value heads itself (``enable_gqa``: torch 2.5+)."""
    return units.torch_at_least(2, 5)


def sdpa_mask(mask, key_padding, causal: bool, n: int, m: int) -> torch.Tensor | None:
    """``mask`` (boolean, True where a query may attend, or additive, broadcastable to
    ``[B, H, N, M]``), ``key_padding [B, M]`` (True where padded) and, where there is no mask,
    the causal rule ``j <= i``, as one mask for torch's kernel: None where the causal rule alone
    applies (the kernel's own flag), boolean, or additive in bf16 (the queries' dtype, as the
    kernel requires) with forbidden keys at -inf."""
    if key_padding is None:
        if mask is None or mask.dtype == torch.bool:
            return mask
        return mask.to(torch.bfloat16)
    keep = ~key_padding.bool()[:, None, None, :]
    if mask is None and causal:
        keep = keep & torch.ones(n, m, dtype=torch.bool, device=keep.device).tril()
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.to(torch.bfloat16).masked_fill(~keep, -torch.inf)


@outside_autocast
def sdpa_attention(q, k, v, cfg: QuantConfig, *, scaling: float | None = None, mask=None,
                   causal: bool = False, key_padding=None, dropout: float = 0.0,
                   training: bool = True) -> torch.Tensor:  # fmt: skip
    """Attention in torch's fused kernel on DSQ's q0 inputs (module docstring), with the
    arguments of `dsq_attention`: ``q [B, H, N, d]``, ``k [B, Hkv, M, d]``, ``v [B, Hkv, M, e]``
    -> float32 ``[B, H, N, e]``. Dropout is torch's kernel's, drawn from torch's generator."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    n, m = q.shape[-2], k.shape[-2]
    q0, k0, v0 = _InputsInQ0.apply(q, k, v, cfg)
    f0 = cfg.format("q0")
    lossless = "bf16" in f0.exact_in  # q0's values are bf16 numbers: packed in q0, unchanged
    if lossless:
        for x, axis in ((q0, -1), (k0, -1), (v0, -2)):
            x.dsq_held_in = (f0, axis)  # how `patch.held_as_saved` packs it under stash_scope=all
    attn_mask = sdpa_mask(mask, key_padding, causal, n, m)
    grouped = {}
    if heads != kv_heads and _takes_enable_gqa():
        grouped = {"enable_gqa": True}
    elif heads != kv_heads:  # torch 2.4: each key/value head repeated for its query heads
        k0, v0 = repeat_heads(k0, heads), repeat_heads(v0, heads)
    with held_as_saved():
        out = F.scaled_dot_product_attention(
            q0, k0, v0, attn_mask=attn_mask, dropout_p=dropout if training else 0.0,
            is_causal=causal and mask is None and key_padding is None, scale=scaling,
            **grouped,
        )  # fmt: skip
    units.count("matmul.forward", "bf16", 2)
    b = q.shape[0]
    # what the kernel saves: Q0, K0, V0 (packed in q0 under stash_scope=all where that is
    # lossless, else bf16) and O in bf16, a float32 per query row and head
    inputs_bits = f0.bits_per_value if lossless and cfg.stash_scope == "all" else 16
    inputs = q0.numel() + k0.numel() + v0.numel()
    held = int(inputs * inputs_bits / 8) + 2 * out.numel() + 4 * b * heads * n
    accounting.note("matmul", b * heads, n, q.shape[-1], m, _Bf16Products, held)
    accounting.note("matmul", b * heads, n, m, v.shape[-1], _Bf16Products, 0)
    return out.to(q.dtype)
