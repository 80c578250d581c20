"""The output layer and its loss, computed and differentiated a chunk of tokens at a time
(docs/dsq.md, "What the backward pass holds").

A translation model's output layer maps each token's features ``[N, D]`` to logits over the
vocabulary ``[N, V]``; the loss then takes their log-softmax. With V in the thousands these are
the largest tensors of a step: the logits, the log-softmax autograd saves, and its gradient, each
``N x V`` floats (for V = 8,000, 94 of the 242 KiB a token of the bench transformer in float32).
No stash format touches them.

`chunked_output_loss` never holds more than one chunk of them. For each chunk of
``chunk_tokens`` tokens it runs the head and the loss forward and backward at once
(``torch.autograd.grad`` inside the forward pass), keeps the gradient of the chunk's features and
adds the head's parameter gradients, and drops the chunk's logits. The backward pass then only
scales what was kept by the incoming gradient. The head runs as it is, so a DSQ-patched head
quantizes each chunk as its layer does, and ``torch.autocast`` applies as outside.

The values are the unchunked ones up to float32 summation order: the loss is a sum of the
chunks' sums, and the head's weight gradient a sum over chunks of ``g^T x``. Quantizers with
blocks along the tokens (the stash, ``q3``) see the same blocks when ``chunk_tokens`` is a
multiple of the block (16). Stochastic rounding draws its noise in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# A chunk of 1,024 tokens holds its logits, log-softmax and gradient in 3 x 1024 x V floats: 94
# MiB at V = 8,000, against 2 GiB for 7,000 tokens unchunked; its GEMMs stay large enough to run
# at the unit's rate.
DEFAULT_CHUNK_TOKENS = 1024


def _add_chunk(total, stats, out):
    """The running (loss, further sums) with a chunk's ``loss_fn`` output added, detached."""
    loss, *more = out if isinstance(out, tuple) else (out,)
    loss, more = loss.detach(), [m.detach() for m in more]
    total = loss if total is None else total + loss
    return total, (more if stats is None else [a + b for a, b in zip(stats, more)])


class _ChunkedOutputLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, head, loss_fn, target, chunk_tokens, params_count, *rest):
        params, extra_inputs = rest[:params_count], rest[params_count:]
        wanted = [p for p in params if p.requires_grad]
        feature_grad = torch.zeros_like(features) if features.requires_grad else None
        param_grads = [torch.zeros_like(p) for p in wanted]
        total, stats = None, None
        with torch.enable_grad():
            for start in range(0, features.shape[0], chunk_tokens):
                chunk = features[start : start + chunk_tokens].detach()
                chunk.requires_grad_(feature_grad is not None)
                out = loss_fn(head(chunk), target[start : start + chunk_tokens], *extra_inputs)
                loss = out[0] if isinstance(out, tuple) else out
                inputs = ([chunk] if feature_grad is not None else []) + wanted
                grads = torch.autograd.grad(loss, inputs, allow_unused=True) if inputs else ()
                if feature_grad is not None:
                    feature_grad[start : start + chunk_tokens] = grads[0]
                    grads = grads[1:]
                for acc, grad in zip(param_grads, grads):
                    if grad is not None:
                        acc += grad
                total, stats = _add_chunk(total, stats, out)
        ctx.wanted = [p.requires_grad for p in params]
        ctx.feature_grad = feature_grad is not None
        ctx.params_count = params_count
        ctx.extra_count = len(extra_inputs)
        # gradients, not activations: marked so that stash_scope="all"'s saved-tensor hook
        # holds them as they are, and saved so that autograd frees them once the backward pass
        # has read them (on ctx they stayed alive through the whole backward pass of the body)
        grads = ([feature_grad] if feature_grad is not None else []) + param_grads
        for grad in grads:
            grad.dsq_held_as_is = True
        ctx.save_for_backward(*grads)
        if total is None:  # no token: an empty sum
            total = features.new_zeros(())
        ctx.mark_non_differentiable(*(stats or []))
        return (total, *(stats or []))

    @staticmethod
    def backward(ctx, grad_total, *grad_stats):
        saved = list(ctx.saved_tensors)
        feature_grad = saved.pop(0) * grad_total if ctx.feature_grad else None
        param_grads = iter(saved)
        params = [next(param_grads) * grad_total if w else None for w in ctx.wanted]
        return (feature_grad, None, None, None, None, None, *params,
                *([None] * ctx.extra_count))  # fmt: skip


def chunked_output_loss(
    features: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    target: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    extra_inputs: Sequence = (),
) -> tuple[torch.Tensor, ...]:
    """``loss_fn(head(features), target)`` summed over chunks of ``chunk_tokens`` rows.

    ``features`` ``[N, D]`` and ``target`` ``[N]`` are flattened over the tokens; ``head`` maps
    ``[n, D]`` to logits ``[n, V]``; ``loss_fn(logits, target, *extra_inputs)`` returns a summed
    loss, or a tuple of it and further sums to report (an NLL beside a smoothed loss), which are
    returned without gradients. ``params`` are the head's parameters (its weight, tied to an
    embedding or not, and bias): their gradients are added to whatever else reaches them.
    Returns ``(loss, *further sums)``. ``chunk_tokens`` of 0 or at least N: one chunk. With
    gradients disabled (a validation under ``torch.no_grad``) the chunks run forward only.
    The gradients made in the forward pass are saved tensors, so saved-tensor hooks see them:
    inside a checkpointed region (``torch.utils.checkpoint``) the backward pass runs the
    chunks again to make them, so call it outside one, as `dsq train` does.
    """
    if features.dim() != 2 or target.shape[0] != features.shape[0]:
        raise ValueError(
            f"chunked_output_loss takes features [N, D] and target [N], got "
            f"{tuple(features.shape)} and {tuple(target.shape)}"
        )
    chunk = chunk_tokens if chunk_tokens and chunk_tokens > 0 else max(1, features.shape[0])
    params = list(params)
    if not torch.is_grad_enabled():  # a validation: the sums alone, no gradient per chunk
        total, stats = None, None
        for start in range(0, features.shape[0], chunk):
            out = loss_fn(head(features[start : start + chunk]), target[start : start + chunk],
                          *extra_inputs)  # fmt: skip
            total, stats = _add_chunk(total, stats, out)
        return (features.new_zeros(()) if total is None else total, *(stats or []))
    return _ChunkedOutputLoss.apply(
        features, head, loss_fn, target, chunk, len(params), *params, *extra_inputs
    )
