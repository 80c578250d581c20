"""GEMMs in a compute dtype that holds both operands exactly, on the CPU (docs/dsq.md, "GEMM
units"): the host glue of ``dsq.kernels.onednn``, as the backends are the quantizers'.

``bf16_gemm(a, b, bias)`` converts both float32 operands to bf16, checking in the same pass
that every value is a bf16 number the bf16 unit multiplies exactly (``Format.exact_in`` says
which formats' values are), pads every side with zeros to one of 32 sizes per octave (so that
batches of every length share a few hundred oneDNN primitives; the result's columns are B's
first ones, read through a view, so that a result of the layer's own width needs no copy of its
padding's) and returns the float32 result,
or None when a value did not pass or oneDNN refused the call: the caller then runs the GEMM in
float32. ``bf16x2_gemm(a, b, split, bias)`` does the same with one operand, whose values have up
to 16 significant bits (fixed16's), split into an exact pair of bf16 numbers: two bf16 GEMMs
whose results are added, which pays on CPUs whose bf16 GEMMs are fast enough (``cpu_split_pays``).
"""

from __future__ import annotations

import logging

import torch

from dsq.warn_once import warn_once

LOGGER = "dsq.formats"
log = logging.getLogger(LOGGER)


def cpu_bf16_unavailable_reason() -> str | None:
    """Why this CPU has no exact bf16 GEMM (no bf16 dot-product instructions, or the oneDNN
    kernels do not build), or None when it has one."""
    from dsq.kernels import onednn

    return onednn.unavailable_reason()


def cpu_split_pays() -> bool:
    """Whether this CPU, whose bf16 GEMMs are available (the caller asks
    `cpu_bf16_unavailable_reason` first), runs a GEMM as an exact pair of bf16 GEMMs
    (`bf16x2_gemm`) faster than in float32: measured to pay on this kind of CPU. Asked at every
    GEMM's plan, so it reads only the cached CPU identity."""
    from dsq.kernels import onednn

    return onednn.split_pays()


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, b_ready=None):
    """``a @ b (+ bias)`` in float32 on the CPU's bf16 unit, for float32 ``a`` [..., m, k] and
    ``b`` [..., k, n] with the same leading dimensions (``bias`` [n] with 2-D operands); a new
    contiguous tensor (never a view), or None when it cannot run exactly there. ``b_ready``:
    `prepared_b` of this ``b``, for GEMMs that share it (a slice of ``a`` at a time)."""
    return _padded_gemm(a, b, bias, split=None, b_ready=b_ready)


def bf16x2_gemm(
    a: torch.Tensor, b: torch.Tensor, split: str, bias: torch.Tensor | None = None, b_ready=None
):
    """`bf16_gemm` with the operand ``split`` (``"a"`` or ``"b"``), whose values have up to 16
    significant bits, held as an exact pair hi + lo of bf16 numbers: ``hi @ b + lo @ b`` (or
    ``a @ hi + a @ lo``), two GEMMs on the bf16 unit whose float32 results are added. Exact as
    `bf16_gemm` is (every product of bf16 numbers is exact in float32), up to the order of the
    float32 sums; None when it cannot run so."""
    if split not in ("a", "b"):
        raise ValueError(f"split must be 'a' or 'b', got {split!r}")
    return _padded_gemm(a, b, bias, split=split, b_ready=b_ready)


def prepared_b(b: torch.Tensor, split: str | None = None):
    """The second operand ``b`` [..., k, n] converted as `bf16_gemm` (``split`` None or "a") or
    `bf16x2_gemm` with ``split="b"`` converts it, once for every GEMM that shares it; None where
    it is not exactly representable (each GEMM then finds so itself)."""
    from dsq.kernels import onednn

    k, n = b.shape[-2:]
    b3 = b.reshape(-1, k, n)
    shape = tuple(onednn.padded_size(d) for d in (b3.shape[0], k, n))
    return (onednn.split_bf16 if split == "b" else onednn.to_bf16)(b3, shape)


def _padded_gemm(a, b, bias, split, b_ready=None):
    from dsq.kernels import onednn

    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)  # views where the layout allows
    rows = a3.shape[0]
    batch, pm, pk, pn = (onednn.padded_size(d) for d in (rows, m, k, n))
    ab = (onednn.split_bf16 if split == "a" else onednn.to_bf16)(a3, (batch, pm, pk))
    bb = None
    if ab is not None:
        bb = b_ready if b_ready is not None else prepared_b(b3, split)
    if bb is None:
        return None
    if pn > n:  # B's columns beyond n, a strided view: the result has n columns, no copy
        bb = tuple(x[..., :n] for x in bb) if split == "b" else bb[..., :n]
    try:
        if split is None:
            out = onednn.gemm_bf16(ab, bb, bias)  # [batch, pm, n], a new contiguous tensor
        elif split == "a":
            out = onednn.gemm_bf16(ab[0], bb, bias).add_(onednn.gemm_bf16(ab[1], bb))
        else:
            out = onednn.gemm_bf16(ab, bb[0], bias).add_(onednn.gemm_bf16(ab, bb[1]))
    except RuntimeError as err:  # a layout oneDNN refuses: float32 runs it instead
        warn_once(LOGGER, f"dsq: a bf16 GEMM ran in float32: {err}")
        return None
    if rows > 1 and pm != m:
        out = out[:rows, :m].clone(memory_format=torch.contiguous_format)
    # the result's leading memory, reshaped in place: a new tensor, not a view (a custom
    # Function's output that a model then modifies in place must not be a view)
    return out.resize_(*lead, m, n)
