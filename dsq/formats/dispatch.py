"""Choosing the implementation ("path") that runs a quantizer.

Three paths share one interface (see the end of ``reference.py``): ``reference`` (readable
PyTorch, any device), ``compiled`` (torch.compile-fused, CPU) and ``triton`` (Triton kernels,
CUDA; on CPU tensors only under ``TRITON_INTERPRET=1``, for tests). Without an explicit choice,
CUDA tensors take ``triton`` and CPU tensors ``compiled``; when that path cannot run, the call
falls back to ``reference`` and the reason is logged once (logger ``dsq.formats``). An explicit
choice (the ``backend=`` argument, or the ``DSQ_BACKEND`` environment variable) that cannot run
is an error, so a test can never pass on the wrong path.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import shutil
from types import ModuleType

import torch

BACKENDS = ("reference", "compiled", "triton")
log = logging.getLogger("dsq.formats")


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


@functools.cache
def compiled_unavailable_reason() -> str | None:
    """Why the fused CPU path cannot run here, or None when it can."""
    if os.environ.get("DSQ_DISABLE_COMPILE", "") not in ("", "0"):
        return "DSQ_DISABLE_COMPILE is set"
    try:
        import torch._dynamo  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the torch build
        return f"torch.compile is unavailable ({err})"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("gcc") is None:
        return "no C++ compiler for torch.compile's CPU backend"
    return None


@functools.cache
def triton_unavailable_reason(device_type: str) -> str | None:
    """Why the Triton path cannot run on this device type, or None when it can."""
    try:
        import triton  # noqa: F401
    except Exception as err:
        return f"triton is not importable ({err})"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the Triton kernels need CUDA tensors (got {device_type}; "
        "TRITON_INTERPRET=1 runs them on CPU)"
    )


def unavailable_reason(backend: str, x: torch.Tensor) -> str | None:
    if backend == "reference":
        return None
    if x.numel() == 0:
        return "the tensor is empty"
    if backend == "compiled":
        if x.device.type != "cpu":
            return f"the compiled path is for CPU tensors (got {x.device.type})"
        return compiled_unavailable_reason()
    return triton_unavailable_reason(x.device.type)


def _module(backend: str) -> ModuleType:
    name = {"reference": "reference", "compiled": "compiled", "triton": "triton_path"}[backend]
    return importlib.import_module(f"dsq.formats.{name}")


def requested_backend(backend: str | None = None) -> str | None:
    """The explicit choice (``backend``, else ``DSQ_BACKEND``), or None for the automatic one;
    a name outside ``BACKENDS`` is a ValueError."""
    requested = backend or os.environ.get("DSQ_BACKEND") or None
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    return requested


def select_path(x: torch.Tensor, backend: str | None = None) -> ModuleType:
    """The path module to run ``x`` on (see the module docstring for the rules)."""
    requested = requested_backend(backend)
    if x.numel() == 0:
        return _module("reference")  # nothing to compute: every path gives the same empty result
    if requested is not None:
        reason = unavailable_reason(requested, x)
        if reason is not None:
            raise RuntimeError(f"backend {requested!r} cannot run here: {reason}")
        return _module(requested)
    preferred = "triton" if x.device.type == "cuda" else "compiled"
    reason = unavailable_reason(preferred, x)
    if reason is None:
        return _module(preferred)
    _log_once(f"dsq: using the reference quantizer instead of {preferred}: {reason}")
    return _module("reference")


def default_backend(device: str | torch.device = "cpu") -> str:
    """The path an automatic choice takes for a (non-empty) tensor on ``device``."""
    probe = torch.empty(1, device=device)
    return select_path(probe).__name__.rsplit(".", 1)[-1].replace("triton_path", "triton")
