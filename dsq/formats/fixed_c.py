"""Static fixed point's kernels on the c backend (backend_c.py): no C kernel quantizes or unpacks
it, so those run the compile backend's kernels (fixed_compile.py), registered here as the c
backend's choice (not a missing kernel); pack hands them the c backend's bit packer.
"""

from __future__ import annotations

from . import fixed_compile as compiled
from . import fixed_reference
from .backend_c import pack_codes
from .backends import register_kernels

# the compile backend's, the c backend's choice
fixed_static_quantize = compiled.fixed_static_quantize
fixed_static_unpack = compiled.fixed_static_unpack


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None):
    return compiled.fixed_static_pack(
        x, width, frac_bits, rounding, generator, pack_codes=pack_codes
    )


register_kernels("c", "fixed_static", fixed_reference.KERNEL_NAMES, globals())
