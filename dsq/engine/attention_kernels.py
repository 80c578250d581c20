"""The attention function each setting of ``quant.attention`` runs (docs/dsq.md, "Attention in
tiles" and "Attention in torch's fused kernel"): the one place that maps the setting to its
kernel, so an integration asks here rather than naming kernels itself.

Every function here takes ``q [B, H, N, d]``, ``k [B, Hkv, M, d]``, ``v [B, Hkv, M, e]``, the
config, and the keywords ``scaling``, ``mask``, ``causal``, ``key_padding``, ``dropout`` and
``training``, and returns the float32 output ``[B, H, N, e]`` with no probabilities kept.
``explicit`` has none: it is the definition, which an integration runs its own way (the HF
route's `explicit_attention`, which also returns the probabilities; fairseq's own forward with
its products routed to ``dsq_matmul``).
"""

from __future__ import annotations

from collections.abc import Callable

from .attention import dsq_attention
from .config import QuantConfig
from .sdpa_attention import sdpa_attention

ATTENTION_FUNCTIONS: dict[str, Callable] = {"tiled": dsq_attention, "sdpa_bf16": sdpa_attention}


def attention_function(cfg: QuantConfig) -> Callable | None:
    """The function that runs ``cfg.attention``'s two products, or None for ``explicit``."""
    return ATTENTION_FUNCTIONS.get(cfg.attention)
