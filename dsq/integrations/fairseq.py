"""fairseq's ``MultiheadAttention`` under DSQ (registered for models built from fairseq).

Its fast path hands the q/k/v/out projection weights to ``F.multi_head_attention_forward``, where
swapped Linear modules would never run. Patching forces its slow path
(``_set_skip_embed_dim_check``), where the projections are module calls (patched as Linear layers)
and the two products run as `dsq_attention`, in tiles of query rows (``quant.attention=tiled``,
the default), or in torch's fused kernel under the rule ``sdpa_bf16`` (`DSQMultiheadAttention`
says when). Otherwise they are fairseq's
``torch.bmm(q, k^T)`` and ``torch.bmm(P, v)``, routed to ``dsq_matmul`` while a patched attention
module runs (a proxy for ``torch`` in fairseq's module namespace, active only inside patched
modules): the explicit path.
"""

from __future__ import annotations

import contextvars
import types

import torch
from fairseq.modules import fairseq_dropout, multihead_attention, transformer_layer
from fairseq.modules.gelu import gelu as fairseq_gelu
from torch import nn

from dsq.engine.accounting import note
from dsq.engine.attention_kernels import attention_function
from dsq.engine.config import QuantConfig
from dsq.engine.derivative_codes import DerivativeCode, coded_activation, derivative_code
from dsq.engine.functions import dsq_matmul
from dsq.engine.masks import dsq_dropout, dsq_relu
from dsq.engine.patch import PatchReport, dsq_subclass, on_unpatch, reclass
from dsq.engine.spec import SAVED_DEFAULT

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


def _enter_attention(module, args):
    _ATTENTION_TOKENS.setdefault(id(module), []).append(_ACTIVE_ATTENTION.set(module.dsq_cfg))


def _exit_attention(module, args, output):
    _ACTIVE_ATTENTION.reset(_ATTENTION_TOKENS[id(module)].pop())


class DSQMultiheadAttention(nn.Module):
    """Mixed into fairseq's ``MultiheadAttention`` by re-classing: in training's case (no
    incremental state, no attention weights asked for, no extra key/value bias or zero
    attention), its two products run as `dsq_attention`, in tiles, when ``quant.attention`` is
    ``tiled``, or as `sdpa_attention`, in torch's fused kernel, when it is ``sdpa_bf16``:
    fairseq's own projections (patched Linear layers), ``q`` scaled as fairseq scales it, its
    additive ``attn_mask`` and its ``key_padding_mask``, dropout at its module's probability.
    Every other case is fairseq's own forward with its ``bmm`` products routed to ``dsq_matmul``
    (the explicit path): among them the last decoder layer's cross-attention, whose
    head-averaged weights fairseq's decoder returns (its alignment layer), and decoding with an
    incremental state."""

    dsq_cfg: QuantConfig

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights=True, static_kv=False, attn_mask=None, before_softmax=False,
                need_head_weights=False):  # fmt: skip
        attend = attention_function(self.dsq_cfg)
        explicit = (
            attend is None or incremental_state is not None or need_weights
            or need_head_weights or before_softmax or self.bias_k is not None
            or self.add_zero_attn or self.onnx_trace
            or (attn_mask is not None and not attn_mask.is_floating_point())
            or (key is not None and key.shape[1] != query.shape[1])
        )  # fmt: skip
        if explicit:
            return super().forward(query, key, value, key_padding_mask, incremental_state,
                                   need_weights, static_kv, attn_mask, before_softmax,
                                   need_head_weights)  # fmt: skip
        tgt_len, bsz, _ = query.shape
        source = query if self.self_attention else key
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(source)
        v = self.v_proj(source if self.self_attention or self.encoder_decoder_attention else value)

        def heads(x):  # [T, B, C] -> [B, H, T, C / H]
            return x.view(x.shape[0], bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        attn = attend(
            heads(q), heads(k), heads(v), self.dsq_cfg, scaling=1.0, mask=attn_mask,
            key_padding=key_padding_mask, dropout=self.dropout_module.p,
            training=self.training or self.dropout_module.apply_during_inference,
        )  # fmt: skip
        attn = attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn), None


