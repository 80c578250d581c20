"""Static fixed point's kernels on the c backend (backend_c.py): no C kernel quantizes or unpacks
it, so those run the compile backend's kernels (fixed_compile.py), registered here as the c
backend's choice (not a missing kernel); pack hands them the c backend's bit packer.
"""

from __future__ import annotations

from . import fixed_compile as compiled
from .backend_c import pack_codes
from .backends import register_kernel


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None):
    return compiled.fixed_static_pack(
        x, width, frac_bits, rounding, generator, pack_codes=pack_codes
    )


for _op, _fn in {
    "quantize": compiled.fixed_static_quantize,
    "pack": fixed_static_pack,
    "unpack": compiled.fixed_static_unpack,
}.items():
    register_kernel("c", "fixed_static", _op, _fn)
