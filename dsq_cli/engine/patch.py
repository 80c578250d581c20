"""Patching real models: every Linear (and ``transformers``' Conv1D) through ``dsq_linear``,
attention products through ``dsq_matmul``, and (``stash_scope="all"``) every other saved
activation packed in q1. ``transformers`` models route their attention through ``hf.py``.

fairseq's ``MultiheadAttention`` has a fast path that hands the q/k/v/out projection weights to
``F.multi_head_attention_forward``: swapped Linear modules would never run there. Patching forces
its slow path (``_set_skip_embed_dim_check``), where the projections are module calls and the two
products are ``torch.bmm(q, k^T)`` and ``torch.bmm(P, v)``; those ``bmm`` calls are routed to
``dsq_matmul`` while a patched attention module runs (a proxy for ``torch`` in fairseq's module
namespace, active only inside patched modules). The accounting records count the GEMMs that
really execute.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import importlib
import types

import torch
from torch import nn

from . import hf
from .config import QuantConfig
from .functions import dsq_linear, dsq_matmul

_ACTIVE_ATTENTION: contextvars.ContextVar[QuantConfig | None] = contextvars.ContextVar(
    "dsq_active_attention", default=None
)


class DSQLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``dsq_linear``. Made by re-classing an existing
    Linear in place, so its parameters (and the optimizer's references to them) stay the same."""

    dsq_cfg: QuantConfig

    def forward(self, x):
        return dsq_linear(x, self.weight, self.bias, self.dsq_cfg)


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


def _fairseq_attention():
    """fairseq's MultiheadAttention class and module, or (None, None) without fairseq."""
    try:
        module = importlib.import_module("fairseq.modules.multihead_attention")
    except Exception:  # fairseq missing or broken: plain PyTorch models still patch
        return None, None
    return module.MultiheadAttention, module


@dataclasses.dataclass
class PatchReport:
    """What ``quantize_model`` patched and what it left as it was."""

    linears: list[str] = dataclasses.field(default_factory=list)  # Linear and Conv1D layers
    attention: list[str] = dataclasses.field(default_factory=list)
    excluded: list[str] = dataclasses.field(default_factory=list)
    left: dict[str, int] = dataclasses.field(default_factory=dict)  # module type -> count
    stash_scope: str = "gemm"
    #: GEMMs that will run unquantized: "name (why)", for layers and attention left as they were
    unquantized: list[str] = dataclasses.field(default_factory=list)
    #: how the attention products are computed, where that is not fairseq's own path
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def attention_products(self) -> int:
        return 2 * len(self.attention)

    def summary(self) -> str:
        left = ", ".join(f"{n} x{c}" for n, c in sorted(self.left.items())) or "nothing"
        unquantized = "; ".join(self.unquantized) or "none"
        notes = "".join(f"; {note}" for note in self.notes)
        return (
            f"DSQ patched {len(self.linears)} Linear layers and {self.attention_products} "
            f"attention products in {len(self.attention)} attention modules; excluded "
            f"{len(self.excluded)} ({', '.join(self.excluded) or 'none'}); stash_scope="
            f"{self.stash_scope}; left unquantized: {left}; GEMMs left unquantized: "
            f"{unquantized}{notes}"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"attention_products": self.attention_products}


def _excluded(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# Leaf modules with a weight that do no GEMM: lookups and normalisations.
_NO_GEMM = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
)


def _does_gemm(module: nn.Module) -> bool:
    """A leaf holding a matrix (or larger) weight that is not a lookup or a norm: a custom
    linear, a convolution."""
    if list(module.children()) or isinstance(module, _NO_GEMM) or "Norm" in type(module).__name__:
        return False
    return any(p.dim() >= 2 for p in module.parameters(False))


