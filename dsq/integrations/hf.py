"""DSQ in Hugging Face ``transformers`` models (docs/hf.md), registered for models built from
``transformers``: GPT-2's ``Conv1D`` projections and the two attention products, under the eager
and the SDPA attention implementations; and ``DSQCallback``, the precision schedule inside a
``transformers.Trainer`` (below). Needs the ``hf`` extra (``pip install '.[hf]'`` in a checkout).

``transformers`` models call their attention through ``ALL_ATTENTION_FUNCTIONS`` under the name in
``config._attn_implementation``, and build their masks through ``ALL_MASK_ATTENTION_FUNCTIONS``
under the same name. Patching registers two implementations, ``dsq_eager`` and ``dsq_sdpa``, and
switches the model to the one matching what it used: each receives the masks its original would
(eager's additive float mask, SDPA's boolean mask or none with a causal flag) and computes DSQ's
attention (`dsq.engine.attention`, docs/dsq.md, "Attention in tiles"):

    scores = dsq_matmul(q, k^T) * scaling  (+ mask, or a causal mask)
    out    = dsq_matmul(dropout(softmax(scores)), v)

in tiles of query rows (``quant.attention=tiled``, the default; no probabilities are returned,
as under SDPA) or explicitly (``explicit``), with grouped-query attention read from the shared
key/value heads; or, under the rule ``quant.attention=sdpa_bf16``, in torch's fused kernel in
bf16 on q0's Q, K and V (`dsq.engine.sdpa_attention`, docs/dsq.md, "Attention in torch's fused
kernel"). An SDPA model thus gets SDPA's masking, causal flag, scaling and dropout
probability, not its fused kernel nor its dropout's random stream; the report says so. Other
implementations (flash, flex) cannot be replicated and are reported as left unquantized.

``Conv1D`` (``y = x W + b`` with ``W [in, out]``) is the linear layer ``dsq_linear(x, W^T, b)``:
the same GEMMs and block axes as ``DSQLinearFunction``, on the transposed weight.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.metadata
import json
import logging
import platform
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from transformers.activations import (
    ACT2CLS,
    GELUActivation,
    NewGELUActivation,
    SiLUActivation,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.pytorch_utils import Conv1D

from dsq import cost
from dsq.atomic_files import atomic_path, write_atomic
from dsq.engine import unread_outputs
from dsq.engine.attention import explicit_attention
from dsq.engine.attention_kernels import attention_function
from dsq.engine.checkpointing import checkpoint_as_first_run
from dsq.engine.config import POINTS, QuantConfig
from dsq.engine.functions import dsq_linear
from dsq.engine.history import PrecisionHistory
from dsq.engine.patch import (
    PatchReport,
    dsq_subclass,
    make_dsq_linear,
    on_unpatch,
    reclass,
    stash_all_hook,
)
from dsq.engine.policies import POLICIES
from dsq.engine.sliced_mlp import sliced_swiglu
from dsq.engine.swiglu import silu_product
from dsq.presets import COST_BASELINE, preset_differences
from dsq.records import check_metric
from dsq.warn_once import warn_once

from . import register_patcher

#: The attention implementations patching replaces, and what replaces them.
REPLACED = {"eager": "dsq_eager", "sdpa": "dsq_sdpa"}


def is_transformers_model(model: nn.Module) -> bool:
    return isinstance(model, transformers.PreTrainedModel)


class DSQConv1D(nn.Module):
    """Mixed into ``transformers``' ``Conv1D`` by re-classing: ``y = dsq_linear(x, W^T, b)``."""

    dsq_cfg: QuantConfig

    def forward(self, x):
        y = dsq_linear(x, self.weight.t(), self.bias, self.dsq_cfg)
        return y.reshape(*x.shape[:-1], self.nf)


