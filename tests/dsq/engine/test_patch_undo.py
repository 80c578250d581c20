"""What a patched model's undo record promises (docs/hf.md, "Undoing"): a refused patch leaves the
model as it came, a copy of a patched model (``copy.deepcopy``) is undone on its own, and a
patched model pickles whole (``torch.save``) and computes the same after loading."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import dsq
from dsq.engine import QuantConfig
from dsq.engine.patch import DSQLinear
from dsq.integrations import quantize_model

ALL = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all")


class Linear2(nn.Linear):
    """A Linear subclass: patched into a DSQ subclass made at run time."""


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.0), Linear2(64, 32))


def state_of(model: nn.Module) -> list:
    """Each module's class, hooks and dsq attributes: what patching changes."""
    return [
        (type(m), len(m._forward_pre_hooks), len(m._forward_hooks),
         sorted(k for k in vars(m) if k.startswith("dsq_")))
        for m in model.modules()
    ]  # fmt: skip


def step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    out = model(x)
    (out**2).mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


def test_a_refused_patch_leaves_the_model_as_it_came():
    """strict=True refuses a model with a GEMM dsq does not know after the walk patched its
    Linear layers: every one of them is put back."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Conv1d(8, 8, 1), nn.ReLU())
    before = state_of(model)
    with pytest.raises(ValueError, match="strict=True"):
        quantize_model(model, ALL, strict=True)
    assert state_of(model) == before
    quantize_model(model, ALL)  # and it can be patched
    assert isinstance(model[0], DSQLinear)


def test_a_copy_of_a_patched_model_is_undone_on_its_own():
    model = quantize_model(mlp(), ALL)
    patched = state_of(model)
    twin = copy.deepcopy(model)
    dsq.unpatch(twin)
    assert state_of(model) == patched
    assert state_of(twin) == state_of(mlp())
    want = step(model)
    twin_again = quantize_model(twin, ALL)
    got = step(twin_again)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [ALL, QuantConfig.from_preset("dsq")], ids=["all", "gemm"])
def test_a_patched_model_pickles_whole_and_computes_the_same(cfg):
    model = quantize_model(mlp(), cfg)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    want, got = step(model), step(loaded)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dsq.unpatch(loaded)
    assert state_of(loaded) == state_of(mlp())