class MultiheadAttentionPatcher:
    """fairseq's MultiheadAttention: its slow path, and its two ``bmm`` products routed to
    ``dsq_matmul`` (its projections are Linear layers, patched by the engine's rule)."""

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, multihead_attention.MultiheadAttention)

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        skipped = module.skip_embed_dim_check
        module._set_skip_embed_dim_check()  # the slow path: projections run as modules
        on_unpatch(module, "setattr", "skip_embed_dim_check", skipped)
        reclass(module, dsq_subclass(module, DSQMultiheadAttention))
        module.dsq_cfg = cfg
        on_unpatch(module, "remove", module.register_forward_pre_hook(_enter_attention))
        exit_hook = module.register_forward_hook(_exit_attention, always_call=True)
        on_unpatch(module, "remove", exit_hook)
        report.attention.append(name)

    def finish(self, model, cfg, report, excluded) -> None:
        if report.attention and not isinstance(multihead_attention.torch, _TorchWithDSQBmm):
            multihead_attention.torch = _TorchWithDSQBmm()

    def observe(self, module: nn.Module, cfg: QuantConfig):
        """For a model the engine did not patch (the autocast engine): note the module's GEMMs
        as records in ``cfg``'s formats. Its two attention products, ``Q K^T`` and ``P V`` per
        head, always; its four projections only when its fast path ran them inside
        ``F.multi_head_attention_forward`` (on the slow path they are Linear calls, which
        `observe_linears` notes). Query ``[T, B, C]``, key ``[S, B, C]``, heads of ``C / H``."""
        projections = [module.q_proj, module.k_proj, module.v_proj, module.out_proj]
        calls = [0]

        def count(projection, args, output):
            calls[0] += 1

        def before(module, args):
            calls[0] = 0

        def after(module, args, kwargs, output):
            query = args[0] if args else kwargs["query"]
            key = args[1] if len(args) > 1 else kwargs.get("key")
            key = query if key is None else key
            tgt_len, batch, width = query.shape
            src_len, heads, head_dim = key.shape[0], module.num_heads, module.head_dim
            bytes_per_value = cfg.format("q1").bits_per_value / 8
            if not calls[0]:  # the fast path: projections inside one fused call
                for tokens, projection in zip((tgt_len, src_len, src_len, tgt_len), projections):
                    rows = tokens * batch
                    stash = int(rows * width * bytes_per_value)
                    note("linear", 1, rows, width, projection.out_features, cfg, stash)
            stash = int(batch * heads * (tgt_len + src_len) * head_dim * bytes_per_value)
            note("matmul", batch * heads, tgt_len, head_dim, src_len, cfg, stash)
            note("matmul", batch * heads, tgt_len, src_len, head_dim, cfg, stash)

        return [
            *(p.register_forward_hook(count) for p in projections),
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, with_kwargs=True),
        ]


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
            original = module.activation_fn
            module.activation_fn = dsq_relu
            on_unpatch(module, "setattr", "activation_fn", original)
        else:
            reclass(module, DSQFairseqDropout)
        report.masks.append(name)

    def finish(self, model, cfg, report, excluded) -> None:
        """Nothing model-wide: each module is patched as the walk meets it."""


class GeluCodePatcher:
    """fairseq's transformer layers' ``gelu`` (a function the layer holds, ``activation_fn``,
    which the engine's pass over activation modules does not see): under
    ``quant.saved.activation=derivative<k>`` it holds derivative codes
    (`dsq.engine.derivative_codes`), with the same outputs."""

    def claims(self, module: nn.Module) -> bool:
        return False  # no module of its own: the layers are found after the walk (`finish`)

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        raise AssertionError("GeluCodePatcher claims no module")

    def finish(self, model, cfg, report, excluded) -> None:
        """Each layer's ``gelu`` holds ``k``-bit codes; the report counts them and names the
        layers whose activation is neither ReLU (its bit mask, `MaskPatcher`) nor ``gelu``."""
        bits = cfg.derivative_code_bits
        if bits is None:
            return
        coded, other = 0, []
        for name, module in model.named_modules():
            if not isinstance(module, _LAYERS) or module.activation_fn is dsq_relu:
                continue
            if module.activation_fn is not fairseq_gelu:
                other.append(name)
            elif excluded(name):
                other.append(f"{name} (excluded)")
            else:
                on_unpatch(module, "setattr", "activation_fn", module.activation_fn)
                module.activation_fn = CodedFairseqGelu(derivative_code("gelu", bits))
                coded += 1
        held = SAVED_DEFAULT["elementwise"]
        report.notes.append(
            f"fairseq layers whose gelu holds {bits}-bit derivative codes: {coded}; layers "
            f"whose activation_fn is held as elementwise ({held}): {', '.join(other) or 'none'}"
        )


class CodedFairseqGelu:
    """fairseq's ``gelu`` (``F.gelu`` of the input in float32, cast back), its backward pass
    holding derivative codes (`dsq.engine.derivative_codes`): the same outputs."""

    def __init__(self, code: DerivativeCode):
        self.code = code

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return coded_activation(x.float(), self.code).type_as(x)


register_patcher("fairseq", MultiheadAttentionPatcher())
register_patcher("fairseq", MaskPatcher())
register_patcher("fairseq", GeluCodePatcher())