def _attention(sdpa: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):  # fmt: skip
        cfg = getattr(module, "dsq_cfg", None)
        if cfg is None and not getattr(module, "dsq_excluded", False):
            # found by neither rule of `attention_modules`: refuse rather than run it unquantized
            raise RuntimeError(
                f"{type(module).__name__} calls the attention interface but quantize_model did "
                "not find it (docs/hf.md); exclude it by name or report the model"
            )
        if cfg is None and sdpa:  # an excluded attention module: SDPA itself
            sdpa_forward = transformers.integrations.sdpa_attention.sdpa_attention_forward
            return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout,
                                scaling=scaling, is_causal=is_causal, **kwargs)  # fmt: skip
        # an excluded module under eager: the same computation in plain torch.matmul
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_len, kv_len = query.shape[-2], key.shape[-2]
        mask = None if attention_mask is None else attention_mask[..., :kv_len]
        # SDPA's own rule: causal when the module is, with no mask and more than one query
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = sdpa and mask is None and causal and q_len > 1
        keywords = dict(scaling=scaling, mask=mask, causal=causal, dropout=dropout,
                        training=module.training)  # fmt: skip
        attend = None if cfg is None else attention_function(cfg)
        if attend is not None:
            out = attend(query, key, value, cfg, **keywords)
            return out.transpose(1, 2).contiguous(), None  # no probabilities are kept
        out, probs = explicit_attention(query, key, value, cfg, **keywords)
        return out.transpose(1, 2).contiguous(), (None if sdpa else probs)

    return attention


_REGISTERED = False


def register_attention() -> None:
    """Register ``dsq_eager`` and ``dsq_sdpa`` (attention and mask functions) once."""
    global _REGISTERED
    if _REGISTERED:
        return
    masks = importlib.import_module("transformers.masking_utils")
    for original, replacement in REPLACED.items():
        transformers.AttentionInterface.register(replacement, _attention(sdpa=original == "sdpa"))
        masks.AttentionMaskInterface.register(
            replacement, masks.AttentionMaskInterface._global_mapping[original]
        )
    _REGISTERED = True


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that call the attention interface: those holding the model's
    config and a scaling or head count, in the transformers models' convention."""
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if name and config is not None and not list(module.parameters(False)):
            if any(hasattr(module, a) for a in ("scaling", "num_key_value_groups", "head_dim")):
                found.append((name, module))
    return found


# how the report says each quant.attention computes the products
KERNEL_NOTES = {
    "tiled": "in tiles of query rows",
    "explicit": "explicitly",
    "sdpa_bf16": "in torch's fused kernel in bf16 on q0's Q, K and V",
}


def route_attention(model: nn.Module, cfg: QuantConfig, exclude) -> tuple[list, list, str]:
    """Switch ``model`` to the DSQ attention implementation matching its own; returns the
    routed and the excluded attention modules' names and a line for the report. Raises
    ValueError naming an implementation that cannot be routed."""
    implementation = model.config._attn_implementation
    if implementation not in REPLACED:
        if implementation in REPLACED.values():
            raise ValueError(f"this model is already patched ({implementation})")
        raise ValueError(
            f"attention implementation {implementation!r} cannot run through dsq_matmul; load the "
            "model with attn_implementation='eager' or 'sdpa'"
        )
    register_attention()
    _own_config(model)
    routed, excluded = [], []
    for name, module in attention_modules(model):
        if exclude(name):
            module.dsq_excluded = True
            excluded.append(name)
        else:
            module.dsq_cfg = cfg
            routed.append(name)
    model.set_attn_implementation(REPLACED[implementation])
    on_unpatch(model, "call", "set_attn_implementation", implementation)
    kernel = KERNEL_NOTES[cfg.attention]
    how = "as written" if implementation == "eager" else (
        "with SDPA's masking, causal flag, scaling and dropout probability"
        + ("" if cfg.attention == "sdpa_bf16" else " (not its fused kernel)")
    )  # fmt: skip
    note = f"attention: {implementation} -> {REPLACED[implementation]}, computed {kernel}, {how}"
    return routed, excluded, note


