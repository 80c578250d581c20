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


def test_a_checkpointed_layer_run_again_in_the_backward_pass_enters_nothing(monkeypatch):
    """The checkpoint's own hooks hold the recomputation: the layers' hooks, called again there,
    enter nothing (a pack there would take the recomputed tensors from the checkpoint, which
    would fail), and every parameter gets its gradient."""
    spy = Spy(monkeypatch)
    checkpointed = llama()
    checkpointed.gradient_checkpointing_enable({"use_reentrant": False})
    checkpointed.train()
    checkpointed(IDS, labels=IDS).loss.backward()
    assert spy.entered == 1
    assert all(p.grad is not None for p in checkpointed.parameters())


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
