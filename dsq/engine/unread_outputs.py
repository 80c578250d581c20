"""Outputs that a checkpointed layer's run again need not compute (docs/dsq.md, "A checkpointed
layer's input").

A layer held by `checkpointing.held_input_checkpoint` runs its forward again in the backward
pass only to build the graph its backward pass runs through. A module's output there is needed
only where a backward reads its value: a Llama layer's MLP, whose output is summed into the
residual stream and the sum returned, has its output read by none (a sum's backward passes the
gradient on; the layer's output is given back unread). So inside `outputs_unread` an MLP in
slices (`sliced_mlp`) computes nothing of its output and returns a `placeholder`: NaN, a view of
one value, so that a value computed from it by mistake shows as NaN, not as a number.

Whether a placeholder's value is read is checked after the run, on its autograd graph
(`readers`): every node that takes a placeholder in, and every node that takes theirs in, must
be a sum or a view (`_READ_NO_VALUE`), up to the layer's outputs. Where one is not (a norm after
the MLP saves its input), the checkpoint runs the layer again with every output computed, and
no later run in the process skips one (`stop_skipping`, which says so once). What the check
cannot see is a value taken out of the graph (``detach()``) and kept: a layer that does that to
its MLP's output computes on NaN in its run again.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from dsq.warn_once import warn_once

# backward nodes that read no value of their input: a sum's and a view's pass the gradient on
_READ_NO_VALUE = frozenset(
    ("AddBackward0", "SubBackward0", "ViewBackward0", "UnsafeViewBackward0")
    + ("ReshapeAliasBackward0", "ToCopyBackward0")
)

_LOCAL = threading.local()
# set once a placeholder was read somewhere: from then on every output is computed
_SKIPPING = {"on": True}


@contextlib.contextmanager
def outputs_unread(unread: bool = True):
    """A layer's run again for its backward pass, where a module may return a `placeholder` for
    an output; yields the list of placeholders returned (for `readers`), or None where
    skipping is off (`stop_skipping`). With ``unread`` False, a block inside one whose outputs
    are read (a checkpointed layer's first run inside another's run again): no placeholder
    there. This thread's state outside is restored after."""
    was = getattr(_LOCAL, "placeholders", None)
    _LOCAL.placeholders = [] if unread and _SKIPPING["on"] else None
    try:
        yield _LOCAL.placeholders
    finally:
        _LOCAL.placeholders = was


def placeholder(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
    """Inside `outputs_unread` (skipping on): a ``[rows, cols]`` NaN of ``like``'s dtype and
    device holding one value, noted for `readers`; else None: compute the output."""
    placeholders = getattr(_LOCAL, "placeholders", None)
    if placeholders is None:
        return None
    out = like.new_full((), float("nan")).expand(rows, cols)
    placeholders.append(out)
    return out


def readers(outputs, placeholders: list[torch.Tensor]) -> list[str]:
    """The names of the nodes in the graph of ``outputs`` (tensors or not) that read the value
    of a placeholder or of a value computed from one; empty where none does. A placeholder
    without a node (no input of its module needed a gradient) cannot be told apart: it counts as
    read."""
    starts = [t.grad_fn for t in placeholders]
    if any(node is None for node in starts):
        return ["a placeholder outside autograd's graph"]
    roots = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    # the graph's edges the other way: each node's takers, from the outputs down
    takers: dict = {}
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                takers.setdefault(child, []).append(node)
                stack.append(child)
    found, stack, tainted = [], list(starts), set()
    while stack:
        node = stack.pop()
        for taker in takers.get(node, ()):
            if taker in tainted:
                continue
            tainted.add(taker)
            if taker.name() in _READ_NO_VALUE:
                stack.append(taker)
            else:
                found.append(taker.name())
    return sorted(set(found))


def stop_skipping(names: list[str]) -> None:
    """Compute every output from now on, in this process, and say why once."""
    _SKIPPING["on"] = False
    warn_once(
        __name__,
        "dsq: a checkpointed layer reads its MLP's output in its backward pass (by "
        f"{', '.join(names)}): the MLP in slices computes its output in the layer's run again "
        "from now on, which takes the time of its forward pass once more",
    )


def skipping() -> bool:
    """Whether a run again may leave an output uncomputed (`stop_skipping` was not called)."""
    return _SKIPPING["on"]
