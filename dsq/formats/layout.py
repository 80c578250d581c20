"""The one layout every family's kernels work in: the quantization axis moved last, the rest
flattened into rows, and back (docs/formats.md, "Adding a format family").

A format quantizes along one axis, in blocks of consecutive values along it (or one block over
the whole tensor). Every kernel, whatever its backend, takes the values as rows ``[R, n]`` with
that axis last, and gives back values in the same order; these helpers move a tensor there and
back, so that no backend keeps a copy of its own.
"""

from __future__ import annotations

import math

import torch


def moved_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """``shape`` with ``axis`` last (a 0-dim tensor's: one element)."""
    if len(shape) == 0:
        return (1,)
    dims = list(shape)
    n = dims.pop(axis)
    return (*dims, n)


def axis_last(t: torch.Tensor | None, axis: int) -> torch.Tensor | None:
    """``t`` with ``axis`` last, contiguous (a 0-dim tensor becomes one element; None stays
    None)."""
    if t is None:
        return None
    if t.dim() == 0:
        return t.reshape(1)
    return t.movedim(axis, -1).contiguous()


def axis_back(values: torch.Tensor, shape, axis: int) -> torch.Tensor:
    """Values shaped like ``axis_last``'s result, back in ``shape``'s order."""
    if len(shape) == 0:
        return values.reshape(())
    return values.movedim(-1, axis)


def as_rows(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(``x`` as float32 rows ``[R, n]`` with ``axis`` last, detached and contiguous; the moved
    shape). Detached and contiguous because a compiled kernel is specialised on requires_grad and
    on strides, and the C and Triton kernels read memory in order."""
    x32 = x.detach().to(torch.float32)
    moved = x32.movedim(axis, -1) if x32.dim() else x32.reshape(1)
    return moved.reshape(-1, moved.shape[-1]).contiguous(), tuple(moved.shape)


def from_rows(values: torch.Tensor, moved: tuple[int, ...], shape, axis: int, dtype):
    """Values in the rows' order (any shape of as many elements) back to ``shape`` and
    ``dtype``: the inverse of `as_rows`."""
    out = values.reshape(moved)
    out = out.reshape(shape) if len(shape) == 0 else out.movedim(-1, axis)
    return out.to(dtype)


def as_blocks(x: torch.Tensor, block: int | None, axis: int):
    """(``x`` as float32 blocks ``[R, n_blocks, block]``, the last block of each row padded with
    zeros where partial; the row length n; the moved shape). ``block`` None: one row, one block
    holding the whole tensor."""
    if block is None:
        x32 = x.detach().to(torch.float32)
        return x32.reshape(1, 1, -1), x32.numel(), (x32.numel(),)
    rows, moved = as_rows(x, axis)
    n = rows.shape[-1]
    n_blocks = -(-n // block)
    if n_blocks * block != n:
        rows = torch.nn.functional.pad(rows, (0, n_blocks * block - n))
    return rows.reshape(rows.shape[0], n_blocks, block), n, moved


def from_blocks(blocks: torch.Tensor, n: int, moved, shape, axis: int | None, dtype):
    """The inverse of `as_blocks` (``axis`` None: the whole tensor was one block)."""
    flat = blocks.reshape(blocks.shape[0], -1)
    if flat.shape[1] != n:
        flat = flat[:, :n]
    out = flat.reshape(moved)
    out = out.reshape(shape) if axis is None or len(shape) == 0 else out.movedim(-1, axis)
    return out.to(dtype)


# the reference definitions' form: the leading dimensions kept, the blocks split off last
def blocks_along(x: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, int]:
    """Move ``axis`` last and split it into blocks: returns ([..., n_blocks, block], n).

    A trailing partial block is zero-padded; zeros change neither a block's max nor its values.
    """
    moved = x.movedim(axis, -1) if x.dim() else x.reshape(1)
    n = moved.shape[-1]
    n_blocks = max(1, math.ceil(n / block))
    padded = torch.nn.functional.pad(moved, (0, n_blocks * block - n))
    return padded.reshape(*moved.shape[:-1], n_blocks, block), n


def unblock(blocks: torch.Tensor, n: int, x_shape: torch.Size, axis: int) -> torch.Tensor:
    """Inverse of ``blocks_along``."""
    flat = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])[..., :n]
    if len(x_shape) == 0:
        return flat.reshape(())
    return flat.movedim(-1, axis)
