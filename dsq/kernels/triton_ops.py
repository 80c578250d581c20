"""The Triton launches as torch custom ops: `define` registers one (``dsq::triton_<name>``) with
its fake kernel, which gives its outputs' shapes and dtypes without running Triton, so that a graph
torch.compile traces meets a registered op, as it meets the C kernels (dsq/kernels/cpu.py). The
launch stays the implementation, on CUDA or under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from collections.abc import Callable

import torch


def define(name: str, schema: str, launch: Callable, fake: Callable):
    """Register ``launch`` as the op ``dsq::triton_<name>`` of ``schema`` (it writes none of its
    inputs) with ``fake``; returns the op, called as ``launch`` is."""
    op = torch.library.custom_op(f"dsq::triton_{name}", launch, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return getattr(torch.ops.dsq, f"triton_{name}").default
