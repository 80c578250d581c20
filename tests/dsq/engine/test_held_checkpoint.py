"""A checkpointed layer's input held in a format (docs/dsq.md, "What the backward pass holds"):
the layer computes on the held values in both of its runs, its gradients are those of the layer
run once on those values, and the backward pass keeps only the packed input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsq.engine import checkpointing
from dsq.engine.checkpointing import held_input_checkpoint
from dsq.formats import parse_format

BFP8 = parse_format("bfp8e8b16")


class Layer(nn.Module):
    """A residual block with dropout (random numbers the second run must draw again) and a
    second input needing a gradient, as a decoder layer's encoder output does."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.memory = nn.Linear(32, 32)

    def forward(self, x, memory=None, scale=1.0):
        h = nn.functional.dropout(torch.relu(self.up(x)), p=0.3, training=True)
        out = x + self.down(h) * scale
        return out if memory is None else out + self.memory(memory)


def grads(layer, *tensors):
    return [p.grad for p in layer.parameters() if p.grad is not None] + [t.grad for t in tensors]


@pytest.mark.parametrize("with_memory", [False, True])
def test_the_held_values_in_both_runs_and_the_gradients_of_one_run_on_them(with_memory):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 8, 32, requires_grad=True)
    memory = torch.randn(4, 8, 32, requires_grad=True) if with_memory else None
    extra = (memory,) if with_memory else ()
    dy = torch.randn(4, 8, 32)

    torch.manual_seed(1)
    out = held_input_checkpoint(BFP8, layer, x, *extra, scale=0.5)
    out.backward(dy)
    got = [g.clone() for g in grads(layer, x, *extra)]
    layer.zero_grad()

    # the reference: the layer run once on x's values in bfp8, its gradient passed to x as is
    held = BFP8.quantize(x.detach(), -1).requires_grad_()
    memory_ref = memory.detach().clone().requires_grad_() if with_memory else None
    torch.manual_seed(1)
    expected_out = layer(held, memory_ref, scale=0.5)
    expected_out.backward(dy)
    expected = grads(layer, held, *((memory_ref,) if with_memory else ()))

    assert not torch.equal(held, x)  # the held values differ from x: the test can tell
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_the_backward_pass_keeps_the_packed_input_and_no_activation():
    layer = Layer()
    x = torch.randn(4, 64, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = held_input_checkpoint(BFP8, layer, x)
    out.sum().backward()
    assert all(p.grad is not None for p in (*layer.up.parameters(), *layer.down.parameters()))
    held_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert held_bytes == BFP8.pack(x.detach(), -1).nbytes  # about a byte a value: x is 4
    assert held_bytes < x.numel() * 4 / 3


def test_a_keyword_argument_needing_a_gradient_is_refused():
    layer = Layer()
    x = torch.randn(2, 3, 32, requires_grad=True)
    memory = torch.randn(2, 3, 32, requires_grad=True)
    with pytest.raises(ValueError, match=r"keyword argument\(s\) \['memory'\].*positionally"):
        held_input_checkpoint(BFP8, layer, x, memory=memory)


def test_a_layer_without_a_positional_tensor_is_refused():
    with pytest.raises(ValueError, match="first positional argument.*NoneType"):
        held_input_checkpoint(BFP8, Layer(), x=torch.randn(2, 32))


def test_checkpoint_layers_holds_each_input_by_the_rule():
    """`checkpoint_layers` (fairseq's ``train.activation_checkpointing``) under a config whose
    ``quant.saved.checkpoint`` is bfp8: each layer's output is the layer's on its input in
    bfp8; with the rule ``keep`` (the default), on its input as it is."""
    from dsq.engine import QuantConfig
    from dsq.engine.checkpointing import checkpoint_layers

    x = torch.randn(2, 16, 32, requires_grad=True)
    for rule, held in (("bfp8", BFP8.quantize(x.detach(), -1)), ("keep", x.detach())):
        torch.manual_seed(0)
        layer = Layer()
        cfg = QuantConfig(stash_scope="all", saved={"checkpoint": rule})
        assert checkpoint_layers([layer], cfg) == 1
        torch.manual_seed(1)
        got = layer(x)
        layer.forward = Layer.forward.__get__(layer)  # the layer as it was
        torch.manual_seed(1)
        torch.testing.assert_close(got, layer(held), rtol=0, atol=0)


def test_a_bound_keyword_or_no_input_needing_a_gradient_is_refused():
    """transformers passes ``partial(forward, **kwargs)``: a bound keyword tensor needing a
    gradient is refused as a keyword argument is; so is a layer none of whose positional
    inputs needs a gradient (its parameters would get none)."""
    import functools

    layer = Layer()
    x = torch.randn(2, 3, 32, requires_grad=True)
    memory = torch.randn(2, 3, 32, requires_grad=True)
    with pytest.raises(ValueError, match=r"\['memory'\]"):
        held_input_checkpoint(BFP8, functools.partial(layer, memory=memory), x)
    with pytest.raises(ValueError, match="no positional argument .* needs a gradient"):
        held_input_checkpoint(BFP8, layer, x.detach())


def test_the_second_run_is_under_the_first_runs_autocast():
    """Under bf16 autocast the gradients are those of one run on the held values under it."""
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 8, 32, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        torch.manual_seed(1)
        out = held_input_checkpoint(BFP8, layer, x)
    out.float().sum().backward()
    got = [g.clone() for g in grads(layer, x)]
    layer.zero_grad()
    held = BFP8.quantize(x.detach(), -1).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        torch.manual_seed(1)
        expected_out = layer(held)
    expected_out.float().sum().backward()
    for a, e in zip(got, grads(layer, held)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_autograd_grad_through_the_checkpoint_is_refused():
    x = torch.randn(2, 4, 32, requires_grad=True)
    out = held_input_checkpoint(BFP8, Layer(), x)
    with pytest.raises(RuntimeError, match="through loss.backward"):
        torch.autograd.grad(out.sum(), x)


def test_a_q1_rule_follows_the_stash_schedule(monkeypatch):
    from dsq.engine import QuantConfig, checkpointing

    seen = []
    real = checkpointing.held_input_checkpoint

    def spy(fmt, *args, **kwargs):
        seen.append(fmt.spec)
        return real(fmt, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "held_input_checkpoint", spy)
    cfg = QuantConfig(q1={"levels": ["bfp2", "bfp8"], "patience": 1}, stash_scope="all",
                      saved={"checkpoint": "q1"})  # fmt: skip
    layer = Layer()
    checkpointing.checkpoint_layers([layer], cfg)
    x = torch.randn(2, 4, 32, requires_grad=True)
    layer(x).sum().backward()
    cfg.step(1.0)
    cfg.step(1.0)  # a stall: q1 rises to bfp8
    layer(x).sum().backward()
    assert seen == ["bfp2e8b16", "bfp8e8b16"]


class Recording(nn.Module):
    """`Layer` under a model's stash_scope=all hooks, noting the input and output of each run."""

    def __init__(self):
        super().__init__()
        self.layer, self.runs = Layer(), []

    def forward(self, x):
        def run(held):
            out = self.layer(held)
            self.runs.append((held, out))
            return out

        return held_input_checkpoint(BFP8, run, x)


@pytest.mark.parametrize("elementwise", ["bfp8e8b16", "keep"])
def test_the_run_again_gives_back_its_input_and_output_unless_a_rule_holds_them(
    elementwise, monkeypatch
):
    """Under the stash_scope=all rules the run again's input and output are read by no backward
    (the linear layer's input is packed, the sum saves nothing), so their memory is given back
    before the run's backward pass; where a rule holds the input as it is (``keep``), it stays.
    The gradients are those of the run that gives back nothing, bit for bit."""
    from dsq.engine import QuantConfig
    from dsq.engine.patch import enter_stash_all_on_call

    cfg = QuantConfig(q0="fp32", q1="bfp8", q2="fp32", q3="fp32", stash_scope="all",
                      saved={"elementwise": elementwise})  # fmt: skip
    results = []
    for give_back in (True, False):
        if not give_back:
            monkeypatch.setattr(checkpointing, "_free_unless_kept", lambda *_: None)
        torch.manual_seed(0)
        model = Recording()
        enter_stash_all_on_call(model, cfg)
        x = torch.randn(4, 64, 32, requires_grad=True)
        torch.manual_seed(1)
        model(x).backward(torch.randn(4, 64, 32))
        results.append((model.runs, grads(model.layer, x)))
    (runs, got), (_, expected) = results
    assert len(runs) == 2  # the forward pass and the run again
    held, out = runs[1]
    freed = [t.untyped_storage().nbytes() == 0 for t in (held, out)]
    assert freed == ([True, True] if elementwise != "keep" else [False, True])
    assert runs[0][1].untyped_storage().nbytes() > 0  # the forward pass's output is the caller's
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


class Followed(nn.Module):
    """`Layer` checkpointed with its input held, then a norm, under a model's stash_scope=all
    hooks; notes where the layer's incoming gradient and its input's gradient lie."""

    def __init__(self, keep_incoming=False):
        super().__init__()
        self.layer, self.seen, self.kept = Layer(), {}, []
        self.keep_incoming = keep_incoming

    def forward(self, x):
        def run(held):
            if held.requires_grad:  # the run again
                held.register_hook(lambda g: self.seen.__setitem__("input", g.data_ptr()))
            return self.layer(held)

        out = held_input_checkpoint(BFP8, run, x)

        def incoming(g):
            self.seen["incoming"] = g.data_ptr()
            if self.keep_incoming:
                self.kept.append(g)

        out.register_hook(incoming)
        return nn.functional.layer_norm(out, (32,))


@pytest.mark.parametrize("keep_incoming", [False, True, "uncounted version", "uncounted caller"])
def test_the_layers_gradients_are_summed_into_its_incoming_gradient_unless_a_hook_kept_it(
    keep_incoming, monkeypatch
):
    """The checkpoint's incoming gradient, which autograd holds until the checkpoint's backward
    pass returns, is handed to the layer run again: the residual sums go into its memory, and
    the input's gradient lies there. A gradient a hook kept is not taken (its values stay), nor
    one whose count of references was not counted on this version or these callers. The
    gradients are those of the run that takes nothing, bit for bit."""
    from dsq.engine import QuantConfig
    from dsq.engine.patch import enter_stash_all_on_call

    cfg = QuantConfig(q0="fp32", q1="bfp8", q2="fp32", q3="fp32", stash_scope="all")
    if keep_incoming == "uncounted version":  # a Python or torch whose count is not known
        monkeypatch.setattr(checkpointing, "AUTOGRAD_ONLY_REFERENCES", {})
    if keep_incoming == "uncounted caller":  # called otherwise than by autograd's engine
        monkeypatch.setattr(checkpointing, "_COUNTED_CALLERS", (grads.__code__,) * 2)
    results = []
    for take in (True, False):
        if not take:
            monkeypatch.setattr(checkpointing, "_held_by_autograd_only", lambda *_: False)
        torch.manual_seed(0)
        model = Followed(keep_incoming is True)
        enter_stash_all_on_call(model, cfg)
        x = torch.randn(4, 64, 32, requires_grad=True)
        torch.manual_seed(1)
        model(x).backward(torch.randn(4, 64, 32))
        results.append((model.seen, [t.clone() for t in model.kept], grads(model.layer, x)))
    (seen, kept, got), (seen_without, kept_without, expected) = results
    assert (seen["input"] == seen["incoming"]) == (keep_incoming is False)
    assert seen_without["input"] != seen_without["incoming"]
    for a, e in zip(got + kept, expected + kept_without, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


class SlicedMLPLayer(nn.Module):
    """A residual layer whose MLP runs in slices, ending as ``how`` says: ``unread``, its output
    summed into the stream and the sum returned (a Llama layer's end, read by no backward);
    ``added-in-place``, the stream added into the output in place; ``read``, the sum normed
    (the norm saves it); ``scaled-in-place``, the output multiplied in place by a tensor (the
    product's backward reads it); ``detached``, the norm of the stream plus the output taken out
    of the graph; ``nested``, the layer checkpointed again inside (the inner checkpoint's first
    run inside the outer one's run again, whose output is read)."""

    def __init__(self, how: str):
        super().__init__()
        from dsq.engine import QuantConfig

        self.how = how
        self.cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16")
        self.gate, self.up = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)
        # the inner checkpoint's argument needing a gradient; a scale of the output
        self.shift = nn.Parameter(torch.randn(32))

    def mlp(self, x):
        from dsq.engine.sliced_mlp import sliced_swiglu

        weights = (self.gate.weight, self.up.weight, self.down.weight)
        return sliced_swiglu(x, *weights, None, None, None, self.cfg)

    def mlp_block(self, x, shift=None):
        out = x + self.mlp(x)
        return out if shift is None else out + shift

    def forward(self, x):
        if self.how == "nested":
            return held_input_checkpoint(BFP8, self.mlp_block, x, self.shift) * 2
        if self.how == "added-in-place":
            m = self.mlp(x)
            m += x
            return m
        if self.how == "scaled-in-place":
            m = self.mlp(x)
            m.mul_(self.shift)
            return x + m
        if self.how == "detached":
            return nn.functional.layer_norm(x + self.mlp(x).detach(), (32,)) + x
        out = self.mlp_block(x)
        return nn.functional.layer_norm(out, (32,)) if self.how == "read" else out


class StashAll(nn.Module):
    """``layer`` checkpointed with its input held, under a model's stash_scope=all hooks (the
    run again's rules, its outputs given back and its incoming gradient handed on)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return held_input_checkpoint(BFP8, self.layer, x)


HOW = {  # what each layer's run again does: (a placeholder made, what the warning names)
    "unread": ([True], None),
    # an op in place on the output (a view of the function's): autograd's CopySlices, which
    # the check does not look into, counts as a reader
    "added-in-place": ([True, False], "CopySlices"),
    "read": ([True, False], "NativeLayerNormBackward0"),
    "scaled-in-place": ([True, False], "CopySlices"),
    "detached": ([True, False], "do not reach"),
    "nested": ([False, True], None),  # the inner first run computes, its run again skips
}


@pytest.mark.parametrize("stash_all", [False, True])
@pytest.mark.parametrize("how", list(HOW))
def test_an_mlp_output_no_backward_reads_is_not_computed_in_the_run_again(
    how, stash_all, monkeypatch, caplog
):
    """In the run again, an MLP in slices whose output only sums into the layer's output
    returns a placeholder and runs none of its forward GEMMs; where a backward reads the value
    (a norm after the sum), may read it (an op in place on it) or the outputs do not reach it
    (a detached copy), the layer runs again with the output computed, says so once, and that
    MLP computes its output in every later run again (another MLP still skips); a checkpoint's
    first run inside another's run again computes its outputs. The gradients are those of the
    run that skips nothing, bit for bit, with and without a model's stash_scope=all hooks."""
    from dsq.engine import QuantConfig, unread_outputs
    from dsq.engine.patch import enter_stash_all_on_call
    from dsq.warn_once import warn_once

    made, skipping = [], {"now": True}
    real = unread_outputs.placeholder

    def spy(*args):
        out = real(*args) if skipping["now"] else None  # the reference: every output computed
        made.append(out is not None)
        return out

    monkeypatch.setattr(unread_outputs, "placeholder", spy)
    results = []
    for skip in (True, False):
        warn_once.cache_clear()
        caplog.clear()
        skipping["now"] = skip
        torch.manual_seed(0)
        layer = SlicedMLPLayer(how)
        model = StashAll(layer)
        if stash_all:
            cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all")
            enter_stash_all_on_call(model, cfg)
        x = torch.randn(2, 64, 32, requires_grad=True)
        out = model(x)
        out.backward(torch.randn(2, 64, 32))
        said = [r.message for r in caplog.records if "reads its MLP's output" in r.message]
        marked = unread_outputs.read_in_a_run_again(layer.gate.weight)
        results.append((out.detach(), grads(layer, x), marked, said))
        if skip:
            placeholders, made[:], first = list(made), [], layer
    (out, got, marked, said), (expected_out, expected, _, _) = results
    run_again, reader = HOW[how]
    # the first run makes none (a nested layer: the inner first runs, in both outer runs)
    assert placeholders == [False] + run_again
    assert marked == (reader is not None)
    assert (len(said) == 1 and reader in said[0]) if reader else not said
    assert not any(made)  # with skipping off, every output computed
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    # the mark is that MLP's: another layer's run again still skips, the marked one does not
    skipping["now"] = True
    for other, skips in ((SlicedMLPLayer("unread"), True), (first, reader is None)):
        made.clear()
        x = torch.randn(2, 64, 32, requires_grad=True)
        held_input_checkpoint(BFP8, other, x).sum().backward()
        assert any(made) == skips
