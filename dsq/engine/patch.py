"""Patching a model for DSQ training: the generic walk, which makes every ``nn.Linear`` a
`DSQLinear` (``dsq_linear``), and the `Patcher` protocol through which a framework's integration
(``dsq.integrations``) patches its own layers and attention products; with ``stash_scope="all"``
every other saved activation is packed in q1. The accounting records count the GEMMs that really
execute. ``dsq.integrations.quantize_model`` chooses the patchers a model needs and calls
`patch_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from dsq.warn_once import warn_once

from .config import QuantConfig
from .derivative_codes import DerivativeCode, coded_activation, derivative_code
from .functions import dsq_linear
from .masks import dsq_dropout, dsq_relu
from .spec import SAVED_DEFAULT, QuantSpec


class DSQLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``dsq_linear``. Made by re-classing an existing
    Linear in place, so its parameters (and the optimizer's references to them) stay the same."""

    dsq_cfg: QuantConfig

    def forward(self, x):
        return dsq_linear(x, self.weight, self.bias, self.dsq_cfg)


class DSQReLU(nn.ReLU):
    """An ``nn.ReLU`` whose backward pass holds one bit per value (`dsq.engine.masks`): the same
    values and gradients."""

    def forward(self, x):
        return dsq_relu(x, self.inplace)


class DSQDropout(nn.Dropout):
    """An ``nn.Dropout`` whose backward pass holds its mask as bits (`dsq.engine.masks`): the
    same random numbers, values and gradients."""

    def forward(self, x):
        return dsq_dropout(x, self.p, self.training, self.inplace)


class DSQCodedActivation(nn.Module):
    """The mixin of a SiLU or GELU module whose backward pass holds a few-bit code of its
    derivative (`dsq.engine.derivative_codes`; ``quant.saved.activation=derivative<k>``): its
    own forward, the same outputs bit for bit, each input's gradient through the level nearest
    its derivative."""

    dsq_derivative_code: DerivativeCode

    def forward(self, x):
        return coded_activation(x, self.dsq_derivative_code, super().forward)


def torch_activation_function(module: nn.Module) -> str | None:
    """The function (`derivative_codes.FUNCTIONS`) that ``module``, of one of torch's own
    activation classes, computes; None for any other module and for one working in place."""
    if type(module) is nn.SiLU and not module.inplace:
        return "silu"
    if type(module) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return None


# Modules re-classed to save bit masks (exact types: Dropout1d/2d drop whole channels).
MASK_MODULES = {nn.ReLU: DSQReLU, nn.Dropout: DSQDropout}
_MASKED = tuple(MASK_MODULES.values())


