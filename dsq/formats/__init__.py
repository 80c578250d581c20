"""Number formats (docs/spec.md §1): parse a spec, quantize (fake-quant), pack for real, unpack.

    >>> from dsq.formats import parse_format
    >>> fmt = parse_format("bfp4")
    >>> y = fmt.quantize(x, axis=-1)          # same shape and dtype, values of the format
    >>> p = fmt.pack(x, axis=-1); p.nbytes    # bytes really held
    >>> p.unpack()                            # == fmt.quantize(x), bit for bit

A new format is one class decorated with ``@register`` (see ``floats.py`` for the smallest); a
new family of formats is one module holding its classes and its definition (its reference
kernels), plus a module of kernels per backend that runs it faster (docs/formats.md, "Adding a
format family").
"""

from . import floats, bfp, fixed, mx, nvfp4  # noqa: F401, I001  (registers the formats, in parse order)
from .backends import BACKENDS, default_backend, select_backend
from .base import Format, PackedTensor, grammar, parse_format, register, registered_formats

#: The spec grammar of every registered format (docs/spec.md §1), from the registry.
GRAMMAR = grammar()

__all__ = [
    "BACKENDS",
    "GRAMMAR",
    "Format",
    "PackedTensor",
    "default_backend",
    "grammar",
    "parse_format",
    "register",
    "registered_formats",
    "select_backend",
]
