"""What the engine executed: every quantized GEMM with its shapes and formats, and the stash bytes.

    >>> with record_gemms() as record:
    ...     loss = model(batch).sum()
    >>> record.gemms          # one GemmRecord per DSQ linear / matmul forward
    >>> record.stash_bytes    # bytes held in packed stashes for the backward pass

The cost model reads these records (3 GEMMs per record: the forward one and two backward ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class GemmRecord:
    """One DSQ layer call. ``kind`` is ``linear`` (x[N,K] W[M,K]^T) or ``matmul``
    (a[batch,N,K] @ b[batch,K,M]); ``formats`` maps q0..q3 to the specs in force; ``units`` are
    the units planned for its three GEMMs, forward first (docs/dsq.md, "GEMM units")."""

    kind: str
    batch: int
    n: int
    k: int
    m: int
    formats: tuple[tuple[str, str], ...]
    stash_bytes: int
    units: tuple[str, ...] = ()

    @property
    def macs(self) -> int:
        """Multiply-accumulates of the forward GEMM (each backward GEMM has as many)."""
        return self.batch * self.n * self.k * self.m

    def to_dict(self) -> dict:
        """The record as plain JSON values (a checkpoint's progress carries one step's GEMMs)."""
        return {
            "kind": self.kind,
            "batch": self.batch,
            "n": self.n,
            "k": self.k,
            "m": self.m,
            "formats": dict(self.formats),
            "stash_bytes": self.stash_bytes,
            "units": list(self.units),
        }

    @classmethod
    def from_dict(cls, record: dict) -> GemmRecord:
        return cls(
            record["kind"],
            record["batch"],
            record["n"],
            record["k"],
            record["m"],
            tuple(sorted(record["formats"].items())),
            record["stash_bytes"],
            tuple(record.get("units", ())),  # records written before the units were planned
        )


@dataclasses.dataclass
class GemmRecorder:
    gemms: list[GemmRecord] = dataclasses.field(default_factory=list)

    @property
    def stash_bytes(self) -> int:
        return sum(g.stash_bytes for g in self.gemms)

    def count(self, kind: str) -> int:
        return sum(1 for g in self.gemms if g.kind == kind)


_ACTIVE: list[GemmRecorder] = []
# Depth of forward passes run again for activation checkpointing, per thread (the autograd
# engine may run a backward pass, and so its recomputations, on a thread of its own): the GEMMs
# of a step are its forward pass's, counted once, so a recomputation notes nothing (docs/dsq.md,
# "What the backward pass holds").
_RECOMPUTING = threading.local()


def recomputing() -> bool:
    """Whether this thread is inside `recomputation`."""
    return getattr(_RECOMPUTING, "depth", 0) > 0


@contextlib.contextmanager
def record_gemms():
    """Record every DSQ GEMM executed inside the block."""
    recorder = GemmRecorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


class recomputation:  # noqa: N801 (used as a function: ``with recomputation():``)
    """A forward pass run again inside the backward pass (activation checkpointing): its GEMMs
    are those of the forward pass already noted, so none is noted again. Reusable: torch's
    checkpoint enters one instance for every recomputation of its layer (a second backward
    pass through a retained graph recomputes again)."""

    def __enter__(self):
        _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1

    def __exit__(self, *exc):
        _RECOMPUTING.depth -= 1


def noting() -> bool:
    """Whether a `note` now would be recorded: a recorder is active and no forward pass is being
    run again (a caller may skip work whose only use is the note's stash bytes)."""
    return bool(_ACTIVE) and not recomputing()


def note(kind: str, batch: int, n: int, k: int, m: int, cfg, stash_bytes: int, plans=()) -> None:
    if not noting():
        return
    formats = tuple(sorted(cfg.current().items()))
    units = tuple(p.unit for p in plans)
    record = GemmRecord(kind, batch, n, k, m, formats, stash_bytes, units)
    for recorder in _ACTIVE:
        recorder.gemms.append(record)


def observe_linears(model, cfg) -> list:
    """Forward hooks on every ``nn.Linear`` of a model the engine did not patch (the autocast
    engine): each call is noted as a linear GEMM record in ``cfg``'s formats, its stash the input
    as those formats hold it, so that such a run is priced on the GEMMs it ran. Returns the hooks'
    handles."""
    from torch import nn

    def hook(module, args, output):
        x = args[0]
        n, k = x.numel() // x.shape[-1], x.shape[-1]
        stash = int(n * k * cfg.format("q1").bits_per_value / 8)
        note("linear", 1, n, k, module.out_features, cfg, stash)

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
