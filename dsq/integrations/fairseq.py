"""fairseq's ``MultiheadAttention`` under DSQ (registered for models built from fairseq).

Its fast path hands the q/k/v/out projection weights to ``F.multi_head_attention_forward``, where
swapped Linear modules would never run. Patching forces its slow path
(``_set_skip_embed_dim_check``), where the projections are module calls (patched as Linear layers)
and the two products are ``torch.bmm(q, k^T)`` and ``torch.bmm(P, v)``; those ``bmm`` calls are
routed to ``dsq_matmul`` while a patched attention module runs (a proxy for ``torch`` in fairseq's
module namespace, active only inside patched modules).
"""

from __future__ import annotations

import contextvars
import types

import torch
from fairseq.modules import fairseq_dropout, multihead_attention, transformer_layer
from torch import nn

from dsq.engine.config import QuantConfig
from dsq.engine.functions import dsq_matmul
from dsq.engine.masks import dsq_dropout, dsq_relu
from dsq.engine.patch import PatchReport

from . import register_patcher

_ACTIVE_ATTENTION: contextvars.ContextVar[QuantConfig | None] = contextvars.ContextVar(
    "dsq_active_attention", default=None
)
_ATTENTION_TOKENS: dict[int, list] = {}


class _TorchWithDSQBmm(types.ModuleType):
    """Stands for ``torch`` in fairseq's attention module: ``bmm`` goes through ``dsq_matmul``
    while a patched attention module is running, everything else is torch itself."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def bmm(a, b, *args, **kwargs):
        cfg = _ACTIVE_ATTENTION.get()
        if cfg is None or args or kwargs:
            return torch.bmm(a, b, *args, **kwargs)
        return dsq_matmul(a, b, cfg)


def _enter_attention(cfg):
    def hook(module, args):
        _ATTENTION_TOKENS.setdefault(id(module), []).append(_ACTIVE_ATTENTION.set(cfg))

    return hook


def _exit_attention(module, args, output):
    _ACTIVE_ATTENTION.reset(_ATTENTION_TOKENS[id(module)].pop())


class MultiheadAttentionPatcher:
    """fairseq's MultiheadAttention: its slow path, and its two ``bmm`` products routed to
    ``dsq_matmul`` (its projections are Linear layers, patched by the engine's rule)."""

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, multihead_attention.MultiheadAttention)

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        module._set_skip_embed_dim_check()  # the slow path: projections run as modules
        module.register_forward_pre_hook(_enter_attention(cfg))
        module.register_forward_hook(_exit_attention, always_call=True)
        report.attention.append(name)

    def finish(self, model, cfg, report, excluded) -> None:
        if report.attention and not isinstance(multihead_attention.torch, _TorchWithDSQBmm):
            multihead_attention.torch = _TorchWithDSQBmm()


class DSQFairseqDropout(fairseq_dropout.FairseqDropout):
    """fairseq's dropout module with its mask held as bits (`dsq.engine.masks`)."""

    def forward(self, x, inplace: bool = False):
        if self.p > 0 and (self.training or self.apply_during_inference):
            return dsq_dropout(x, p=self.p, training=True, inplace=inplace)
        return x


_LAYERS = (transformer_layer.TransformerEncoderLayerBase,
           transformer_layer.TransformerDecoderLayerBase)  # fmt: skip


class MaskPatcher:
    """fairseq's dropout modules and its transformer layers' ReLU (a function the layer holds,
    ``activation_fn``): their backward passes hold bit masks (`dsq.engine.masks`), with the same
    values and gradients."""

    def claims(self, module: nn.Module) -> bool:
        if type(module) is fairseq_dropout.FairseqDropout:
            return True
        return isinstance(module, _LAYERS) and module.activation_fn is torch.nn.functional.relu

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        if isinstance(module, _LAYERS):
            module.activation_fn = dsq_relu
        else:
            module.__class__ = DSQFairseqDropout
        report.masks.append(name)

    def finish(self, model, cfg, report, excluded) -> None:
        pass


register_patcher("fairseq", MultiheadAttentionPatcher())
register_patcher("fairseq", MaskPatcher())
