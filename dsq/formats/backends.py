"""The backends that run the quantizers, the one switch that picks one, and the registry of
their kernels (docs/formats.md, "Implementations: the backends").

Four backends exist; each is a module that says where it runs (``unavailable_reason``):

=========== ========================= ==========================================================
name        module                    runs
=========== ========================= ==========================================================
reference   ``reference.py``          each family's definition, readable PyTorch, any device
compile     ``backend_compile.py``    torch.compile-fused kernels, CPU tensors
c           ``backend_c.py``          the C kernels (torch custom ops ``dsq::*``), CPU tensors
triton      ``backend_triton.py``     Triton kernels: CUDA tensors (CPU under TRITON_INTERPRET=1)
=========== ========================= ==========================================================

A backend's module holds no family's kernels: each family's are in modules of its own, one a
backend (``bfp_compile.py``, ``mx_c.py``, ...; the definitions ``bfp_reference.py``, ``mx.py``),
named in the family's `declare_family`.

Every backend gives the reference's results bit for bit; they differ in speed only.

**Kernels are registered per family and operation.** A format family (``Format.family``:
``bfp``, ``fixed_static``, ``mx``, ...) runs its operations (``quantize``, ``pack``,
``unpack``, and the fused pairs' operations where it has them) through `kernel`, which returns
the function a backend registered for that family and operation (`register_kernel`). The
family's definition is registered under ``reference`` by the family's own module, and it must
hold ``quantize``, ``pack`` and ``unpack``. A backend that registered no kernel for an
operation runs the reference's, with one logged line per backend, family and operation;
`missing_kernels` lists those (``dsq bench quant`` prints them). A family says in
`declare_family` which modules hold its kernels for which backend, so adding one touches its
own modules only: the registry imports a family's kernel module the first time a kernel of
that backend is asked for.

**The switch.** ``DSQ_BACKEND=auto|reference|compile|c|triton`` (or a function's ``backend=``
argument, which wins). ``auto``, the default, takes the first backend of `AUTO_ORDER` that runs
on the tensor's device: ``c``, then ``compile``, then ``reference`` on CPU; ``triton`` then
``reference`` on CUDA. Falling back is a warning, once, with the reason (logger ``dsq.formats``).
A named backend that cannot run is an error, so a test can never pass on the wrong backend; an
unknown name is a ValueError. An empty tensor has nothing to compute and runs on the reference
whatever is chosen (the fast kernels assume at least one element).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from types import ModuleType

import torch

from dsq.warn_once import warn_once

from .memo import memo

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
# The operations every family defines on the reference; a family may add its own (the fused
# pairs of BFP: ``fusable_quantize_and_pack`` and ``quantize_and_pack``, ``fusable_quantize_chain``
# and ``quantize_chain``).
REQUIRED_OPS = ("quantize", "pack", "unpack")
LOGGER = "dsq.formats"
log = logging.getLogger(LOGGER)

# (backend, family, operation) -> the kernel
_KERNELS: dict[tuple[str, str, str], Callable] = {}
# family -> {backend: the module that registers its kernels for that backend}
_FAMILY_MODULES: dict[str, dict[str, str]] = {}


def register_kernel(backend: str, family: str, op: str, fn: Callable | None = None):
    """Register ``fn`` as ``backend``'s kernel for operation ``op`` of format family ``family``
    (as a decorator when ``fn`` is omitted). Its signature is the reference's for that family
    and operation; its results equal the reference's bit for bit."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; the backends are {', '.join(BACKENDS)}")

    def store(function: Callable) -> Callable:
        _KERNELS[(backend, family, op)] = function
        return function

    return store if fn is None else store(fn)


def register_kernels(backend: str, family: str, names: Mapping[str, str], namespace: Mapping):
    """`register_kernel` for each operation of ``names`` (operation -> function name, the family's
    one list of its kernels' names) with the function of that name in ``namespace`` (a kernel
    module's ``globals()``): every backend's kernels of a family share their names."""
    for op, name in names.items():
        register_kernel(backend, family, op, namespace[name])


