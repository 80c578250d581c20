"""The reference backend: the definition of every format family, readable PyTorch, on any device.

Each family's definition is in a module of its own, registered as the family's ``reference``
kernels (bfp_reference.py, fixed_reference.py; MX's and NVFP4's in mx.py and nvfp4.py), and
every other backend is tested bit for bit against it. This module says where the backend runs.
"""

from __future__ import annotations


def unavailable_reason(device_type: str) -> str | None:
    """The reference runs on every device."""
    return None
