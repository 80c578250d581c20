"""The c backend: the C kernels (torch custom ops ``dsq::*``, ``dsq.kernels.cpu``) for CPU tensors.

The kernels hold the calls a training step makes: BFP and fixed<w> with nearest rounding, E <= 8
and m <= 23, and codes of up to 8 bits (docs/formats.md, "The C kernels"). Every other call
(stochastic rounding, E > 8, wider codes, static fixed point) runs the compile backend's
torch.compile kernels, so the backend holds every operation, each bit for bit the reference's.
The host-side layout work is shared with the compile backend: its functions take the C kernels
as ``c`` and choose, call by call, whether they hold the call.
"""

from __future__ import annotations

import functools

from dsq.kernels import cpu

from . import backend_compile as compiled

fusable_quantize_and_pack = compiled.c_fusable_quantize_and_pack
fusable_quantize_chain = compiled.fusable_quantize_chain
fixed_static_quantize = compiled.fixed_static_quantize  # no C kernel: torch.compile's
fixed_static_unpack = compiled.fixed_static_unpack


def unavailable_reason(device_type: str) -> str | None:
    """Why this backend cannot run tensors of ``device_type`` here (the compile backend's reason,
    as it runs the calls the C kernels do not hold, or why the kernels do not build), or None."""
    return compiled.unavailable_reason(device_type) or cpu.build_failure()


bfp_quantize = functools.partial(compiled.bfp_quantize, c=cpu)
bfp_pack = functools.partial(compiled.bfp_pack, c=cpu)
bfp_unpack = functools.partial(compiled.bfp_unpack, c=cpu)
fixed_static_pack = functools.partial(compiled.fixed_static_pack, c=cpu)
bfp_quantize_and_pack = functools.partial(compiled.bfp_quantize_and_pack, c=cpu)
bfp_quantize_chain = functools.partial(compiled.bfp_quantize_chain, c=cpu)
