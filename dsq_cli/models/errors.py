"""The error a model builder (an encoder, a causal LM) raises for a model that cannot be built."""

from __future__ import annotations


class EncoderError(ValueError):
    """A model that cannot be built; the one-line message names what is missing and the fix."""
