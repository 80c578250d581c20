"""Activation checkpointing of whole layers (docs/dsq.md, "What the backward pass holds").

The other way to train with less memory: a checkpointed layer keeps only its input for the
backward pass and runs its forward again there, holding its activations for the length of its
own backward. ``torch.utils.checkpoint`` in its non-reentrant form does this and works with any
layer, patched by DSQ or not, under ``torch.autocast`` or not. A DSQ layer run again packs its
stash again, with the values of the first forward: the formats in force do not change between
a forward and its backward, and under stochastic rounding the run again draws the noise the
first run drew (`run_again_as_first`: the noise generators are set back to their state before
the first run, and after the run again to where the backward pass had them, so the backward
pass's own draws are those of a step without checkpointing). The run's records count each GEMM
once, as its first forward ran it (`accounting.recomputation`).

The input a checkpointed layer keeps is float32, a layer's width of 4-byte values a token. Under
``stash_scope=all`` the rule ``quant.saved.checkpoint`` may hold it in a format instead
(`held_input_checkpoint`): the layer then computes on the input's values in that format, in its
forward pass and again in the backward pass, so the two runs agree, and the gradient reaching
the input passes to the residual stream unchanged (as through a rounding that is not there).
What changes numerically is the layer's input, rounded to the format at every checkpointed
layer; the residual stream itself, outside the layers, stays float32. The layer run again there
holds what it saves by the model's ``stash_scope=all`` rules (`patch.open_stash_all`), as its
forward pass would have, and so does a layer run again by ``torch.utils.checkpoint``
(`checkpoint_under_the_rules`): its values are then those of the step without checkpointing.
In `held_input_checkpoint`'s run again no backward reads the unpacked input or the outputs
unless a rule holds their storage as it is, so their memory is given back before the run's
backward pass (`_free_unless_kept`); a module whose output only sums into the layer's outputs
(an MLP in slices ending a Llama layer) computes none of it there (`unread_outputs`, checked on
the run's graph after it, the layer run once more where a backward reads it). And the layer's
incoming gradient, which autograd holds until the checkpoint's backward pass returns, is handed
to the run again's graph where nothing else holds it (`_GradientTakenOver`): autograd then sums
the residual stream's gradients into its memory in place, where it would allocate each sum
beside it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from dsq.formats import Format

from . import accounting, units, unread_outputs
from .accounting import recomputation
from .config import QuantConfig
from .functions import _stash_header, _stash_restore
from .patch import open_stash_all


def _contexts():
    """torch.utils.checkpoint's contexts of the forward pass and of its recomputation: the
    recomputation notes no GEMM, the forward pass already did."""
    return contextlib.nullcontext(), accounting.recomputation()


def checkpoint_under_the_rules(checkpoint_function, function, *args, **kwargs):
    """``checkpoint_function(function, *args, **kwargs)`` (``torch.utils.checkpoint``, either
    form, or a model's own), where a ``stash_scope=all`` model's forward pass is open
    (`patch.open_stash_all`): ``function``, run again in the backward pass, holds what it saves
    by the model's rules across its whole run, as the forward pass holds it without
    checkpointing, so the gradients are those of the step without checkpointing."""
    stash_all = open_stash_all()
    run = function if stash_all is None else run_again_as_first(function, rules=stash_all)
    if stash_all is None:
        return checkpoint_function(run, *args, **kwargs)
    # what the checkpoint itself saves, the layer's inputs, is held as it is (the rule
    # quant.saved.checkpoint=keep): packed, the run again would compute on other inputs than
    # the forward pass did
    with torch.autograd.graph.saved_tensors_hooks(_as_it_is, _as_it_is):
        return checkpoint_function(run, *args, **kwargs)


_ALL_STOCHASTIC_Q1 = (
    "stash_scope=all with stochastic rounding at q1 under checkpointing: the checkpoint holds "
    "nothing in a layer's first run, so the saved tensors' noise would be drawn in its run again "
    "only, and every later draw would differ. Round q1 to nearest, use stash_scope=gemm, or turn "
    "checkpointing off"
)


def run_again_as_first(function, *, cfg: QuantConfig | None = None, device=None, rules=None):
    """``function`` for a checkpoint, whose run again in the backward pass (a backward pass is
    running) repeats its first run: under ``cfg``'s stochastic rounding it draws the noise the
    first run drew on ``device``, and under ``rules`` (a ``stash_scope=all`` model's entry,
    `patch.open_stash_all`) it holds what it saves by them. Call it just before the first run:
    the noise's state is taken here."""
    noise = None
    stochastic = [] if cfg is None else [p for p, m in cfg.rounding.items() if m == "stochastic"]
    if stochastic:
        if "q1" in stochastic and open_stash_all() is not None:
            raise ValueError(_ALL_STOCHASTIC_Q1)
        for kind in {torch.device(device).type, "cpu"}:
            cfg.generator(kind)  # made now (seeded as at their first draw), so their state is known
        noise = cfg.noise_state()
    if noise is None and rules is None:
        return function

    @functools.wraps(function)
    def run(*run_args, **run_kwargs):
        if torch._C._current_graph_task_id() == -1:  # the first run, in the forward pass
            if noise is not None and not torch.is_grad_enabled() and "q1" in stochastic:
                # the stash's noise is drawn only where a backward pass will read it
                raise ValueError(
                    "stochastic rounding at q1 under a reentrant checkpoint: its first run has "
                    "no gradients, so it stashes nothing and draws less noise than its run "
                    "again. Checkpoint with use_reentrant=False "
                    '(gradient_checkpointing_enable({"use_reentrant": False})), or round q1 '
                    "to nearest"
                )
            return function(*run_args, **run_kwargs)
        with contextlib.ExitStack() as stack:
            if noise is not None:
                stack.enter_context(_noise_replayed(cfg, noise))
            if rules is not None:
                stack.enter_context(rules.recomputing())
            return function(*run_args, **run_kwargs)

    return run


@contextlib.contextmanager
def _noise_replayed(cfg: QuantConfig, first: dict):
    """``cfg``'s noise generators at ``first`` for the block, and as they were after it."""
    now = cfg.noise_state()
    cfg.load_noise_state(first)
    try:
        yield
    finally:
        cfg.load_noise_state(now)


def _as_it_is(t: torch.Tensor) -> torch.Tensor:
    return t


def checkpoint_layers(layers: Iterable[nn.Module], cfg: QuantConfig | None = None) -> int:
    """Run each of ``layers`` under non-reentrant activation checkpointing from now on (its
    ``forward`` replaced on the instance), where a gradient can follow; return how many. ``cfg``,
    the model's QuantConfig if it is patched: the run again draws the first run's stochastic
    rounding noise, and a ``quant.saved.checkpoint`` format holds each layer's input
    (`held_input_checkpoint`). ``stash_scope=all`` with a stochastic q1 is refused here, before
    training, as `run_again_as_first` would refuse it at the first step."""
    if cfg is not None and cfg.stash_scope == "all" and cfg.rounding["q1"] == "stochastic":
        raise ValueError(_ALL_STOCHASTIC_Q1)
    count = 0
    for layer in layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            own = functools.partial(checkpoint, use_reentrant=False, context_fn=_contexts)
            return checkpoint_as_first_run(own, cfg, _forward, *args, **kwargs)

        layer.forward = checkpointed
        count += 1
    return count


def checkpoint_as_first_run(own, cfg: QuantConfig | None, function, *args, **kwargs):
    """``function(*args, **kwargs)`` checkpointed by ``own`` (``torch.utils.checkpoint`` or a
    model's own checkpointing function), its run again in the backward pass repeating its first
    run under ``cfg``, the model's QuantConfig if it is patched: the first run's stochastic
    rounding noise, a ``stash_scope=all`` model's rules (`checkpoint_under_the_rules`), and a
    ``quant.saved.checkpoint`` format holding the layer's input (`held_input_checkpoint`, which
    takes ``own``'s place; the rule's format at this call: ``q1`` follows the schedule)."""
    if cfg is None:
        return checkpoint_under_the_rules(own, function, *args, **kwargs)
    run = run_again_as_first(function, cfg=cfg, device=_first_device(args))
    held = cfg.saved_format("checkpoint")
    if held is not None:
        return held_input_checkpoint(held, run, *args, **kwargs)
    return checkpoint_under_the_rules(own, run, *args, **kwargs)


def _first_device(args) -> torch.device:
    """The device of the first tensor among ``args`` (the CPU if none)."""
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


# -- a checkpointed layer's input held in a format ------------------------------------------------
def _needs_grad(value) -> bool:
    """Whether ``value`` is or holds (in a tuple, list or dict) a tensor needing a gradient."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


def held_input_checkpoint(fmt: Format, function, *args, **kwargs):
    """``function(*args, **kwargs)`` checkpointed with its first argument held in ``fmt``
    (module docstring): the layer computes on that argument's values in ``fmt``, in the forward
    pass and when the backward pass runs it again, and its gradient passes to the argument
    unchanged. The other positional arguments are kept as given and get their gradients; a
    keyword argument needing a gradient is refused (it would not get one)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            "quant.saved.checkpoint holds a checkpointed layer's first positional argument, and "
            f"this layer got {type(x).__name__}: pass its hidden states positionally, or set "
            "quant.saved.checkpoint=keep"
        )
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # nothing would connect the layer's parameters to the loss (frozen embeddings)
        raise ValueError(
            "quant.saved.checkpoint: no positional argument of a checkpointed layer needs a "
            "gradient, so its parameters would get none; make the input require grad (PEFT: "
            "enable_input_require_grads()), or set quant.saved.checkpoint=keep"
        )
    # keyword arguments bound beforehand (transformers passes partial(forward, **kwargs)) too
    inner = inspect.unwrap(function)  # through `run_again_as_first`
    bound = dict(inner.keywords) if isinstance(inner, functools.partial) else {}
    needing = sorted(k for k, v in (bound | kwargs).items() if _needs_grad(v))
    needing += [f"positional {i}" for i, a in enumerate(args[1:], 1)
                if not isinstance(a, torch.Tensor) and _needs_grad(a)]  # fmt: skip
    if needing:
        raise ValueError(
            f"quant.saved.checkpoint: keyword argument(s) {needing} of a checkpointed layer need "
            "a gradient, which this checkpoint passes to positional arguments only; pass them "
            "positionally, or set quant.saved.checkpoint=keep"
        )
    run = functools.partial(function, **kwargs) if kwargs else function
    return _HeldInputCheckpoint.apply(run, fmt, *args)


