"""The backends that run the quantizers, and the one switch that picks one (docs/formats.md,
"Backends").

A backend is a module that defines every operation of `Backend` (the signatures are those at
the end of ``reference.py``). Four exist:

=========== ========================= ==========================================================
name        module                    runs
=========== ========================= ==========================================================
reference   ``reference.py``          the definition, readable PyTorch, any device
compile     ``backend_compile.py``    torch.compile-fused kernels, CPU tensors
c           ``backend_c.py``          the C kernels (torch custom ops ``dsq::*``) where they hold
                                      the format, the compile kernels for the rest; CPU tensors
triton      ``backend_triton.py``     Triton kernels: CUDA tensors (CPU under TRITON_INTERPRET=1)
=========== ========================= ==========================================================

Every backend gives the reference's results bit for bit; they differ in speed only.

**The switch.** ``DSQ_BACKEND=auto|reference|compile|c|triton`` (or a function's ``backend=``
argument, which wins). ``auto``, the default, takes the first backend of `AUTO_ORDER` that runs
on the tensor's device: ``c``, then ``compile``, then ``reference`` on CPU; ``triton`` then
``reference`` on CUDA. Falling back is a warning, once, with the reason (logger ``dsq.formats``).
A named backend that cannot run is an error, so a test can never pass on the wrong backend; an
unknown name is a ValueError. An empty tensor has nothing to compute and runs on the reference
whatever is chosen (the fast kernels assume at least one element).

A backend module that lacks an operation is refused when it is loaded (`load_backend`), naming
what is missing: a caller never finds out by a silent fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Protocol

import torch

BACKENDS = ("reference", "compile", "c", "triton")
CHOICES = ("auto", *BACKENDS)
ENVIRONMENT_VARIABLE = "DSQ_BACKEND"
AUTO_ORDER = {"cpu": ("c", "compile", "reference"), "cuda": ("triton", "reference")}
_MODULES = {
    "reference": "dsq.formats.reference",
    "compile": "dsq.formats.backend_compile",
    "c": "dsq.formats.backend_c",
    "triton": "dsq.formats.backend_triton",
}
log = logging.getLogger("dsq.formats")


class Backend(Protocol):
    """The operations every backend defines (``reference.py``'s interface, end of file).

    ``x`` arrives non-empty; results match the reference bit for bit, in ``x``'s shape and dtype.
    The fused pairs come with a ``fusable_*`` test saying whether they cover a call; where it
    says no (the reference's always does: it has no fused kernels), the format runs the two
    operations one after the other, with the same result.
    """

    def unavailable_reason(self, device_type: str) -> str | None:
        """Why this backend cannot run tensors of ``device_type`` here, or None when it can."""

    def bfp_quantize(self, x, man_bits, exp_bits, block, axis, rounding, generator): ...
    def bfp_pack(self, x, man_bits, exp_bits, block, axis, rounding, generator): ...
    def bfp_unpack(self, mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype): ...
    def fixed_static_quantize(self, x, width, frac_bits, rounding, generator): ...
    def fixed_static_pack(self, x, width, frac_bits, rounding, generator): ...
    def fixed_static_unpack(self, integers, nan_mask, width, frac_bits, shape, dtype): ...
    def fusable_quantize_and_pack(self, x, q_args, axis, p_args, pack_axis) -> bool: ...
    def bfp_quantize_and_pack(self, x, q_args, axis, p_args, pack_axis): ...
    def fusable_quantize_chain(self, x, first_args, axis, second_args, second_axis) -> bool: ...
    def bfp_quantize_chain(self, x, first_args, axis, second_args, second_axis): ...


OPERATIONS = tuple(name for name in Backend.__dict__ if not name.startswith("_"))


@functools.cache
def load_backend(name: str) -> ModuleType:
    """The module of backend ``name``, checked to define every operation of `Backend`."""
    module = importlib.import_module(_MODULES[name])
    missing = [op for op in OPERATIONS if not callable(getattr(module, op, None))]
    if missing:
        raise TypeError(f"backend {name!r} ({module.__name__}) lacks {', '.join(missing)}")
    return module


def requested_backend(backend: str | None = None) -> str | None:
    """The named choice (``backend``, else ``DSQ_BACKEND``), or None for ``auto``; a name
    outside `CHOICES` is a ValueError saying which names exist."""
    if backend:  # None or "": the environment's choice
        where, requested = "backend", backend
    else:
        where, requested = ENVIRONMENT_VARIABLE, os.environ.get(ENVIRONMENT_VARIABLE) or "auto"
    if requested not in CHOICES:
        raise ValueError(f"unknown {where} {requested!r}; choose one of {', '.join(CHOICES)}")
    return None if requested == "auto" else requested


def unavailable_reason(name: str, device_type: str) -> str | None:
    """Why backend ``name`` cannot run tensors of ``device_type`` here, or None when it can."""
    return load_backend(name).unavailable_reason(device_type)


def requested_backend_refusal(device_type: str) -> str | None:
    """Why the backend ``DSQ_BACKEND`` names cannot run tensors of ``device_type`` here, as one
    line for the user, or None (``auto``, or a backend that runs there): what a command checks
    before it starts, instead of failing at its first quantizer call."""
    requested = requested_backend()
    reason = None if requested is None else unavailable_reason(requested, device_type)
    if reason is None:
        return None
    return (
        f"DSQ_BACKEND={requested} cannot run on {device_type} here: {reason}; "
        "unset it (auto) or choose another backend"
    )


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)  # the run is slower, not different


def select_backend(x: torch.Tensor, backend: str | None = None) -> ModuleType:
    """The backend module to run ``x`` on (the module docstring states the rules)."""
    requested = requested_backend(backend)
    if x.numel() == 0:
        return load_backend("reference")
    device = x.device.type
    if requested is not None:
        reason = unavailable_reason(requested, device)
        if reason is not None:
            raise RuntimeError(f"backend {requested!r} cannot run here: {reason}")
        return load_backend(requested)
    return load_backend(auto_backend(device))


@functools.cache
def auto_backend(device_type: str) -> str:
    """The backend ``auto`` takes for tensors of ``device_type``, the fallback logged once."""
    order = AUTO_ORDER.get(device_type, ("reference",))
    reasons = []
    for name in order:
        reason = unavailable_reason(name, device_type)
        if reason is None:
            if reasons:
                _log_once(f"dsq: quantizers on the {name} backend ({'; '.join(reasons)})")
            return name
        reasons.append(f"{name}: {reason}")
    raise AssertionError("the reference backend runs everywhere")  # pragma: no cover


def default_backend(device: str | torch.device = "cpu") -> str:
    """The backend an automatic choice (``DSQ_BACKEND`` unset or ``auto``) or the variable's
    named choice takes for a non-empty tensor on ``device``."""
    requested = requested_backend()
    return requested if requested is not None else auto_backend(torch.device(device).type)
