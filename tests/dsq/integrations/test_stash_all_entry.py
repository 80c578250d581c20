"""``stash_scope="all"`` holds whichever module of a patched model is called (docs/dsq.md,
"stash_scope"): the whole model, an inner module (``model.model(...)`` for a loss of one's own),
a wrapper around it, the model prepared by ``accelerate``, and the ``transformers.Trainer``'s
step. A spy counts the activations packed and the times the hooks are entered."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dsq.engine import QuantConfig
from dsq.engine import patch as patch_module
from dsq.engine.patch import open_stash_all
from dsq.integrations import quantize_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

ALL = QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", stash_scope="all")


class Spy:
    """Counts the saved tensors packed and the hooks entered."""

    def __init__(self, monkeypatch):
        self.packed = self.entered = 0
        packed_save, hooks = patch_module._PackedSave, patch_module.stash_all_hooks

        spy = self

        class CountedSave(packed_save):
            __slots__ = ()

            def __init__(self, *args):
                spy.packed += 1
                super().__init__(*args)

        def counted_hooks(*args):
            self.entered += 1
            return hooks(*args)

        monkeypatch.setattr(patch_module, "_PackedSave", CountedSave)
        monkeypatch.setattr(patch_module, "stash_all_hooks", counted_hooks)


def llama(cfg=ALL) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, attn_implementation="sdpa",
    )  # fmt: skip
    return quantize_model(transformers.LlamaForCausalLM(config), cfg)


IDS = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))


def test_the_whole_model_packs_once_per_call(monkeypatch):
    spy = Spy(monkeypatch)
    model = llama()
    model(IDS, labels=IDS).loss.backward()
    assert spy.entered == 1 and spy.packed > 0


def test_an_inner_module_called_alone_packs_as_the_whole_model_does(monkeypatch):
    """A loss of one's own on the body's hidden states: the body's activations are packed as when
    the whole model runs (whose head is a DSQ layer, its input held by its own stash, and whose
    ``logits.sum()`` saves nothing)."""
    spy = Spy(monkeypatch)
    model = llama()
    model(IDS).logits.sum().backward()
    whole = spy.packed
    spy.packed = spy.entered = 0
    hidden = model.model(IDS).last_hidden_state
    (hidden**2).mean().backward()
    assert spy.entered == 1
    assert spy.packed == whole > 0


def test_nothing_is_packed_under_stash_scope_gemm(monkeypatch):
    spy = Spy(monkeypatch)
    model = llama(QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16"))
    model.model(IDS).last_hidden_state.sum().backward()
    assert spy.entered == 0 and spy.packed == 0


def test_a_wrapper_and_accelerate_reach_the_hooks(monkeypatch, fresh_accelerate):
    accelerate = fresh_accelerate

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids).logits

    spy = Spy(monkeypatch)
    Wrapper(llama())(IDS).sum().backward()
    assert spy.entered == 1 and spy.packed > 0
    spy.packed = spy.entered = 0
    prepared = accelerate.Accelerator(cpu=True).prepare(llama())
    prepared(IDS).logits.sum().backward()
    assert spy.entered == 1 and spy.packed > 0


def test_the_trainers_step_packs(monkeypatch, tmp_path, fresh_accelerate):
    spy = Spy(monkeypatch)
    model = llama()
    data = [{"input_ids": IDS[i], "labels": IDS[i]} for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert spy.entered >= 1 and spy.packed > 0


def gradients(model) -> list[torch.Tensor]:
    model.train()
    model.zero_grad()
    model(IDS, labels=IDS).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_run_again_by_the_models_checkpointing_holds_by_the_rules(monkeypatch, reentrant):
    """The model's gradient checkpointing runs each layer again in the backward pass: what that
    run saves is held by the ``stash_scope=all`` rules as the forward pass holds it without
    checkpointing (the values handed to the checkpoint's own hooks, non-reentrant, or packed,
    reentrant), so every gradient is the same bits with checkpointing and without."""
    without = gradients(llama())
    spy = Spy(monkeypatch)
    checkpointed = llama()
    checkpointed.gradient_checkpointing_enable({"use_reentrant": reentrant})
    got = gradients(checkpointed)
    assert spy.packed > 0 and not hooks_pushed()
    for a, b in zip(got, without, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_layers_runs_a_layer_again_under_the_rules_across_its_whole_forward():
    """fairseq's ``train.activation_checkpointing`` (`checkpoint_layers`) wraps a layer's
    ``forward``, so the layer's own call is not seen again: the rules still hold what its forward
    saves between its submodules (here a SiLU and a product in the layer's own code), and every
    gradient is the same bits as without checkpointing."""
    from dsq.engine.checkpointing import checkpoint_layers

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up = nn.LayerNorm(32), nn.Linear(32, 64)
            self.gate, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = self.norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    def run(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = quantize_model(nn.Sequential(Layer(), Layer()), ALL)
        if checkpointed:
            assert checkpoint_layers(list(model), ALL) == 2
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
        (model(x) ** 2).mean().backward()
        assert not hooks_pushed()
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_of_the_users_own_is_warned_of(caplog):
    """A checkpoint dsq does not wrap (``torch.utils.checkpoint`` called in a user's module) runs
    a layer again without the rules: the step's gradients then differ from one without
    checkpointing, and a warning says so and names the fix."""
    from torch.utils.checkpoint import checkpoint

    from dsq.warn_once import warn_once

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.SiLU())
                                        for _ in range(2))  # fmt: skip

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    warn_once.cache_clear()
    model = quantize_model(Body(), ALL)
    with caplog.at_level("WARNING", logger="dsq.engine.patch"):
        model(torch.randn(2, 8, 32, requires_grad=True)).sum().backward()
    assert "checkpoint_as_first_run" in caplog.text and not hooks_pushed()


def hooks_pushed() -> bool:
    """Whether saved-tensor hooks are pushed on this thread (torch keeps one stack a thread)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_two_threads_in_the_model_at_once_each_pack_their_own(monkeypatch):
    """nn.DataParallel runs its replicas' forwards on threads of their own: each thread's call
    enters the hooks on its own thread, and leaves none pushed."""
    import threading

    model = llama()
    spy = Spy(monkeypatch)
    model(IDS, labels=IDS).loss.backward()
    alone = spy.packed
    spy.packed = spy.entered = 0
    both_inside = threading.Barrier(2, timeout=60)

    def meet(module, args):  # both threads inside the model's call before either goes on
        both_inside.wait()

    model.model.layers[1].register_forward_pre_hook(meet)
    errors, left_pushed = [], []

    def train():
        try:
            model(IDS, labels=IDS).loss.backward()
            left_pushed.append(hooks_pushed())
        except BaseException as err:  # reported below, from the test's thread
            errors.append(err)

    threads = [threading.Thread(target=train) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert spy.entered == 2 and spy.packed == 2 * alone
    assert left_pushed == [False, False]


class Interrupt:
    """A forward pre-hook raising KeyboardInterrupt once (Ctrl-C in the middle of a forward)."""

    def __init__(self):
        self.armed = True

    def __call__(self, module, args):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_a_forward_interrupted_by_ctrl_c_leaves_no_hooks_behind(monkeypatch):
    """KeyboardInterrupt skips the forward hooks that would leave the stash context: the next
    call of the model closes it and opens its own, and unpatching closes a context left open."""
    import dsq

    model = llama()
    spy = Spy(monkeypatch)
    model(IDS, labels=IDS).loss.backward()
    alone = spy.packed
    model.model.layers[1].register_forward_pre_hook(Interrupt())
    spy.packed = spy.entered = 0
    with pytest.raises(KeyboardInterrupt):
        model(IDS, labels=IDS)
    assert hooks_pushed()  # what the interrupted call left
    spy.packed = 0
    model(IDS, labels=IDS).loss.backward()
    assert spy.packed == alone and spy.entered == 2
    assert not hooks_pushed()
    model.model.layers[0].register_forward_pre_hook(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        model(IDS, labels=IDS)
    dsq.unpatch(model)
    assert not hooks_pushed()


def test_after_ctrl_c_a_call_of_an_inner_module_closes_the_open_context(monkeypatch):
    model = llama()
    spy = Spy(monkeypatch)
    model.model(IDS).last_hidden_state.sum().backward()
    alone = spy.packed
    model.model.layers[1].register_forward_pre_hook(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        model(IDS, labels=IDS)
    spy.packed = spy.entered = 0
    model.model(IDS).last_hidden_state.sum().backward()
    assert spy.packed == alone and spy.entered == 1
    assert not hooks_pushed()


def test_a_forward_that_raises_leaves_no_hooks_and_a_later_backward_is_exact(monkeypatch):
    """An exception inside a layer's forward (not Ctrl-C: the forward hooks run) closes the
    stash context at once: nothing stays pushed, and an unrelated computation afterwards saves
    its tensors as autograd does, its gradient exact."""

    def fail(module, args, output):
        raise RuntimeError("a layer failed")

    model = llama()
    spy = Spy(monkeypatch)
    handle = model.model.layers[1].mlp.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="a layer failed"):
        model(IDS, labels=IDS)
    handle.remove()
    assert not hooks_pushed() and open_stash_all() is None
    spy.packed = 0
    x = torch.randn(8, 64, requires_grad=True)
    (torch.sin(x) * x).sum().backward()  # saves x and sin(x), rows of 64: packed were hooks on
    assert spy.packed == 0
    assert torch.equal(x.grad, torch.cos(x.detach()) * x.detach() + torch.sin(x.detach()))