def declare_family(family: str, kernel_modules: Mapping[str, str] | None = None) -> None:
    """Declare a format family whose reference kernels are registered (every operation of
    REQUIRED_OPS), and the modules that register its kernels on other backends, by backend
    name (imported when a kernel of that backend is first asked for)."""
    missing = [op for op in REQUIRED_OPS if ("reference", family, op) not in _KERNELS]
    if missing:
        raise TypeError(f"format family {family!r} has no reference {', '.join(missing)}")
    unknown = set(kernel_modules or {}) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backend(s) {sorted(unknown)} for family {family!r}")
    _FAMILY_MODULES[family] = dict(kernel_modules or {})


def families() -> tuple[str, ...]:
    """The declared format families, in declaration order."""
    return tuple(_FAMILY_MODULES)


def family_ops(family: str) -> tuple[str, ...]:
    """The operations of ``family``: those its reference registered."""
    return tuple(op for (b, f, op) in _KERNELS if b == "reference" and f == family)


@memo
def _load_family_kernels(backend: str, family: str) -> None:
    load_backend(backend)
    module = _FAMILY_MODULES.get(family, {}).get(backend)
    if module is not None:
        importlib.import_module(module)


def kernel(family: str, op: str, backend: str) -> Callable:
    """``backend``'s kernel for ``op`` of ``family``, or the reference's (logged once) when the
    backend registered none."""
    found = _KERNELS.get((backend, family, op))
    if found is not None:
        return found
    _load_family_kernels(backend, family)
    found = _KERNELS.get((backend, family, op))
    if found is not None:
        return found
    reference = _KERNELS.get(("reference", family, op))
    if reference is None:
        raise KeyError(f"format family {family!r} has no operation {op!r}")
    warn_once(
        LOGGER, f"dsq: the {backend} backend has no {family} {op} kernel; the reference runs it"
    )
    return reference


def missing_kernels(backend: str, family: str | None = None) -> list[str]:
    """The operations (``family.op``) that ``backend`` runs on the reference, of ``family`` or
    of every declared family."""
    names = [family] if family is not None else list(_FAMILY_MODULES)
    missing = []
    for name in names:
        _load_family_kernels(backend, name)
        missing += [
            f"{name}.{op}" for op in family_ops(name) if (backend, name, op) not in _KERNELS
        ]
    return missing


def kernel_for(x: torch.Tensor, backend: str | None, family: str, op: str) -> Callable:
    """The kernel that runs ``op`` of ``family`` on ``x`` (the backend chosen as
    `select_backend` chooses it)."""
    return kernel(family, op, backend_name(x, backend))


@memo
def load_backend(name: str) -> ModuleType:
    """The module of backend ``name`` (importing it registers its kernels), checked to say where
    it runs (``unavailable_reason``)."""
    module = importlib.import_module(_MODULES[name])
    if not callable(getattr(module, "unavailable_reason", None)):
        raise TypeError(f"backend {name!r} ({module.__name__}) lacks unavailable_reason")
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


def backend_name(x: torch.Tensor, backend: str | None = None) -> str:
    """The backend to run ``x`` on (the module docstring states the rules)."""
    requested = requested_backend(backend)
    if x.numel() == 0:
        return "reference"
    device = x.device.type
    if requested is not None:
        reason = unavailable_reason(requested, device)
        if reason is not None:
            raise RuntimeError(f"backend {requested!r} cannot run here: {reason}")
        return requested
    return auto_backend(device)


def select_backend(x: torch.Tensor, backend: str | None = None) -> ModuleType:
    """The module of the backend to run ``x`` on (`backend_name`)."""
    return load_backend(backend_name(x, backend))


@memo
def auto_backend(device_type: str) -> str:
    """The backend ``auto`` takes for tensors of ``device_type``, the fallback logged once."""
    order = AUTO_ORDER.get(device_type, ("reference",))
    reasons = []
    for name in order:
        reason = unavailable_reason(name, device_type)
        if reason is None:
            if reasons:
                warn_once(LOGGER, f"dsq: quantizers on the {name} backend ({'; '.join(reasons)})")
            return name
        reasons.append(f"{name}: {reason}")
    raise AssertionError("the reference backend runs everywhere")  # pragma: no cover


def default_backend(device: str | torch.device = "cpu") -> str:
    """The backend an automatic choice (``DSQ_BACKEND`` unset or ``auto``) or the variable's
    named choice takes for a non-empty tensor on ``device``."""
    requested = requested_backend()
    return requested if requested is not None else auto_backend(torch.device(device).type)
