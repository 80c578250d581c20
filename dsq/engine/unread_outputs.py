"""Outputs that a checkpointed layer's run again need not compute (docs/dsq.md, "A checkpointed
layer's input").

A layer held by `checkpointing.held_input_checkpoint` runs its forward again in the backward
pass only to build the graph its backward pass runs through. A module's output there is needed
only where a backward reads its value: a Llama layer's MLP, whose output is summed into the
residual stream and the sum returned, has its output read by none (a sum's backward passes the
gradient on; the layer's output is given back unread). So inside `outputs_unread` an MLP in
slices (`sliced_mlp`) computes nothing of its output and returns a `placeholder`: NaN, so that a
value computed from it by mistake shows as NaN, not as a number.

Whether a placeholder's value is read is checked after the run, on its autograd graph
(`readers`): every node that takes a placeholder in, and every node that takes theirs in, must
be a sum or a view (`_READ_NO_VALUE`), up to the layer's outputs, which must reach it (an op in
place on the output, autograd's ``CopySlices``, is not looked into: it counts as a reader).
Where one is not (a norm after the MLP saves its input), the checkpoint runs the layer again
with every output computed, and that MLP computes its output in every later run again
(`stop_skipping` marks its owner, the MLP's gate weight, and says so once); other MLPs and
models go on skipping. What the check cannot see is a value computed from the output outside
autograd's graph and used besides its path to the outputs: a ``detach()``ed copy, a comparison
or mask, an index, ``.item()`` or a Python branch on it. A layer that does that to its MLP's
output computes on NaN in its run again, as does a forward hook on the layer that reads the sum
(a hook on the MLP itself makes the MLP compute its output: ``integrations.hf``).
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
# the mark `stop_skipping` puts on a placeholder's owner, whose output is read
_READ_MARK = "_dsq_output_read_in_a_run_again"


@contextlib.contextmanager
def outputs_unread(unread: bool = True):
    """A layer's run again for its backward pass, where a module may return a `placeholder` for
    an output; yields the list of the placeholders returned, each ``[its tensor or, once
    noted, its node, its owner]`` (for `readers` and `stop_skipping`). With ``unread`` False, a
    block inside one whose outputs are read (a checkpointed layer's first run inside another's
    run again): no placeholder there. This thread's state outside is restored after."""
    was = getattr(_LOCAL, "placeholders", None)
    _LOCAL.placeholders = [] if unread else None
    try:
        yield _LOCAL.placeholders
    finally:
        _LOCAL.placeholders = was


def placeholder(rows: int, cols: int, like: torch.Tensor, owner) -> torch.Tensor | None:
    """Inside `outputs_unread`, unless ``owner`` (an object that stands for the module, its
    weight) is marked read (`stop_skipping`): a ``[rows, cols]`` tensor of NaN of ``like``'s
    dtype and device for the caller to return in place of its output, after which the caller
    passes its autograd output to `note`; else None: compute the output. The caller asks only
    where its output gets an autograd node (gradients on where it was called: no node, no
    check). A tensor of its own, as the output would be, so that the layer's code may write into
    it in place."""
    if getattr(_LOCAL, "placeholders", None) is None or getattr(owner, _READ_MARK, False):
        return None
    out = like.new_full((rows, cols), float("nan"))
    _LOCAL.placeholders.append([out, owner])  # until `note` puts its node in the tensor's place
    return out


def note(output: torch.Tensor) -> None:
    """Note ``output``, the autograd output of a function whose forward returned a
    `placeholder`, by its node, before the layer's code runs on it (an in-place op would give
    the tensor another node): `readers` starts there, and counts a placeholder never noted as
    read."""
    for made in getattr(_LOCAL, "placeholders", None) or []:
        if made[0] is output:
            made[0] = output.grad_fn


def readers(outputs, placeholders: list) -> list[str]:
    """What reads the value of a placeholder (`outputs_unread`'s list: the nodes `note` noted),
    or of a value computed from one, in the graph of ``outputs`` (tensors or not): the names of
    the nodes that take one in and are not a sum or a view, and a placeholder whose node the
    outputs do not reach (a value taken out of the graph, ``detach()``, and used); empty where
    nothing does."""
    nodes = [node for node, _ in placeholders]
    if any(node is None or isinstance(node, torch.Tensor) for node in nodes):
        return ["a placeholder with no autograd node noted"]
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
    found = ["a placeholder the outputs do not reach" for node in nodes if node not in seen]
    stack, tainted = list(nodes), set()
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


def stop_skipping(names: list[str], placeholders: list) -> None:
    """Mark each placeholder's owner (`outputs_unread`'s list): its module computes its output
    in every later run again. Say why once."""
    for _, owner in placeholders:
        setattr(owner, _READ_MARK, True)
    warn_once(
        __name__,
        "dsq: a checkpointed layer reads its MLP's output in its backward pass (by "
        f"{', '.join(names)}): that MLP in slices computes its output in the layer's run again "
        "from now on, which takes the time of its forward pass once more",
    )


def read_in_a_run_again(owner) -> bool:
    """Whether `stop_skipping` marked ``owner``: its module computes its output in a run
    again."""
    return getattr(owner, _READ_MARK, False)