def _own_config(model: nn.Module) -> None:
    """Give ``model`` its own copy of its config, and each of its modules holding that config
    (or one of its sub-configs) the copy's: switching the attention implementation writes to
    the config, and the caller's, from which they may build another model, stays as it was."""
    copies: dict[int, object] = {}
    own = copy.deepcopy(model.config, copies)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]
    model.config = own


class TransformersPatcher:
    """``Conv1D`` layers (as linear layers on the transposed weight) and, after the walk, the
    model's attention implementation switched to the DSQ one matching it."""

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, Conv1D)

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        make_dsq_linear(module, cfg, mixin=DSQConv1D)
        report.linears.append(name)

    def finish(self, model, cfg, report, excluded) -> None:
        stochastic = any(mode == "stochastic" for mode in cfg.rounding.values())
        for prefix, inner in outermost_transformers_models(model):
            if cfg.stash_scope == "all" or stochastic:
                _checkpoint_as_first_run(inner, cfg, report, prefix)
            where = f" of {prefix}" if prefix else ""
            try:
                routed, excluded_names, note = route_attention(
                    inner, cfg, lambda name, prefix=prefix: excluded(_joined(prefix, name))
                )
            except ValueError as err:
                report.unquantized.append(f"attention products{where} ({err})")
            else:
                report.attention += [_joined(prefix, name) for name in routed]
                report.excluded += [_joined(prefix, name) for name in excluded_names]
                report.notes.append(note + where)
            # the MLPs whether or not the attention could be routed
            inner_excluded = functools.partial(_excluded_inside, excluded, prefix)
            if cfg.mlp == "sliced":
                _slice_swiglu(inner, cfg, report, prefix, inner_excluded)
            elif cfg.stash_scope == "gemm":
                _hold_two_in_swiglu(inner, report, where, inner_excluded)

    def activation_function(self, module: nn.Module) -> str | None:
        """``transformers``' SiLU and GELU modules: the function whose derivative code they may
        hold (`dsq.engine.patch.Patcher.activation_function`). GELU's tanh form written out
        (GPT-2's NewGELUActivation) is that function up to float32 rounding."""
        if type(module) is SiLUActivation:
            return "silu"
        if type(module) is NewGELUActivation:
            return "gelu_tanh"
        act = getattr(module, "act", None)
        if type(module) is GELUActivation and act is nn.functional.gelu:
            return "gelu"
        if (type(module) is _GELU_TANH and isinstance(act, functools.partial)
                and act.func is nn.functional.gelu and act.args == ()
                and act.keywords == {"approximate": "tanh"}):  # fmt: skip
            return "gelu_tanh"
        return None


# transformers' "gelu_pytorch_tanh" (named PytorchGELUTanh, then GELUTanh); an entry of ACT2CLS
# is a class or (class, keyword arguments)
_GELU_TANH = ACT2CLS["gelu_pytorch_tanh"]
_GELU_TANH = _GELU_TANH[0] if isinstance(_GELU_TANH, tuple) else _GELU_TANH


class DSQSwiGLUMLP(nn.Module):
    """The mixin of a Llama-style MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a
    SiLU: the same computation, its product holding two tensors for the backward pass where
    autograd holds three (`silu_product`), bit for bit the same values and gradients."""

    def forward(self, x):
        if _hooked(self.act_fn):
            # the activation's hooks must see its call: the product as transformers wrote it,
            # holding three tensors
            warn_once(__name__, _ACT_FN_HOOKED)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(silu_product(self.gate_proj(x), self.up_proj(x)))


class DSQSlicedSwiGLUMLP(nn.Module):
    """The mixin of a Llama-style MLP under ``quant.mlp=sliced``: the same computation a slice of
    tokens at a time (`sliced_swiglu`), its backward pass holding its input alone."""

    def forward(self, x):
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        if _hooked(self.act_fn) or any(_hooked(layer) for layer in layers):
            # the hooks must see their modules' calls: the MLP as transformers wrote it
            warn_once(__name__, _SLICED_HOOKED)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        weights = (layer.weight for layer in layers)
        biases = (layer.bias for layer in layers)
        # a hook of the MLP's own sees its output, in a checkpointed layer's run again too
        with unread_outputs.outputs_unread(False) if _hooked(self) else contextlib.nullcontext():
            return sliced_swiglu(x, *weights, *biases, self.dsq_cfg)