def _drop(t: torch.Tensor) -> None:
    return None


def _dropped(_) -> torch.Tensor:
    raise RuntimeError("a checkpointed layer's first forward pass keeps no tensor for backward")


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detached(o) for o in out)
    return out


def _free_unless_kept(t: torch.Tensor, kept: set, others) -> None:
    """Give back ``t``'s memory, its shape and autograd graph left as they are, unless a saved
    tensor holds its storage (``kept``) or one of ``others`` shares it."""
    storage = t.untyped_storage()
    if storage.data_ptr() in kept or storage.nbytes() == 0:
        return
    if any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == storage.data_ptr()
           for o in others):  # fmt: skip
        return
    storage.resize_(0)


def _run_again(ctx, x, rest, *, skip: bool):
    """(the outputs, the storages the rules held as they are or None, the placeholders) of
    ``ctx.run`` run again on ``x`` and ``rest`` for the backward pass, as its first run ran: the
    random number generators' states, autocast, and a ``stash_scope=all`` model's rules. With
    ``skip``, a module may leave an output no backward reads uncomputed (`unread_outputs`)."""
    devices = [x.device] if x.is_cuda else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(recomputation())
        for kind, dtype in ctx.autocast:
            stack.enter_context(torch.autocast(kind, dtype))
        kept = None
        if ctx.stash_all is not None:
            kept = set()
            stack.enter_context(ctx.stash_all.recomputing(kept))
        placeholders = stack.enter_context(unread_outputs.outputs_unread()) if skip else None
        torch.set_rng_state(ctx.rng)
        if ctx.cuda_rng is not None:
            torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
        return ctx.run(x, *rest), kept, placeholders


