"""The chunked output layer and loss (dsq.engine.chunked_output) without gradients: a validation
under torch.no_grad runs each chunk forward only, with the same sums."""

from __future__ import annotations

import pytest
import torch

from dsq.engine.chunked_output import chunked_output_loss


def test_without_gradients_the_chunks_run_forward_only_with_the_same_sums(monkeypatch):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    features, target = torch.randn(37, 8), torch.randint(0, 11, (37,))

    def loss_fn(logits, t):
        summed = torch.nn.functional.cross_entropy(logits, t, reduction="sum")
        return summed, (logits.argmax(-1) == t).sum().float()

    with_grad = chunked_output_loss(features, head, loss_fn, target, list(head.parameters()), 16)

    def no_backward(*args, **kwargs):
        raise AssertionError("a chunk's backward pass ran under torch.no_grad")

    monkeypatch.setattr(torch.autograd, "grad", no_backward)
    with torch.no_grad():
        without = chunked_output_loss(features, head, loss_fn, target, list(head.parameters()), 16)
    assert len(without) == 2 and not any(t.requires_grad for t in without)
    for a, b in zip(without, with_grad):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        (empty,) = chunked_output_loss(features[:0], head, lambda x, t: x.sum(), target[:0],
                                       list(head.parameters()), 16)  # fmt: skip
    assert empty.item() == 0.0


def _head_and_batch(width=8):
    """A head of 11 classes, 37 tokens of ``width`` features needing a gradient, their targets
    and a summed cross-entropy."""
    torch.manual_seed(0)
    head = torch.nn.Linear(width, 11)
    features = torch.randn(37, width, requires_grad=True)
    target = torch.randint(0, 11, (37,))

    def loss_fn(logits, t):
        return torch.nn.functional.cross_entropy(logits, t, reduction="sum")

    return head, features, target, loss_fn


def test_an_incoming_gradient_other_than_one_scales_every_gradient():
    """The chunks' gradients are taken for a gradient of 1 on the summed loss and scaled by the
    one that reaches it (a loss divided by the token count, a loss scaler): equal, to float32
    rounding, to the whole layer's gradients of the same scaled loss."""
    head, features, target, loss_fn = _head_and_batch()
    (loss,) = chunked_output_loss(features, head, loss_fn, target, list(head.parameters()), 16)
    (loss * -2.5 / 37).backward()
    got = [features.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    features.grad = None
    head.zero_grad(set_to_none=True)
    (loss_fn(head(features), target) * -2.5 / 37).backward()
    want = [features.grad] + [p.grad for p in head.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert got[1].abs().sum() > 0


def test_the_chunks_gradients_are_freed_once_read_and_kept_under_retain_graph():
    """The features' and the head's gradients, made in the forward pass, are saved tensors:
    autograd frees them once the backward pass has read them (not at the end of the whole
    backward pass), and keeps them for a second one under ``retain_graph``. A stash_scope=all
    hook holds them as they are (they are gradients, not activations)."""
    head, features, target, loss_fn = _head_and_batch()
    (loss,) = chunked_output_loss(features, head, loss_fn, target, list(head.parameters()), 16)
    node = loss.grad_fn
    saved = node.saved_tensors
    assert len(saved) == 3 and all(t.dsq_held_as_is for t in saved)  # features, weight, bias
    loss.backward(retain_graph=True)
    first = features.grad.clone()
    loss.backward()
    torch.testing.assert_close(features.grad, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="freed"):
        node.saved_tensors  # noqa: B018


def test_a_stash_all_hook_holds_the_chunks_gradients_as_they_are():
    """stash_scope=all's saved-tensor hook, with every kind of saved tensor packed, leaves a
    gradient the chunks made (marked as held as it is) as it is, and packs the same tensor
    unmarked."""
    from dsq.engine import QuantConfig
    from dsq.engine.patch import stash_all_hooks

    head, features, target, loss_fn = _head_and_batch(width=64)
    (loss,) = chunked_output_loss(features, head, loss_fn, target, list(head.parameters()), 16)
    feature_grad = loss.grad_fn.saved_tensors[0]
    kinds = ("norm", "activation", "elementwise", "constant")
    cfg = QuantConfig(q1="bfp2", stash_scope="all", saved=dict.fromkeys(kinds, "bfp3"))
    pack = stash_all_hooks(cfg).pack_hook
    assert pack(feature_grad) is feature_grad
    assert pack(feature_grad.clone()) is not feature_grad