@dataclasses.dataclass
class PatchReport:
    """What ``quantize_model`` patched and what it left as it was."""

    linears: list[str] = dataclasses.field(default_factory=list)  # Linear and Conv1D layers
    attention: list[str] = dataclasses.field(default_factory=list)
    excluded: list[str] = dataclasses.field(default_factory=list)
    #: ReLUs and dropouts whose backward pass holds bit masks (dsq.engine.masks)
    masks: list[str] = dataclasses.field(default_factory=list)
    left: dict[str, int] = dataclasses.field(default_factory=dict)  # module type -> count
    stash_scope: str = "gemm"
    #: GEMMs that will run unquantized: "name (why)", for layers and attention left as they were
    unquantized: list[str] = dataclasses.field(default_factory=list)
    #: how the attention products are computed, where that is not fairseq's own path
    notes: list[str] = dataclasses.field(default_factory=list)
    #: MLPs run a slice of tokens at a time (``quant.mlp=sliced``, docs/dsq.md)
    sliced_mlps: list[str] = dataclasses.field(default_factory=list)

    @property
    def attention_products(self) -> int:
        return 2 * len(self.attention)

    def summary(self) -> str:
        left = ", ".join(f"{n} x{c}" for n, c in sorted(self.left.items())) or "nothing"
        unquantized = "; ".join(self.unquantized) or "none"
        notes = "".join(f"; {note}" for note in self.notes)
        sliced = f"; MLPs in slices: {len(self.sliced_mlps)}" if self.sliced_mlps else ""
        return (
            f"DSQ patched {len(self.linears)} Linear layers and {self.attention_products} "
            f"attention products in {len(self.attention)} attention modules; excluded "
            f"{len(self.excluded)} ({', '.join(self.excluded) or 'none'}); ReLU and dropout "
            f"masks held as bits in {len(self.masks)}; stash_scope="
            f"{self.stash_scope}; left unquantized: {left}; GEMMs left unquantized: "
            f"{unquantized}{sliced}{notes}"
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


class Patcher(Protocol):
    """What an integration patches beyond ``nn.Linear``: its framework's layers (`claims`,
    `patch`, one module at a time during the walk) and anything model-wide afterwards
    (`finish`: attention routing, a module-level hook)."""

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is one this patcher patches."""
        ...

    def patch(self, name: str, module: nn.Module, cfg: QuantConfig, report: PatchReport) -> None:
        """Patch ``module`` (not excluded) in place and book it in ``report``."""
        ...

    def finish(self, model: nn.Module, cfg: QuantConfig, report: PatchReport,
               excluded: Callable[[str], bool]) -> None:  # fmt: skip
        """After the walk: what the patcher does model-wide (may do nothing)."""
        ...

    def activation_function(self, module: nn.Module) -> str | None:
        """The function (`derivative_codes.FUNCTIONS`) an activation module of this framework
        computes, its forward a function of its input alone: such a module holds a code of that
        function's derivative where the rules ask for one. None for any other module."""
        ...


def patch_model(
    model: nn.Module,
    cfg: QuantConfig,
    patchers: Sequence[Patcher] = (),
    exclude=(),
    strict: bool = False,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Patch ``model`` in place with the engine's Linear rule and ``patchers``; see
    ``dsq.integrations.quantize_model``, which picks the patchers, for the arguments."""
    if isinstance(cfg, QuantSpec):  # the frozen spec, as torchao's quantize_ takes its config
        cfg = QuantConfig.from_spec(cfg)
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig or a QuantSpec, got {type(cfg).__name__}")
    if cfg.engine != "dsq":
        raise ValueError(
            f"quant.engine={cfg.engine!r} trains the model unpatched under torch.autocast "
            f"({cfg.autocast_dtype}): run it inside torch.autocast instead of quantize_model"
        )
    if getattr(model, "dsq_cfg", None) is not None:
        raise ValueError(
            f"{type(model).__name__} is quantized already (model.dsq_report says how); build "
            "the model anew to quantize it with another config"
        )
    quantized = [n for n, m in model.named_modules()
                 if n and ("dsq_undo" in m.__dict__ or "dsq_cfg" in m.__dict__)]  # fmt: skip
    if quantized:
        raise ValueError(
            f"{type(model).__name__} holds {quantized[0]}, patched already by quantize_model; "
            "unpatch it (dsq.unpatch) before quantizing the model around it"
        )
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [p for p in exclude if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(
            f"exclude pattern {unmatched[0]!r} matches no module of {type(model).__name__} "
            f"(module names look like {', '.join(names[:3])}); fix or drop the pattern"
        )
    modules = dict(model.named_modules())

    def excluded(name: str) -> bool:
        """Left as it is: a name ``exclude`` matches, or a module ``filter_fn`` turns down."""
        if _excluded(name, exclude):
            return True
        return filter_fn is not None and not filter_fn(modules[name], name)

    report = PatchReport(stash_scope=cfg.stash_scope)
    try:
        _walk(model, cfg, patchers, excluded, report)
        for patcher in patchers:
            patcher.finish(model, cfg, report, excluded)
        if cfg.mlp == "sliced" and not report.sliced_mlps:
            raise ValueError(
                "quant.mlp=sliced runs Llama-style MLPs (transformers' LlamaMLP and the models "
                f"that copy it) a slice of tokens at a time, and {type(model).__name__} has none "
                "to slice (the report's notes say why where it has some): set quant.mlp=whole"
            )
        if cfg.derivative_code_bits is not None:
            _code_activations(model, cfg, patchers, excluded, report)
        if strict and report.unquantized:
            raise ValueError(
                "quantize_model(strict=True): GEMMs would run unquantized: "
                + "; ".join(report.unquantized)
            )
        if not report.linears and not report.attention:
            raise ValueError(
                f"quantize_model found nothing to patch in {type(model).__name__}: no nn.Linear "
                f"or attention module outside the excluded patterns {list(exclude)}"
            )
    except BaseException:
        _undo(model)  # a refused model is left as it came, not half patched
        raise
    if cfg.stash_scope == "all":
        enter_stash_all_on_call(model, cfg)
        held = ", ".join(f"{kind} {what}" for kind, what in cfg.spec.saved.items())
        report.notes.append(f"saved tensors held: GEMM inputs q1, {held}")
    for module in model.modules():
        module.dsq_seen = True
    on_unpatch(model, "remove", model.register_forward_pre_hook(name_layers_added_later))
    model.dsq_report = report
    model.dsq_cfg = cfg
    return model


def _walk(model: nn.Module, cfg: QuantConfig, patchers, excluded, report: PatchReport) -> None:
    """Patch each module of ``model`` by the Linear rule, the mask rule or its patcher."""
    for name, module in model.named_modules():
        if not name:
            continue
        patcher = next((p for p in patchers if p.claims(module)), None)
        if isinstance(module, nn.Linear) or patcher is not None:
            if excluded(name):
                report.excluded.append(name)
            elif patcher is not None:
                patcher.patch(name, module, cfg, report)
            else:
                make_dsq_linear(module, cfg)
                report.linears.append(name)
        elif type(module) in MASK_MODULES:
            if not excluded(name):
                reclass(module, MASK_MODULES[type(module)])
                report.masks.append(name)
        elif not list(module.children()) and any(True for _ in module.parameters(False)):
            kind = type(module).__name__
            report.left[kind] = report.left.get(kind, 0) + 1
            if _does_gemm(module) and not excluded(name):
                report.unquantized.append(f"{name} ({kind}: not a layer dsq knows)")


def _code_activations(model: nn.Module, cfg: QuantConfig, patchers, excluded,
                      report: PatchReport) -> None:  # fmt: skip
    """Under ``quant.saved.activation=derivative<k>``: each SiLU and GELU module (torch's, or a
    framework's its patcher knows) holds a ``k``-bit code of its derivative; the report counts
    them and names every other activation module, which holds the activation default."""
    bits = cfg.derivative_code_bits
    recognizers = [torch_activation_function] + [
        p.activation_function for p in patchers if hasattr(p, "activation_function")
    ]
    coded: dict[str, int] = {}
    uncoded = []
    inside_sliced = 0
    for name, module in model.named_modules():
        if (not name or "Norm" in type(module).__name__ or not _is_activation_module(module)
                or type(module) in _MASKED):  # fmt: skip
            continue  # a ReLU holding its bit mask (`MASK_MODULES`), counted in the report
        if module.__dict__.get("dsq_inside_sliced_mlp"):
            inside_sliced += 1  # computed by its MLP in slices, which holds nothing of it
            continue
        for recognize in recognizers:  # the first that knows the module's function
            function = recognize(module)
            if function:
                break
        if function is None or excluded(name):
            why = "excluded" if function else "no code for its function"
            uncoded.append(f"{name} ({type(module).__name__}: {why})")
            continue
        reclass(module, dsq_subclass(module, DSQCodedActivation))
        module.dsq_derivative_code = derivative_code(function, bits)
        coded[function] = coded.get(function, 0) + 1
    counts = ", ".join(f"{function} x{n}" for function, n in sorted(coded.items())) or "none"
    held = SAVED_DEFAULT["activation"]
    inside = (f"; {inside_sliced} inside MLPs in slices, holding nothing (computed again in "
              "the backward pass)") if inside_sliced else ""  # fmt: skip
    report.notes.append(
        f"activations holding {bits}-bit derivative codes: {counts}; activation modules "
        f"holding {held} instead: {'; '.join(uncoded) or 'none'}{inside}"
    )


def name_layers_added_later(model: nn.Module, args) -> None:
    """A patched model's forward pre-hook: it names, once each, the Linear layers added after
    the model was patched (a LoRA adapter added later), which run unquantized, in the report and
    a warning instead of the report's "none". Patching marks every module it saw
    (``dsq_seen``), so a copy of the model (``copy.deepcopy``) knows its own."""
    import warnings

    for name, module in model.named_modules():
        if getattr(module, "dsq_seen", False):
            continue
        module.dsq_seen = True
        if isinstance(module, nn.Linear) and not hasattr(module, "dsq_cfg"):
            line = f"{name} (Linear: added after quantize_model; unpatch and quantize again)"
            model.dsq_report.unquantized.append(line)
            warnings.warn(f"dsq: {line} runs unquantized", stacklevel=2)


# -- undoing a patch ------------------------------------------------------------------------------
# Undo steps are data about the module they are booked on, not closures over it: a copy of a
# patched model (copy.deepcopy) undoes its own modules, not the original's, and torch.save
# pickles a patched model whole.
def on_unpatch(module: nn.Module, action: str, *data) -> None:
    """Book one step for `unpatch_model`, which takes a module's in the reverse order of
    booking: ``("remove", handle)`` removes a hook, ``("setattr", name, value)`` puts an
    attribute (the class included) back, ``("call", method, *args)`` calls
    ``module.method(*args)``, ``("apply", function)`` calls ``function(module)``."""
    if action not in _UNDO_ACTIONS:
        raise ValueError(f"unknown undo action {action!r}; one of {sorted(_UNDO_ACTIONS)}")
    module.__dict__.setdefault("dsq_undo", []).append((action, *data))


_UNDO_ACTIONS = {
    "remove": lambda module, handle: handle.remove(),
    "setattr": lambda module, name, value: setattr(module, name, value),
    "call": lambda module, method, *args: getattr(module, method)(*args),
    "apply": lambda module, function: function(module),
}


def reclass(module: nn.Module, cls: type) -> None:
    """``module.__class__ = cls``, booked to be put back by `unpatch_model`."""
    on_unpatch(module, "setattr", "__class__", type(module))
    module.__class__ = cls


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo `patch_model` in place and return ``model``: every module's class, hooks and the
    attention routing as they were before, and no ``dsq_*`` attribute left, so that the model
    computes what it computed before patching (and can be patched again). A ``stash_scope=all``
    context a call left open (interrupted by ``KeyboardInterrupt``) is closed."""
    if getattr(model, "dsq_cfg", None) is None:
        raise ValueError(f"{type(model).__name__} is not quantized: nothing to unpatch")
    _undo(model)
    return model


def _undo(model: nn.Module) -> None:
    """Take every booked undo step of ``model``'s modules and drop their ``dsq_*`` attributes."""
    for module in model.modules():
        entry = module.__dict__.get("dsq_stash_all")
        if entry is not None:
            entry.close()
        for action, *data in reversed(module.__dict__.get("dsq_undo", [])):
            _UNDO_ACTIONS[action](module, *data)
        for key in [k for k in module.__dict__ if k.startswith("dsq_")]:
            del module.__dict__[key]


def make_dsq_linear(module: nn.Module, cfg: QuantConfig, mixin: type | None = None) -> None:
    """Re-class ``module`` in place so that its forward runs through DSQ: an ``nn.Linear`` becomes
    `DSQLinear`; a subclass of it, or another linear layer with ``mixin`` (its DSQ forward), gets
    a subclass that keeps its own class for isinstance checks. Its parameters (and an
    optimizer's references to them) stay the same."""
    if mixin is None and type(module) is nn.Linear:
        reclass(module, DSQLinear)
    else:
        reclass(module, dsq_subclass(module, mixin or DSQLinear))
    module.dsq_cfg = cfg


_SUBCLASSES: dict[tuple[type, type], type] = {}


def dsq_subclass(module: nn.Module, mixin: type) -> type:
    """``mixin`` (its DSQ forward) over the module's own class, which it keeps for isinstance
    checks: a Linear subclass, or ``transformers``' Conv1D."""
    return _subclass(type(module), mixin)


def _subclass(cls: type, mixin: type) -> type:
    key = (cls, mixin)
    if key not in _SUBCLASSES:
        # made at run time, so not found by name when unpickled: an instance pickles as its
        # two classes (_rebuild_subclass), which every process can import
        _SUBCLASSES[key] = type(f"DSQ{cls.__name__}", (mixin, cls),
                                {"__reduce_ex__": _reduce_subclass})  # fmt: skip
    return _SUBCLASSES[key]


def _reduce_subclass(module: nn.Module, protocol):
    mixin, cls = type(module).__bases__
    return _rebuild_subclass, (cls, mixin), module.__dict__


def _rebuild_subclass(cls: type, mixin: type) -> nn.Module:
    """An empty instance of the DSQ subclass of ``cls``; pickle then sets its state."""
    return object.__new__(_subclass(cls, mixin))


# ----------------------------------------------------------------------------- stash_scope=all
class _PackedSave:
    """What a saved-tensor hook keeps instead of a floating activation: the packed tensor, and
    whether it is given back contiguous (a kernel that reads it by its own layout, as torch's
    fused attention does, where a format packed along another axis unpacks it transposed)."""

    __slots__ = ("packed", "requires_grad", "contiguous", "__weakref__")

    def __init__(self, packed, requires_grad, contiguous=False):
        self.packed = packed
        self.requires_grad = requires_grad
        self.contiguous = contiguous


# A saved tensor is packed when its rows (the last axis, along which it is packed) hold at least
# one block of the stash format: layer-norm inputs, softmax outputs, activation inputs. Shorter
# rows are per-row statistics (a layer norm's mean and reciprocal deviation, one value a row),
# which a block of one value would round to a power of two; they stay as they are.
STASH_ALL_MIN_ROW = 16

# The pointwise activation modules: torch's (not the rest of torch.nn.modules.activation, which
# holds MultiheadAttention and the softmaxes) and others' by their class names' marks
_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LogSigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.GLU,
)  # fmt: skip
_ACTIVATION_MARKS = ("GELU", "SiLU", "Swish", "Mish", "ReLU", "Tanh", "Sigmoid", "Softplus")


def saved_kind(module: nn.Module | None, t: torch.Tensor) -> str | None:
    """The kind (``SAVED_KINDS``) of ``t``, saved while ``module`` (the innermost module called)
    runs: None for a patched GEMM layer's input (held in q1; its own function packs it, so the
    hooks rarely see one), else ``constant`` for a tensor needing no gradient, ``norm`` inside a
    normalization, ``activation`` inside a pointwise activation module, ``elementwise`` for the
    rest of the graph (a product's operands, a softmax's output, the input of a layer left
    unquantized)."""
    if not t.requires_grad:
        return "constant"
    if module is None:
        return "elementwise"
    if "Norm" in type(module).__name__:
        return "norm"
    if _is_activation_module(module):
        return "activation"
    if getattr(module, "dsq_cfg", None) is not None and _does_gemm(module):
        return None
    return "elementwise"


def _is_activation_module(module: nn.Module) -> bool:
    """A pointwise activation module, by its class (`_ACTIVATIONS`) or its class's name."""
    name = type(module).__name__
    return (isinstance(module, _ACTIVATIONS) or name.endswith("Activation")
            or any(mark in name for mark in _ACTIVATION_MARKS))  # fmt: skip


_HELD_AS_SAVED = threading.local()


@contextlib.contextmanager
def held_as_saved():
    """Inside the block, `stash_all_hooks` hold what autograd saves as it is: a fused kernel's
    own saved tensors (torch's attention kernel's output and log-sum-exp, docs/dsq.md,
    "Attention in torch's fused kernel"), which a narrower copy would not round but change;
    but a tensor marked ``dsq_held_in = (format, axis)``, whose values that format holds
    exactly, is packed in it (the kernel's inputs in q0). A checkpoint's own hooks on top
    still take each tensor."""
    depth = getattr(_HELD_AS_SAVED, "depth", 0)
    _HELD_AS_SAVED.depth = depth + 1
    try:
        yield
    finally:
        _HELD_AS_SAVED.depth = depth


def stash_all_hooks(cfg: QuantConfig, innermost=lambda: None, packed_once=None):
    """Saved-tensor hooks packing the floating activations autograd saves, each in the format
    its kind holds (`saved_kind` of the tensor and ``innermost()``, the module running;
    ``cfg.saved_format``), leaving parameters and their views, non-floating tensors (bit
    masks, indices), tensors of rows shorter than `STASH_ALL_MIN_ROW`, tiny tensors and the
    kinds kept as they are. ``packed_once`` (a dict) packs a tensor saved twice (a norm's input,
    read by two of its operations) once."""

    def pack(t: torch.Tensor):
        if (
            not t.is_floating_point()
            or t.numel() < 64
            or t.dim() == 0
            or t.shape[-1] < STASH_ALL_MIN_ROW
            or _a_parameter(t)
            # a stash already in its format (engine.attention), a gradient (chunked_output)
            or getattr(t, "dsq_held_as_is", False)
        ):
            return t
        if getattr(_HELD_AS_SAVED, "depth", 0):  # a fused kernel's own (`held_as_saved`)
            held_in = getattr(t, "dsq_held_in", None)
            if held_in is None:
                return t
            fmt, axis = held_in
            return _PackedSave(fmt.pack(t.detach(), axis), t.requires_grad, t.is_contiguous())
        fmt = cfg.saved_format(saved_kind(innermost(), t))
        if fmt is None or fmt.spec == "fp32":
            return t
        key = (id(t), t._version, fmt.spec)
        if packed_once is not None and key in packed_once:
            alive, kept = packed_once[key]
            saved = kept()
            # the same tensor, not a later one at its address, and its packed copy still held by
            # a graph (held weakly here: a graph freed during the forward frees its copy)
            if alive() is t and saved is not None:
                return saved
        rounding, generator = cfg.rounding_of("q1", t.device)
        saved = _PackedSave(fmt.pack(t.detach(), -1, rounding, generator), t.requires_grad)
        if packed_once is not None:
            packed_once[key] = (weakref.ref(t), weakref.ref(saved))
        return saved

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


def _unpack(saved):
    if isinstance(saved, _PackedSave):
        unpacked = saved.packed.unpack()
        return unpacked.contiguous() if saved.contiguous else unpacked
    return saved


@contextlib.contextmanager
def _held_by_the_rules_when_run_again(cfg: QuantConfig, innermost, packed_once, kept=None):
    """`stash_all_hooks` over a layer's forward run again in the backward pass. With a
    checkpoint's own hooks on top (``torch.utils.checkpoint``, non-reentrant: they take each
    recomputed tensor for the backward pass), each tensor goes to them as the rules' hooks would
    give it back, packed and unpacked, so the backward pass reads the values it reads without
    checkpointing; with none (the reentrant form, `held_input_checkpoint`), the rules' hooks
    hold what is saved, as in a forward pass, and ``kept`` (a set) gets the storage of each
    tensor they hold as it is: a storage not in it is read by no backward of the run."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    hooks = stash_all_hooks(cfg, innermost, packed_once)
    if top is None:
        if kept is None:
            with hooks:
                yield
            return

        def noting_kept(t):
            saved = hooks.pack_hook(t)
            if saved is t:
                kept.add(t.untyped_storage().data_ptr())
            return saved

        with torch.autograd.graph.saved_tensors_hooks(noting_kept, _unpack):
            yield
        return
    rules_pack, (checkpoint_pack, checkpoint_unpack) = hooks.pack_hook, top

    def pack(t):
        return checkpoint_pack(_unpack(rules_pack(t)))

    with torch.autograd.graph.saved_tensors_hooks(pack, checkpoint_unpack):
        yield


def _a_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (an unpatched Linear saves ``weight.t()``): alive anyway, so
    a packed copy would only add to what the step holds. Other leaves needing a gradient are
    packed as their kind says: a checkpointed layer's input, detached by the reentrant
    ``torch.utils.checkpoint`` for its run again, is one, and is held as the forward pass held
    it."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


_RUN_AGAIN_UNWRAPPED = (
    "dsq: stash_scope=all: a module of the model runs in the backward pass, under a checkpoint "
    "dsq does not wrap (torch.utils.checkpoint called by your own code): its inputs and what it "
    "saves are not held as the forward pass held them, so its gradients differ from a step "
    "without checkpointing. Use the model's gradient_checkpointing_enable(), or checkpoint "
    "with dsq.engine.checkpointing.checkpoint_as_first_run(your_checkpoint, cfg, function, "
    "*args)"
)

# the `_StashAllEntry` whose hooks this thread has open (a patched model's forward pass)
_OPEN = threading.local()


def open_stash_all() -> _StashAllEntry | None:
    """The ``stash_scope=all`` entry of the model whose forward pass runs on this thread, if any:
    a layer checkpointed inside it (`held_input_checkpoint`, `checkpoint_under_the_rules`) runs
    its recomputation under it."""
    return getattr(_OPEN, "entry", None)


class _StashAllEntry:
    """The `stash_all_hooks` of one patched model, entered by whichever of its modules is called
    first and left when that call returns: calls nested inside it (the model's own submodules)
    enter nothing, but each call's module is known to the hooks (the kind of what it saves). In
    the backward pass a layer run again by a checkpoint runs inside `recomputing`, entered by
    dsq's checkpoint wrappers; a call there outside it (a checkpoint of the user's own) enters
    nothing and is warned of, once. Each thread has its own
    open calls and context (``nn.DataParallel`` runs the replicas' forwards on threads of their
    own)."""

    def __init__(self, cfg: QuantConfig):
        self.cfg = cfg
        self.local = threading.local()

    def __getstate__(self):  # a thread's open call is not part of a saved model
        return {"cfg": self.cfg}

    def __setstate__(self, state):
        self.__init__(state["cfg"])

    def innermost(self) -> nn.Module | None:
        modules = getattr(self.local, "modules", None)
        return modules[-1] if modules else None

    def enter(self, module, args):
        # the modules whose calls are open on this thread, outermost first: their count is the
        # depth of nesting, and the last is the one saving what the hooks see
        modules = getattr(self.local, "modules", None)
        if modules and any(open_call is module for open_call in modules):
            # a module called again while its own call is open (modules do not call themselves):
            # that call ended by an exception no hook saw (KeyboardInterrupt skips the forward
            # hooks), so close it
            self.close()
            modules = None
        if not modules and not getattr(self.local, "recomputing", False):
            if torch._C._current_graph_task_id() != -1:
                # in a backward pass, outside dsq's checkpoint wrappers (they run it under
                # `recomputing`): a checkpoint of the user's own runs the module again
                warn_once(__name__, _RUN_AGAIN_UNWRAPPED)
                return
            self.local.modules, self.local.packed_once = [], {}
            self.local.context = stash_all_hooks(self.cfg, self.innermost, self.local.packed_once)
            self.local.context.__enter__()
            _OPEN.entry = self
        self.local.modules.append(module)

    def leave(self, module, args, output):
        modules = getattr(self.local, "modules", None)
        if not modules:  # a call `enter` let pass
            return
        modules.pop()
        if not modules and not getattr(self.local, "recomputing", False):
            self.close()

    @contextlib.contextmanager
    def recomputing(self, kept=None):
        """The hooks, with the modules called known to them, over a checkpointed layer's forward
        run again in the backward pass (`held_input_checkpoint`, `checkpoint_under_the_rules`):
        what it saves is held by the same rules as in a forward pass
        (`_held_by_the_rules_when_run_again`, which notes in ``kept`` the storages it holds as
        they are). This thread's state outside is restored after."""
        local = self.local
        outside = {k: getattr(local, k, None) for k in ("context", "modules", "packed_once")}
        was = getattr(local, "recomputing", False)
        local.context, local.modules, local.packed_once = None, [], {}
        local.recomputing = True
        try:
            with _held_by_the_rules_when_run_again(self.cfg, self.innermost, local.packed_once,
                                                   kept):  # fmt: skip
                yield
        finally:
            for key, value in outside.items():
                setattr(local, key, value)
            local.recomputing = was

    def close(self) -> None:
        """Leave this thread's open context, if any."""
        local = self.local
        context = getattr(local, "context", None)
        local.context, local.modules, local.packed_once = None, [], {}
        if getattr(_OPEN, "entry", None) is self:
            _OPEN.entry = None
        if context is not None:
            context.__exit__(None, None, None)


def stash_all_hook(hook) -> bool:
    """Whether ``hook`` is one of the hooks `enter_stash_all_on_call` puts on every module: a
    module computed another way than by its call (an MLP in slices) loses nothing by skipping
    them, as it would a user's."""
    return isinstance(getattr(hook, "__self__", None), _StashAllEntry)


def enter_stash_all_on_call(model: nn.Module, cfg: QuantConfig) -> None:
    """``stash_scope="all"``: a call of ``model`` or of any module in it (``model.model(...)``
    for a loss of one's own, a wrapper's call of an inner model) packs what autograd saves
    while it runs (`stash_all_hooks`), once, however deeply the calls nest."""
    entry = _StashAllEntry(cfg)
    model.dsq_stash_all = entry
    for module in model.modules():
        on_unpatch(module, "remove", module.register_forward_pre_hook(entry.enter))
        on_unpatch(module, "remove", module.register_forward_hook(entry.leave, always_call=True))
