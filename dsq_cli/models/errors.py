"""The error every encoder builder raises for a model that cannot be built."""

from __future__ import annotations


class EncoderError(ValueError):
    """An encoder that cannot be built; the one-line message names what is missing and the fix."""
