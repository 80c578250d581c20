"""ReLU and dropout masks held as bits (dsq/engine/masks.py): the same values, gradients and
random numbers as torch's own, a 32x smaller saved mask, and a patched fairseq model whose loss
and gradients do not change by a bit; stash_scope=all leaves per-row statistics unpacked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsq.engine import QuantConfig
from dsq.engine.masks import dsq_dropout, dsq_relu, pack_bits, unpack_bits


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (3, 5, 17), (64, 1024)])
def test_bits_round_trip_and_take_an_eighth(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.3
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-mask.numel() // 8)
    assert torch.equal(unpack_bits(packed, mask.shape), mask)
    # bit i % 8 of byte i // 8
    flat = mask.reshape(-1)
    for i in {0, min(1, flat.numel() - 1), flat.numel() - 1}:
        assert bool((packed[i // 8] >> (i % 8)) & 1) == bool(flat[i])


def _saved_bytes(fn, x):
    """Bytes autograd saves while ``fn(x)`` runs (every saved tensor once)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_is_f_dropout_bit_for_bit_and_saves_a_bit_a_value(dtype):
    x = torch.randn(96, 33, dtype=dtype).requires_grad_()
    ours = x.detach().clone().requires_grad_()
    grad = torch.randn(96, 33, dtype=dtype)
    torch.manual_seed(3)
    expected = nn.functional.dropout(x, 0.1, True)
    after_theirs = torch.rand(4)
    torch.manual_seed(3)
    got = dsq_dropout(ours, 0.1, True)
    assert torch.equal(torch.rand(4), after_theirs)  # the same random numbers drawn
    expected.backward(grad)
    got.backward(grad)
    assert torch.equal(got, expected) and torch.equal(ours.grad, x.grad)
    assert _saved_bytes(lambda t: dsq_dropout(t, 0.1, True), ours) == -(-96 * 33 // 8)
    # where no mask is kept, it is F.dropout itself
    assert torch.equal(dsq_dropout(x, 0.1, training=False), x)
    assert torch.equal(dsq_dropout(x, 0.0, True), x)


def test_relu_is_torch_relu_bit_for_bit_and_saves_a_bit_a_value():
    x = torch.randn(64, 40)
    x[0, :5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])
    x.requires_grad_()
    ours = x.detach().clone().requires_grad_()
    grad = torch.randn(64, 40)
    torch.relu(x).backward(grad)
    y = dsq_relu(ours)
    y.backward(grad)
    assert torch.allclose(y, torch.relu(x.detach()), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(ours.grad, x.grad)
    assert _saved_bytes(dsq_relu, ours) == 64 * 40 // 8


def _fairseq_step(preset: dict, with_masks: bool):
    from dsq.engine.patch import patch_model
    from dsq.integrations import fairseq as fairseq_integration
    from dsq.integrations import patchers_for
    from dsq_cli.bench.step import Batch, build_model

    model = build_model(2, 128, 500)
    patchers = patchers_for(model)
    if not with_masks:
        patchers = [p for p in patchers if not isinstance(p, fairseq_integration.MaskPatcher)]
    patch_model(model, QuantConfig(**preset), patchers)
    assert bool(model.dsq_report.masks) == with_masks
    model.train()
    batch = Batch.random(8, 16, 500, torch.device("cpu"))
    torch.manual_seed(5)
    logits, _ = model(batch.src, batch.lengths, batch.prev)
    loss = nn.functional.cross_entropy(logits.reshape(-1, 500), batch.target.reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "preset",
    [{}, {"q0": "bfp8", "q1": "bfp2", "q2": "bfp8", "q3": "fixed16"}],
    ids=["fp32", "dsq"],
)
def test_a_patched_fairseq_model_trains_the_same_with_masks_as_bits(preset):
    pytest.importorskip("fairseq")
    loss, grads = _fairseq_step(preset, with_masks=True)
    loss_without, grads_without = _fairseq_step(preset, with_masks=False)
    assert torch.equal(loss, loss_without)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_without))


def test_patch_model_reclasses_relu_and_dropout_modules():
    from dsq.integrations import quantize_model

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 8))
    quantize_model(model, QuantConfig())
    assert model.dsq_report.masks == ["1", "2"]
    assert "masks held as bits in 2" in model.dsq_report.summary()
    assert isinstance(model[1], nn.ReLU) and isinstance(model[2], nn.Dropout)
