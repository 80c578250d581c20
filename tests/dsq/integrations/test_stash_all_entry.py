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

        def counted_hooks(cfg):
            self.entered += 1
            return hooks(cfg)

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


def test_a_wrapper_and_accelerate_reach_the_hooks(monkeypatch):
    accelerate = pytest.importorskip("accelerate")

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


def test_the_trainers_step_packs(monkeypatch, tmp_path):
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