def quantize_model(
    model: nn.Module, cfg: QuantConfig, exclude=(), strict: bool = False
) -> nn.Module:
    """Patch ``model`` in place for DSQ training and return it; ``model.dsq_report`` tells what
    was patched. ``exclude`` holds glob patterns of module names (``decoder.output_projection``,
    ``*.out_proj``). Works on plain PyTorch, fairseq and ``transformers`` models (docs/hf.md).
    ``strict=True``: a GEMM that would run unquantized (an unknown layer holding a matrix, an
    attention implementation dsq cannot route) is an error instead of a line of the report."""
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig, got {type(cfg).__name__}")
    attention_cls, attention_module = _fairseq_attention()
    conv1d = hf.conv1d_class()
    report = PatchReport(stash_scope=cfg.stash_scope)
    for name, module in model.named_modules():
        if not name:
            continue
        if isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d)):
            if _excluded(name, exclude):
                report.excluded.append(name)
                continue
            if type(module) is nn.Linear:
                module.__class__ = DSQLinear
            else:  # a Linear subclass, or Conv1D
                mixin = DSQLinear if isinstance(module, nn.Linear) else hf.DSQConv1D
                module.__class__ = _dsq_subclass(module, mixin)
            module.dsq_cfg = cfg
            report.linears.append(name)
        elif attention_cls is not None and isinstance(module, attention_cls):
            if _excluded(name, exclude):
                report.excluded.append(name)
                continue
            module._set_skip_embed_dim_check()  # the slow path: projections run as modules
            module.register_forward_pre_hook(_enter_attention(cfg))
            module.register_forward_hook(_exit_attention, always_call=True)
            report.attention.append(name)
        elif not list(module.children()) and any(True for _ in module.parameters(False)):
            kind = type(module).__name__
            report.left[kind] = report.left.get(kind, 0) + 1
            if _does_gemm(module) and not _excluded(name, exclude):
                report.unquantized.append(f"{name} ({kind}: not a layer dsq knows)")
    if hf.is_transformers_model(model):
        try:
            routed, excluded, note = hf.route_attention(model, cfg, lambda n: _excluded(n, exclude))
            report.attention += routed
            report.excluded += excluded
            report.notes.append(note)
        except ValueError as err:
            report.unquantized.append(f"attention products ({err})")
    if strict and report.unquantized:
        raise ValueError(
            "quantize_model(strict=True): GEMMs would run unquantized: "
            + "; ".join(report.unquantized)
        )
    if not report.linears and not report.attention:
        raise ValueError(
            f"quantize_model found nothing to patch in {type(model).__name__}: no nn.Linear or "
            f"attention module outside the excluded patterns {list(exclude)}"
        )
    if report.attention and attention_module is not None:
        attention_module.torch = _TorchWithDSQBmm()
    if cfg.stash_scope == "all":
        model.register_forward_pre_hook(_enter_stash_all(cfg))
        model.register_forward_hook(_exit_stash_all, always_call=True)
    model.dsq_report = report
    model.dsq_cfg = cfg
    return model


_SUBCLASSES: dict[type, type] = {}


def _dsq_subclass(module: nn.Module, mixin: type) -> type:
    """``mixin`` (its DSQ forward) over the module's own class, which it keeps for isinstance
    checks: a Linear subclass, or ``transformers``' Conv1D."""
    cls = type(module)
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"DSQ{cls.__name__}", (mixin, cls), {})
    return _SUBCLASSES[cls]


_ATTENTION_TOKENS: dict[int, list] = {}


def _enter_attention(cfg):
    def hook(module, args):
        _ATTENTION_TOKENS.setdefault(id(module), []).append(_ACTIVE_ATTENTION.set(cfg))

    return hook


def _exit_attention(module, args, output):
    _ACTIVE_ATTENTION.reset(_ATTENTION_TOKENS[id(module)].pop())


# ----------------------------------------------------------------------------- stash_scope=all
class _PackedSave:
    """What a saved-tensor hook keeps instead of a floating activation: the q1-packed tensor."""

    __slots__ = ("packed", "requires_grad")

    def __init__(self, packed, requires_grad):
        self.packed = packed
        self.requires_grad = requires_grad


def stash_all_hooks(cfg: QuantConfig):
    """Saved-tensor hooks that pack every floating activation autograd saves in q1 (the stash
    format), leaving parameters, non-floating tensors and tiny tensors as they are."""

    def pack(t: torch.Tensor):
        if (
            not t.is_floating_point()
            or isinstance(t, nn.Parameter)
            or t.numel() < 64
            or (t.is_leaf and t.requires_grad)
        ):
            return t
        fmt = cfg.format("q1")
        if fmt.spec == "fp32":
            return t
        rounding, generator = cfg.rounding_of("q1", t.device)
        return _PackedSave(fmt.pack(t.detach(), -1, rounding, generator), t.requires_grad)

    def unpack(saved):
        if isinstance(saved, _PackedSave):
            return saved.packed.unpack()
        return saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


_STASH_CONTEXTS: dict[int, list[contextlib.AbstractContextManager]] = {}


def _enter_stash_all(cfg):
    def hook(module, args):
        context = stash_all_hooks(cfg)
        context.__enter__()
        _STASH_CONTEXTS.setdefault(id(module), []).append(context)

    return hook


def _exit_stash_all(module, args, output):
    _STASH_CONTEXTS[id(module)].pop().__exit__(None, None, None)