class _HeldInputCheckpoint(torch.autograd.Function):
    """`held_input_checkpoint`. The forward pass runs ``run`` with every tensor it would save
    dropped (as ``torch.utils.checkpoint`` drops them: the DSQ layers still note their GEMMs and
    stash bytes) and keeps the first input packed; the backward pass unpacks it, runs ``run``
    again with the random number generators' states of the first run, and passes the outputs'
    gradients back through it."""

    @staticmethod
    def forward(ctx, run, fmt, x, *rest):
        # autocast as the first run had it, for the second (torch.utils.checkpoint does the same)
        kinds = {x.device.type, "cpu"}
        ctx.autocast = [
            (k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)
        ]
        packed = fmt.pack(x.detach(), -1)
        held = packed.unpack()
        ctx.header, payload = _stash_header(packed)
        for t in payload:  # already in its format: a stash_scope=all hook leaves it be
            t.dsq_held_as_is = True
        ctx.save_for_backward(*payload)
        # the other arguments as given (not through saved-tensor hooks, which could change
        # their values for the second run)
        ctx.run, ctx.rest = run, rest
        # a stash_scope=all model's rules, to hold what the second run saves as the forward
        # pass holds it (the first run saves nothing)
        ctx.stash_all = open_stash_all()
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        # (its outputs are read, also inside another layer's run again)
        with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped),
              unread_outputs.outputs_unread(False)):  # fmt: skip
            out = run(held, *rest)
        return _detached(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "a layer checkpointed with quant.saved.checkpoint runs its backward pass through "
                "loss.backward() only, not torch.autograd.grad or backward(inputs=...); set "
                "quant.saved.checkpoint=keep"
            )
        x = _stash_restore(ctx.header, ctx.saved_tensors).unpack().requires_grad_()
        rest = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in ctx.rest]  # fmt: skip
        out, kept, placeholders = _run_again(ctx, x, rest, skip=True)
        if placeholders:
            # an output left uncomputed (`unread_outputs`) whose value a backward would read:
            # the layer runs again with every output computed
            read = unread_outputs.readers(out if isinstance(out, tuple) else (out,), placeholders)
            if read:
                unread_outputs.stop_skipping(read, placeholders)
                del out, kept, placeholders
                out, kept, _ = _run_again(ctx, x, rest, skip=False)
        outs = out if isinstance(out, tuple) else (out,)
        if kept is not None:
            # each output's gradient, where autograd alone holds it, is handed to the run's graph
            # to be summed into in place (`_GradientTakenOver`)
            outs = list(outs)
            for i, o in enumerate(outs):
                g = grads[i] if i < len(grads) else None
                if (isinstance(o, torch.Tensor) and o.requires_grad
                        and _held_by_autograd_only(g, sys.getrefcount(g))):  # fmt: skip
                    with torch.enable_grad():
                        outs[i] = _GradientTakenOver.apply(o, g.data_ptr())
            # the input's and the outputs' values are read by no backward of the run (the rules
            # held none of their storages as they are): freed now, not after the run's backward
            for t in (x, *outs):
                if isinstance(t, torch.Tensor):
                    _free_unless_kept(t, kept, rest)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]  # fmt: skip
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        rest_grads = [a.grad if isinstance(a, torch.Tensor) else None for a in rest]
        return (None, None, x.grad, *rest_grads)