_SLICED_HOOKED = (
    "dsq: a sliced MLP (quant.mlp=sliced) or one of its layers has hooks, so that MLP runs whole, "
    "as transformers wrote it"
)

_ACT_FN_HOOKED = (
    "dsq: a SwiGLU MLP's act_fn has hooks, so that MLP runs as transformers wrote it and its "
    "product holds 3 tensors, not 2"
)


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks, its own or every module's (nn.Module globals),
    other than ``stash_scope=all``'s, which every module has (`stash_all_hook`)."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
           module._backward_pre_hooks)  # fmt: skip
    every = (nn.modules.module._global_forward_hooks,
             nn.modules.module._global_forward_pre_hooks,
             nn.modules.module._global_backward_hooks,
             nn.modules.module._global_backward_pre_hooks)  # fmt: skip
    return any(not stash_all_hook(hook) for hooks in (*own, *every) for hook in hooks.values())


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module``'s forward is Llama's MLP (the same code: Mistral's, Qwen2's and others
    copy it) with a plain SiLU: the computation `DSQSwiGLUMLP` repeats."""
    forward, act = getattr(type(module), "forward", None), getattr(module, "act_fn", None)
    if forward is None or not hasattr(forward, "__code__") or not isinstance(act, nn.Module):
        return False
    code, llama = forward.__code__, LlamaMLP.forward.__code__
    act_code = getattr(type(act).forward, "__code__", None)
    return (
        (code.co_code, code.co_names, code.co_consts)
        == (llama.co_code, llama.co_names, llama.co_consts)
        and act_code in (SiLUActivation.forward.__code__, nn.SiLU.forward.__code__)
        and all(isinstance(getattr(module, n, None), nn.Linear)
                for n in ("gate_proj", "up_proj", "down_proj"))
    )  # fmt: skip


def _excluded_inside(excluded, prefix: str, name: str) -> bool:
    return excluded(_joined(prefix, name))


def _hold_two_in_swiglu(model: nn.Module, report: PatchReport, where: str, excluded) -> None:
    """Every Llama-style MLP of ``model`` not excluded becomes `DSQSwiGLUMLP` (under
    ``stash_scope=gemm``; the rules of ``all`` decide there what each saved tensor holds)."""
    count = 0
    for name, module in model.named_modules():
        if _is_swiglu_mlp(module) and not excluded(name):
            reclass(module, dsq_subclass(module, DSQSwiGLUMLP))
            count += 1
    if count:
        report.notes.append(f"SwiGLU products holding 2 tensors, not 3, in {count} MLPs{where}")


def _slice_swiglu(model: nn.Module, cfg: QuantConfig, report: PatchReport, prefix: str,
                  excluded) -> None:  # fmt: skip
    """Every Llama-style MLP of ``model`` whose three layers are patched becomes
    `DSQSlicedSwiGLUMLP` (``quant.mlp=sliced``), named in ``report.sliced_mlps``; one that is not
    is named in a note, with why."""
    left = []
    for name, module in model.named_modules():
        if not _is_swiglu_mlp(module):
            continue
        layers = [n for n in ("gate_proj", "up_proj", "down_proj")
                  if getattr(module, n).__dict__.get("dsq_cfg") is not cfg]  # fmt: skip
        if excluded(name) or layers:
            why = "excluded" if excluded(name) else f"{', '.join(layers)} not patched"
            left.append(f"{_joined(prefix, name)} ({why})")
            continue
        reclass(module, dsq_subclass(module, DSQSlicedSwiGLUMLP))
        module.dsq_cfg = cfg
        module.act_fn.dsq_inside_sliced_mlp = True
        report.sliced_mlps.append(_joined(prefix, name))
    if left:
        report.notes.append(f"MLPs left whole under quant.mlp=sliced: {'; '.join(left)}")


class _CheckpointAsFirstRun:
    """Forward pre-hook and hook of a ``transformers`` layer that checkpoints
    (``gradient_checkpointing_enable``) in a model with stochastic rounding or
    ``stash_scope=all``: for the length of its call its checkpointing function is the model's own
    with the layer's run again repeating its first run (`checkpoint_as_first_run`: its noise,
    the model's rules, and a ``quant.saved.checkpoint`` format, which replaces the model's own
    by `held_input_checkpoint`); after the call the model's own is back in place, so that
    unpatching, or a later ``gradient_checkpointing_enable``, finds it."""

    def __init__(self, cfg: QuantConfig):
        self.cfg = cfg

    def __call__(self, module, args, *output):
        _put_back_own_checkpointing(module)
        unused = module.__dict__.pop("dsq_checkpointing_unused", None)
        if output:  # after the call (or its exception)
            if unused is not None and unused.pending:
                # transformers before it checkpointed `forward` read the function in the
                # layer's __call__, before this hook swapped it: it did not apply
                raise ValueError(
                    f"{type(module).__name__} checkpoints its whole call (an older "
                    "transformers), which dsq cannot wrap to repeat a layer's first run under "
                    "stochastic rounding or stash_scope=all: upgrade transformers, or call "
                    "gradient_checkpointing_disable()"
                )
            return None
        if module.gradient_checkpointing:
            own = module._gradient_checkpointing_func
            if module.training and self.cfg.saved_format("checkpoint") is not None:
                _refuse_what_holding_drops(own)
            swapped = _AsFirstRun(own, self.cfg)
            if module.training and torch.is_grad_enabled():
                module.dsq_checkpointing_unused = swapped  # until transformers calls it
            module.dsq_own_checkpointing = own
            module._gradient_checkpointing_func = swapped
        return None


class _AsFirstRun:
    """A layer's checkpointing function for one call: `checkpoint_as_first_run` with the model's
    own; ``pending`` until transformers calls it."""

    def __init__(self, own, cfg: QuantConfig):
        self.own, self.cfg, self.pending = own, cfg, True

    def __call__(self, function, *args, **kwargs):
        self.pending = False
        return checkpoint_as_first_run(self.own, self.cfg, function, *args, **kwargs)


# torch.utils.checkpoint's options the held checkpoint honours as it stands: it replays the RNG
# state, checks nothing and logs nothing; use_reentrant is free (it is reentrant-style either way,
# and refuses the layers the reentrant form cannot train)
_HELD_CHECKPOINT_AGREES = {
    "preserve_rng_state": True,
    "determinism_check": "default",
    "debug": False,
}


def _refuse_what_holding_drops(own) -> None:
    """Refuse a layer whose checkpointing function does more than `held_input_checkpoint` would:
    holding replaces the function for the call, and whatever it did besides checkpointing
    (``offload=True``'s copies to the host, a ``context_fn``, no RNG replay) would silently stop."""
    func = own.func if isinstance(own, functools.partial) else own
    if func is not torch_checkpoint:
        raise ValueError(
            "quant.saved.checkpoint replaces a layer's checkpointing function with dsq's, and this "
            f"model's is {getattr(func, '__qualname__', func)!r}, not torch.utils.checkpoint's "
            "(gradient_checkpointing_enable(offload=True), or a function of your own), whose "
            "work would be dropped: enable it without offload, or set quant.saved.checkpoint=keep"
        )
    keywords = own.keywords if isinstance(own, functools.partial) else {}
    dropped = sorted(
        f"{k}={v!r}" for k, v in keywords.items()
        if k != "use_reentrant" and _HELD_CHECKPOINT_AGREES.get(k, object()) != v
    )  # fmt: skip
    if dropped:
        raise ValueError(
            f"quant.saved.checkpoint replaces a layer's checkpointing function with dsq's, which "
            f"does not apply {', '.join(dropped)} from gradient_checkpointing_kwargs: drop them, "
            "or set quant.saved.checkpoint=keep"
        )


def _put_back_own_checkpointing(module: nn.Module):
    """The layer's own checkpointing function back in place, if dsq's holds it (a call cut short
    before its hook ran, or unpatching); returns it, or None."""
    own = module.__dict__.pop("dsq_own_checkpointing", None)
    if own is not None:
        module._gradient_checkpointing_func = own
    return own


def _checkpoint_as_first_run(model, cfg: QuantConfig, report: PatchReport, prefix: str):
    """Every layer of ``model`` that ``transformers`` checkpoints runs under
    `_CheckpointAsFirstRun` when checkpointing is on; a ``quant.saved.checkpoint`` rule no layer
    would apply is refused."""
    what = cfg.spec.saved.get("checkpoint", "keep") if cfg.stash_scope == "all" else "keep"
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers and what != "keep":
        raise ValueError(
            f"quant.saved.checkpoint={what}: {type(model).__name__} has no layer that "
            "transformers checkpoints (GradientCheckpointingLayer); set quant.saved.checkpoint="
            "keep"
        )
    hook = _CheckpointAsFirstRun(cfg)
    for layer in layers:
        on_unpatch(layer, "apply", _put_back_own_checkpointing)  # undone last
        on_unpatch(layer, "remove", layer.register_forward_pre_hook(hook))
        on_unpatch(layer, "remove", layer.register_forward_hook(hook, always_call=True))
    if what != "keep":
        where = f" of {prefix}" if prefix else ""
        report.notes.append(
            f"checkpointed layer inputs{where} held in {what} under gradient checkpointing "
            f"({len(layers)} layers)"
        )


def outermost_transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``transformers`` models in ``model`` that no other one holds, with their names: the
    model itself, or those a wrapper holds (a PEFT model, a user's module around one), whose
    attention is routed as the model's own would be."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if is_transformers_model(module) and not any(
            not outer or name.startswith(outer + ".") for outer, _ in found
        ):
            found.append((name, module))
    return found


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


register_patcher("transformers", TransformersPatcher())


# -- the Trainer callback --------------------------------------------------------------------------
log = logging.getLogger("dsq.hf")
CHECKPOINT_FILE = "dsq_schedule.pt"
RESULT_FILE = "result.json"


def quiet_logs() -> None:
    """For a training script: the libraries' warnings and chatter off, the schedule's level
    changes (logger ``dsq``) on."""
    import warnings

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("dsq").setLevel(logging.INFO)


class DSQCallback(transformers.TrainerCallback):
    """The precision schedule in a ``transformers.Trainer`` (docs/hf.md, "Training with the
    Trainer")::

        model = quantize_model(model, cfg, exclude=["classifier"])
        trainer = Trainer(model=model, args=args, ...)
        DSQCallback.attach(trainer, cfg)
        trainer.train()                      # or trainer.train(resume_from_checkpoint=True)

    * After each evaluation ``trainer.train()`` runs, the schedule steps on its ``eval_loss`` (as
      ``dsq train`` steps it on the validation loss), at ``state.global_step``; an evaluation
      outside ``train()`` (a closing ``trainer.evaluate()``) leaves it as it is. After each step
      the policies of the step count (``cyclic``, ``shape``; docs/dsq.md, "Precision policies")
      move.
    * Every log line the Trainer sends to its loggers carries the bits per value in force at each
      point (``dsq/q1_bits``) and the number of level changes so far (``dsq/level_changes``);
      each change is also logged (logger ``dsq.hf``).
    * ``callback.history`` (`PrecisionHistory`, as ``dsq train`` keeps it) holds the steps
      trained at each level, the first step's GEMMs and the changes (``callback.changes``): what
      prices the run. ``callback.run_result(...)`` is the run's result.json, priced as
      ``dsq train`` prices its runs, and ``callback.write_result(out, ...)`` writes it there for
      ``dsq table``.
    * Each Trainer checkpoint gets ``dsq_schedule.pt`` (the schedules, the rounding noise and the
      history), written atomically and loaded with ``weights_only=True``; resuming from a
      checkpoint restores it, so the run continues at the same level.
    """

    def __init__(self, cfg: QuantConfig) -> None:
        if not isinstance(cfg, QuantConfig):
            raise TypeError(f"cfg must be the model's QuantConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.history = PrecisionHistory()
        self._recording = None
        self._training = False  # between on_train_begin and on_train_end: evaluations step

    @classmethod
    def attach(cls, trainer: transformers.Trainer, cfg: QuantConfig) -> DSQCallback:
        """Add a DSQCallback to ``trainer`` first in its list, so that the bits it adds to a log
        line are there before the logging integrations (wandb, TensorBoard) send it."""
        callback = cls(cfg)
        trainer.callback_handler.callbacks.insert(0, callback)
        trainer.train = _TrainEnds(trainer.train, callback)
        return callback

    @property
    def changes(self) -> list[dict]:
        return self.history.changes

    @property
    def segments(self) -> list[list]:
        return self.history.segments

    @property
    def gemm_shapes(self) -> list[dict]:
        return self.history.gemm_shapes or []

    # -- the schedule ---------------------------------------------------------------------------
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self._training:  # trainer.evaluate() after or outside train(): reports only
            log.info("dsq: an evaluation outside trainer.train() leaves the schedule as it is")
            return control
        loss = (metrics or {}).get("eval_loss")
        if loss is None:
            raise ValueError(
                "DSQCallback steps the schedule on eval_loss, and this evaluation has none; "
                "give the Trainer an eval_dataset with labels"
            )
        self._book(self.cfg.step(float(loss), state.global_step), state.global_step)
        return control

    def _book(self, changes, step: int) -> None:
        for record in self.history.book(changes, step):
            log.info("dsq: %s %s -> %s after step %d (%s)", record["point"], record["from"],
                     record["to"], step, record["policy"])  # fmt: skip

    def bits_in_force(self) -> dict[str, float]:
        return {f"dsq/{p}_bits": self.cfg.format(p).bits_per_value for p in POINTS}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            added = {**self.bits_in_force(), "dsq/level_changes": len(self.changes)}
            logs.update(added)  # the dict every later callback (the loggers) receives
            if state.log_history:  # the Trainer's copy of this line, appended just before
                state.log_history[-1].update(added)
        return control

    # -- what the run trained with ------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if self.history.gemm_shapes is None and self._recording is None:
            self._recording = self.history.first_update()
            self._recording.__enter__()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
        self.history.count_update(self.cfg.current())
        self._book(self.cfg.after_update(state.global_step), state.global_step)
        return control

    # -- the run's result.json ------------------------------------------------------------------
    def run_result(self, *, task: str, preset: str, metric: str, value: float | None,
                   valid_loss: float | None, model: str, seed: int, wall_seconds: float,
                   evaluation: Mapping | None = None) -> dict:  # fmt: skip
        """The completed run's result.json (docs/spec.md §5), as ``dsq train`` writes its own:
        ``quant`` holds ``preset`` (the ``dsq.presets`` name the QuantConfig was made from),
        the config's spec (``cfg.to_dict()``) and whether it differs from that preset
        (``modified``); ``cost`` prices the recorded GEMMs over the steps trained at each level
        against fixed32 (``dsq.cost.run_cost``); ``evaluation`` holds the task's metrics, and
        the precision changes join them (``level_changes``, in schedule.jsonl's shape)."""
        check_metric(metric)
        history, points = self.history, self.cfg.to_dict()
        modified = preset_differences({"preset": preset, **points}) != []
        return {
            "status": "completed",
            "task": task,
            "quant": {"preset": preset, **points, "modified": modified},
            "metric": metric,
            "value": value,
            "valid_loss": valid_loss,
            "updates": history.updates,
            "wall_seconds": round(wall_seconds, 3),
            "cost": cost.run_cost(
                history.gemm_shapes, history.segments, baseline_name=COST_BASELINE
            ),  # fmt: skip
            "stash_bits_mean": cost.stash_bits_mean(history.segments),
            "versions": versions(),
            "model": model,
            "seed": seed,
            "bits_final": self.cfg.current(),
            "precision_segments": [{"points": p, "updates": n} for p, n in history.segments],
            **dict(evaluation or {}),
            "level_changes": list(history.changes),
        }

    def write_result(self, run_dir: str | Path, **fields) -> Path:
        """Write ``run_result(**fields)`` to ``run_dir``/result.json atomically; its path."""
        path = Path(run_dir) / RESULT_FILE
        write_atomic(path, json.dumps(self.run_result(**fields), indent=2, sort_keys=True) + "\n")
        return path

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "schedule": self.cfg.state_dict(),
            "noise": self.cfg.noise_state(),
            "history": dict(self.history.state),
        }

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():  # the Trainer wrote its checkpoint there just before
            with atomic_path(folder / CHECKPOINT_FILE) as tmp:
                torch.save(self.state_dict(), tmp)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        needs_losses = [(p, s.policy.name) for p, s in self.cfg.schedules.items()
                        if s.policy.needs_train_loss]  # fmt: skip
        if needs_losses:
            point, name = needs_losses[0]
            usable = sorted(n for n, c in POLICIES.items() if not c.needs_train_loss)
            raise ValueError(
                f"{point}: policy {name} needs every step's training loss, which a Trainer "
                f"callback does not see; use {', '.join(usable)} here"
            )
        if state.global_step > 0:
            self._restore(args, state)
        # the policies of the step count need the planned steps (a resumed run: its level)
        self.cfg.start(state.max_steps, state.global_step)
        self._training = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.end_training()
        return control

    def end_training(self) -> None:
        """Evaluations from now on leave the schedule as it is; a first step's recording that
        a failed step left open is dropped, not kept as the run's GEMMs."""
        self._training = False
        if self._recording is not None:
            ended = RuntimeError("trainer.train() ended inside its first step")
            self._recording.__exit__(RuntimeError, ended, None)
            self._recording = None

    def _restore(self, args, state) -> None:
        candidates = [Path(args.output_dir) / f"checkpoint-{state.global_step}" / CHECKPOINT_FILE]
        if isinstance(args.resume_from_checkpoint, str):
            candidates.insert(0, Path(args.resume_from_checkpoint) / CHECKPOINT_FILE)
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"resuming at step {state.global_step} without the DSQ schedule: no "
                f"{candidates[-1]}; resume from a checkpoint saved with DSQCallback attached"
            )
        saved = torch.load(found, weights_only=True)
        self.cfg.load_state_dict(saved["schedule"])
        self.cfg.load_noise_state(saved["noise"])
        self.history = PrecisionHistory(dict(saved["history"]))
        log.info("dsq: schedule restored from %s: %s", found, self.cfg.current())


class _TrainEnds:
    """``trainer.train`` as `DSQCallback.attach` leaves it: a ``train()`` that raises ends the
    callback's training as ``on_train_end`` would (which the Trainer then never calls), so a
    later ``trainer.evaluate()`` leaves the schedule as it is."""

    def __init__(self, train, callback: DSQCallback):
        self.train, self.callback = train, callback

    def __call__(self, *args, **kwargs):
        try:
            return self.train(*args, **kwargs)
        except BaseException:
            self.callback.end_training()
            raise


def versions() -> dict[str, str | None]:
    """What a Trainer run ran on: python, torch, transformers and dsq (None where unknown)."""
    try:
        dsq_version = importlib.metadata.version("dsq")  # dsq.__version__, as installed
    except importlib.metadata.PackageNotFoundError:
        dsq_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dsq": dsq_version,
    }
