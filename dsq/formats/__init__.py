"""Number formats (docs/spec.md §1): parse a spec, quantize (fake-quant), pack for real, unpack.

    >>> from dsq.formats import parse_format
    >>> fmt = parse_format("bfp4")
    >>> y = fmt.quantize(x, axis=-1)          # same shape and dtype, values of the format
    >>> p = fmt.pack(x, axis=-1); p.nbytes    # bytes really held
    >>> p.unpack()                            # == fmt.quantize(x), bit for bit

A new format is one class decorated with ``@register`` (see ``floats.py`` for the smallest).
"""

from . import bfp, fixed, floats  # noqa: F401  (registers the formats, in parse order)
from .backends import BACKENDS, default_backend, select_backend
from .base import GRAMMAR, Format, PackedTensor, parse_format, register, registered_formats

__all__ = [
    "BACKENDS",
    "GRAMMAR",
    "Format",
    "PackedTensor",
    "default_backend",
    "parse_format",
    "register",
    "registered_formats",
    "select_backend",
]