# Python references to a gradient that reaches `_HeldInputCheckpoint.backward` held by autograd
# alone, counted where the backward pass calls `_held_by_autograd_only`: the argument tuples and
# frames of the calls from autograd's engine down to it, by (Python, torch) version where it was
# counted. A hook that kept the gradient, or a second holder in autograd, adds one; a count that
# differs, or a version not counted, hands nothing on (one too few would take a shared gradient).
# (Tested, with a hook that keeps it.)
AUTOGRAD_ONLY_REFERENCES = {((3, 11), (2, 13)): 9}
_VERSIONS = (sys.version_info[:2], units.torch_version())
# the code of the calls the count is of, from the backward pass's caller up: `once_differentiable`'s
# wrapper, then autograd's `BackwardCFunction.apply`, which the engine calls. Another caller
# (compiled autograd, a call of one's own) may hold the gradient otherwise: nothing is handed on.
_COUNTED_CALLERS = (
    once_differentiable(lambda ctx: None).__code__,
    torch.autograd.function.BackwardCFunction.apply.__code__,
)


def _held_by_autograd_only(g, references: int) -> bool:
    """Whether ``g``, an output's gradient in the checkpoint's backward pass, is a plain dense
    tensor, no view, that nothing but autograd's engine holds (no hook kept it), so that its
    storage can be handed on. Its storage is not touched from Python here: a Python object of
    it, once made, stays as a holder of it for autograd, which then never sums into it in place.
    (Another tensor sharing the storage is left be: autograd sums out of place then.)"""
    if type(g) is not torch.Tensor or g.layout != torch.strided or g._base is not None:
        return False
    if not g.is_contiguous() or g.requires_grad:
        return False
    if references != AUTOGRAD_ONLY_REFERENCES.get(_VERSIONS):
        return False
    # and the count is of the calls it was counted on: the backward pass's callers are those
    # (this function's caller is the backward pass)
    callers = sys._getframe(2), sys._getframe(3)
    return all(frame.f_code is code for frame, code in zip(callers, _COUNTED_CALLERS))


class _GradientTakenOver(torch.autograd.Function):
    """The identity on an output of the layer run again, whose backward pass moves its incoming
    gradient's storage (the checkpoint's, held by autograd's engine until the checkpoint's
    backward pass returns, and read by nothing after it) to a tensor of its own, which it passes
    on. The first node to sum a gradient into it then holds the only reference and sums in place
    (autograd does so where it holds the last one), where it would otherwise allocate the sum
    beside the held gradient: in a residual layer the stream's gradient, a layer's width of
    float32 a token, for the whole of the layer's backward pass."""

    @staticmethod
    def forward(ctx, t, taken: int):
        ctx.taken = taken
        return t.view_as(t)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if g.data_ptr() != ctx.taken:  # autograd passed another tensor (a cast): nothing held
            return g, None
        # (set_ from the tensor: from its storage's Python object, autograd would count one
        # more holder of it and sum out of place)
        owned = g.new_empty((0,)).set_(g)
        g.set_()  # autograd's references now see an empty tensor, not the values
        return owned, None
