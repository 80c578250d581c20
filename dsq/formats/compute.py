"""GEMMs in a compute dtype that holds both operands exactly, on the CPU (docs/dsq.md, "GEMM
units"): the host glue of ``dsq.kernels.onednn``, as the backends are the quantizers'.

``bf16_gemm(a, b, bias)`` converts both float32 operands to bf16, checking in the same pass
that every value is a bf16 number the bf16 unit multiplies exactly (``Format.exact_in`` says
which formats' values are), pads every side with zeros to one of 32 sizes per octave (so that
batches of every length share a few hundred oneDNN primitives) and returns the float32 result,
or None when a value did not pass or oneDNN refused the call: the caller then runs the GEMM in
float32.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("dsq.formats")


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


def cpu_bf16_unavailable_reason() -> str | None:
    """Why this CPU has no exact bf16 GEMM (no bf16 dot-product instructions, or the oneDNN
    kernels do not build), or None when it has one."""
    from dsq.kernels import onednn

    return onednn.unavailable_reason()


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None):
    """``a @ b (+ bias)`` in float32 on the CPU's bf16 unit, for float32 ``a`` [..., m, k] and
    ``b`` [..., k, n] with the same leading dimensions (``bias`` [n] with 2-D operands); a new
    contiguous tensor (never a view), or None when it cannot run exactly there."""
    from dsq.kernels import onednn

    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)  # views where the layout allows
    rows = a3.shape[0]
    batch, pm, pk, pn = (onednn.padded_size(d) for d in (rows, m, k, n))
    ab = onednn.to_bf16(a3, (batch, pm, pk))
    bb = onednn.to_bf16(b3, (batch, pk, pn)) if ab is not None else None
    if bb is None:
        return None
    if bias is not None and pn > n:
        bias = torch.nn.functional.pad(bias, (0, pn - n))
    try:
        out = onednn.gemm_bf16(ab, bb, bias)  # [batch, pm, pn], a new contiguous tensor
    except RuntimeError as err:  # a layout oneDNN refuses: float32 runs it instead
        _log_once(f"dsq: a bf16 GEMM ran in float32: {err}")
        return None
    if pn != n or (rows > 1 and pm != m):
        out = out[:rows, :m, :n].clone(memory_format=torch.contiguous_format)
    # the result's leading memory, reshaped in place: a new tensor, not a view (a custom
    # Function's output that a model then modifies in place must not be a view)
    return out.resize_(*lead, m, n)
