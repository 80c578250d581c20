"""Inputs of the attention kernels' tests: q, k, v and an incoming gradient, a preset's config,
and the keywords of each mask kind."""

from __future__ import annotations

import torch

from dsq.engine import QuantConfig
from dsq.presets import get_preset

MASKS = ("causal", "boolean", "additive", "none", "padding")


def cfg_of(preset: str, **changes) -> QuantConfig:
    return QuantConfig.from_dict(get_preset(preset).to_dict() | changes)


def inputs(b=2, heads=4, kv_heads=2, n=75, m=75, d=16, e=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=g).requires_grad_()
    k = torch.randn(b, kv_heads, m, d, generator=g).requires_grad_()
    v = torch.randn(b, kv_heads, m, e, generator=g).requires_grad_()
    return q, k, v, torch.randn(b, heads, n, e, generator=g)


def mask_keywords(kind: str, b: int, n: int, m: int) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "causal":
        return {"causal": True}
    if kind == "boolean":  # a padded batch, and a query row that attends to nothing
        keep = torch.rand(b, 1, n, m, generator=g) > 0.3
        keep[0, 0, 3] = False
        return {"mask": keep}
    if kind == "additive":
        return {"mask": torch.randn(b, 1, n, m, generator=g)}
    if kind == "padding":  # fairseq's pair: an additive causal mask and padded keys
        future = torch.triu(torch.full((n, m), -torch.inf), 1)
        padded = torch.zeros(b, m, dtype=torch.bool)
        padded[0, -5:] = True
        return {"mask": future, "key_padding": padded}
    return {}
