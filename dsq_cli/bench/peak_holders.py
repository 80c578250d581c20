"""What a step holds at its allocator peak, and where that peak is (``dsq bench memory --where``).

torch.profiler records every allocation and free through PyTorch's CPU allocator with the
operators it happened under (``profile_memory=True``; its event tree gives each record's
address, size and enclosing operators). Replayed in time order, the records give the running
total; at its maximum, the blocks still live are what the step holds at its peak. Each is named
by the operators that allocated it (`holder`), so that "the attention's backward pass, its
unpacked stashes" and "the linear layers' weight gradients" stand apart, and the peak's own
instant by the operators running then (`PeakHolders.at`).

The peak is the one ``step.allocated_during`` measures (`step.replay_peak` of the same kind of
records: the CPU's, in time order; equal on the tests' steps). Blocks allocated before the
profiler started (the parameters, Adam's state) are not among them; the caller knows their
size.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

_BACKWARD = "autograd::engine::evaluate_function: "


@dataclasses.dataclass(frozen=True)
class PeakHolders:
    """``peak`` and ``held`` as `step.Allocation`'s (the most bytes ``fn`` held at once above
    what was live when it started, and what it left alive); ``holders``: the peak's bytes by
    holder (`holder`), largest first; ``at``: the operators running at the peak, outermost
    first; ``out``: what ``fn`` returned."""

    peak: int
    held: int
    holders: list[tuple[str, int]]
    at: tuple[str, ...]
    out: Any


def holders_at_peak(fn: Callable[[], Any]) -> PeakHolders:
    """Run ``fn`` on the CPU under the profiler and say what was live at its allocator peak."""
    from torch.profiler import ProfilerActivity, profile

    from .step import native_stderr_muted, replay_peak

    with native_stderr_muted(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:  # fmt: skip
        out = fn()
    records, operators = [], []  # (time, address, bytes, path); (start, end, path)

    def walk(node, path: tuple[str, ...]) -> None:
        if node.name == "[memory]":
            fields = node.extra_fields
            if fields.device.type == "cpu":
                records.append((node.start_time_ns, fields.ptr, fields.alloc_size, path))
            return
        inner = path + (node.name,)
        operators.append((node.start_time_ns, node.end_time_ns, inner))
        for child in node.children:
            walk(child, inner)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    # stable: records of one instant keep the tree's order, which nests them as they ran
    records.sort(key=lambda record: record[0])
    deltas = [nbytes for _, _, nbytes, _ in records]
    peak, held = replay_peak(deltas), sum(deltas)
    # the first record that reached the peak (none where the step never held more than before)
    last = next((i for i, total in enumerate(itertools.accumulate(deltas)) if total == peak),
                -1) if peak > 0 else -1  # fmt: skip
    live: dict[int, tuple[int, tuple[str, ...]]] = {}
    for _, address, nbytes, path in records[: last + 1]:  # the blocks alive at that record
        if nbytes > 0:
            live[address] = (nbytes, path)
        else:
            live.pop(address, None)  # a block from before the profiler started is not listed
    peak_time = records[last][0] if last >= 0 else None
    by_holder: collections.Counter[str] = collections.Counter()
    for nbytes, path in live.values():
        by_holder[holder(path)] += nbytes
    running_then = [ops for start, end, ops in operators
                    if peak_time is not None and start <= peak_time <= end]  # fmt: skip
    at = max(running_then, key=len, default=())
    return PeakHolders(peak, held, by_holder.most_common(), _named(at), out)


def _named(path: tuple[str, ...]) -> tuple[str, ...]:
    """The operators of ``path`` that name something: the autograd engine's wrapper of each
    backward node left out (the node follows it under its own name)."""
    return tuple(name for name in path if not name.startswith(_BACKWARD))


def holder(path: tuple[str, ...]) -> str:
    """A block's holder, from the operators it was allocated under (outermost first): the
    pass, the two innermost operators that are not aten's (an autograd function, its backward
    node, a dsq op) and the aten operator called first below them, e.g. ``backward:
    DSQAttentionFunctionBackward > dsq::bfp_decode (aten::empty)``."""
    names = _named(path)
    phase = "backward" if any(name.startswith(_BACKWARD) for name in path) else "forward"
    own = [i for i, name in enumerate(names) if not name.startswith("aten::")]
    last = own[-1] if own else -1
    words = " > ".join(names[i] for i in own[-2:]) or "the step"
    below = next((name for name in names[last + 1 :] if name.startswith("aten::")), None)
    return f"{phase}: {words}" + (f" ({below})" if below else "")


def per_token(small: list[tuple[str, int]], large: list[tuple[str, int]], tokens: int,
              top: int = 8) -> list[dict]:  # fmt: skip
    """The holders of the larger batch's peak (``large``, `PeakHolders.holders`), each with its
    bytes there and its growth a token from the smaller batch's (``small``; ``tokens`` more):
    the ``top`` largest by bytes and by growth either way, most growth first, then the rest as
    one (holders of either batch not shown), so that the growths add up to the bench's bytes a
    token. Where the two peaks lie at one place, that is what each holder adds a token; where
    they do not, it compares two instants of the step."""
    before = dict(small)
    rows = [{"held": name, "mib": n / 2**20,
             "kib_per_token": (n - before.get(name, 0)) / tokens / 2**10}
            for name, n in large]  # fmt: skip
    by_bytes = sorted(rows, key=lambda r: -r["mib"])[:top]
    by_growth = sorted(rows, key=lambda r: -abs(r["kib_per_token"]))[:top]
    shown = [r for r in rows if r in by_bytes or r in by_growth]
    shown.sort(key=lambda r: (-r["kib_per_token"], -r["mib"]))
    named = {r["held"] for r in shown}
    rest = [(name, n) for name, n in large if name not in named]
    rest_bytes = sum(n for _, n in rest)
    rest_before = sum(n for name, n in small if name not in named)
    if rest or rest_before:
        gone = len({name for name, _ in small} - {name for name, _ in large})
        words = f"the other {len(rest)} holders" + (f" ({gone} only at the smaller batch)"
                                                     if gone else "")  # fmt: skip
        shown.append({"held": words, "mib": rest_bytes / 2**20,
                      "kib_per_token": (rest_bytes - rest_before) / tokens / 2**10})  # fmt: skip
    return shown
