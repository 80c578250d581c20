"""`memo`: functools.cache for the lookups a quantizer call makes (which backend runs, whether it
runs here), written so that torch.compile reads through it.

Dynamo traces a ``functools.cache``-wrapped function as if it were not cached: it enters the
body on every call and breaks the graph wherever the body does what it cannot trace (an
import, a ``shutil.which``). A model compiled with those lookups inside broke its graph at
every quantizer call. A plain dict in a closure is what dynamo reads as a constant, guarded,
so a lookup made once eagerly (or at the first trace) costs nothing inside a compiled graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

Result = TypeVar("Result")


def memo(fn: Callable[..., Result]) -> Callable[..., Result]:
    """``fn`` with its results kept per positional arguments (hashable), and ``cache_clear``."""
    results: dict[tuple, Result] = {}

    @functools.wraps(fn)
    def cached(*args):
        if args not in results:
            results[args] = fn(*args)
        return results[args]

    cached.cache_clear = results.clear  # type: ignore[attr-defined]
    return cached
