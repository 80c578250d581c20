"""`warn_once`: a warning logged once a process, however often its cause recurs.

A fallback that makes a run slower but not different (a kernel the backend lacks, a bf16 GEMM
run in float32), or a file system that takes no locks, says so in one line, not at every call.
The engine, the formats and the suite's run files all need it; this is its one owner, and it
imports the standard library only. Its memory is a plain dict, which torch.compile reads as a
guarded constant (see ``dsq/formats/memo.py``), so a warning said once eagerly costs nothing in
a compiled graph.
"""

from __future__ import annotations

import logging

_said: dict[tuple[str, str], None] = {}


def warn_once(logger: str, message: str) -> None:
    """Log ``message`` as a warning of the logger named ``logger`` the first time this process
    asks, else nothing. The logger goes by its name, a string: torch.compile hashes a key of
    strings as a constant, where a Logger's attribute in the key would break the graph."""
    key = (logger, message)
    if key not in _said:
        _said[key] = None
        logging.getLogger(logger).warning(message)


# tests: forget what was said, so that a test sees its warning whatever ran before it
warn_once.cache_clear = _said.clear  # type: ignore[attr-defined]
