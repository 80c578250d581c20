"""Activation checkpointing of whole layers (docs/dsq.md, "What the backward pass holds").

The other way to train with less memory: a checkpointed layer keeps only its input for the
backward pass and runs its forward again there, holding its activations for the length of its
own backward. ``torch.utils.checkpoint`` in its non-reentrant form does this and works with any
layer, patched by DSQ or not, under ``torch.autocast`` or not. A DSQ layer run again packs its
stash again: with nearest rounding the values are those of the first forward (the formats in
force do not change between a forward and its backward). The run's records count each GEMM once,
as its first forward ran it (`accounting.recomputation`). Stochastic rounding would draw new
noise for the second forward, so its stash would not be the one the loss was computed with:
`checkpoint_layers` refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import accounting
from .config import QuantConfig


def _contexts():
    """torch.utils.checkpoint's contexts of the forward pass and of its recomputation: the
    recomputation notes no GEMM, the forward pass already did."""
    return contextlib.nullcontext(), accounting.recomputation()


def checkpoint_layers(layers: Iterable[nn.Module], cfg: QuantConfig | None = None) -> int:
    """Run each of ``layers`` under non-reentrant activation checkpointing from now on (its
    ``forward`` replaced on the instance), where a gradient can follow; return how many. ``cfg``,
    the model's QuantConfig if it is patched: stochastic rounding at any point is refused."""
    if cfg is not None:
        stochastic = [p for p, mode in cfg.rounding.items() if mode == "stochastic"]
        if stochastic:
            raise ValueError(
                f"activation checkpointing runs a layer's forward twice; stochastic rounding at "
                f"{stochastic} would draw other noise the second time. Round to nearest, or "
                "turn checkpointing off"
            )
    count = 0
    for layer in layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False,
                              context_fn=_contexts, **kwargs)  # fmt: skip

        layer.forward = checkpointed
        count += 1
    return count
