"""``dsq bench memory``: the largest batch whose training step fits a memory budget, per quant
preset.

The model, the batch and the step are ``dsq bench step``'s (`step.Setup`, `step.Batch`); a batch
is whole sentences of ``src_len`` tokens. What must fit is a step's total peak
(`step.StepMemory.total`): what was live before the step (parameters, Adam state) plus the most
the step held at once above it, measured by the allocator. Above a few sentences that peak is
close to affine in the number of sentences; below, a peak of the optimizer's update (gradients
and Adam's temporaries, the size of the parameters) can dominate, so a line through two small
batches may overshoot by far. The search (`largest_fitting`) therefore extrapolates from the two
largest batches known to fit, at most doubling each time, until one does not fit, and then
narrows [largest known to fit, smallest known not to] until the two are adjacent.

Each probe is one measured step. The first step of a preset, on the smallest batch, compiles its
kernels and allocates Adam's state, unmeasured; on the CPU a later shape compiles without
allocating tensors (the first step at a new shape peaks exactly as the next one does), so it is
measured at once, while on a GPU each shape gets an unmeasured step first (autotuning allocates).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import re
import time
from collections.abc import Callable

import torch

from dsq.engine import POINTS
from dsq.engine.chunked_output import DEFAULT_CHUNK_TOKENS

from .quant import machine_description
from .step import (
    HEAD_WORDS,
    MIB,
    Batch,
    Setup,
    StepMemory,
    baseline_ratios,
    loss_words,
    ratio_text,
    row_label,
    variants_of,
)

log = logging.getLogger(__name__)

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
NOTHING_FITS = dict.fromkeys(("state_mb", "step_peak_mb", "peak_mb"))
SMALL = (4, 8)  # sentences of the first two probes
GROWTH = 2  # a probe beyond every one that fits is at most this many times the largest of them


def parse_size(text: str) -> int:
    """Bytes in a size such as ``2GiB``, ``512MiB``, ``1.5GB`` or ``1000000``: binary units
    (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000; the unit's
    case does not matter. ``ValueError`` for anything else, or a size under one byte."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise ValueError(f"--budget: expected a size like 2GiB, 512MiB or 1.5GB, got {text!r}")
    size = int(float(match.group(1)) * UNITS[unit])
    if size < 1:
        raise ValueError(f"--budget must be at least one byte, got {text!r}")
    return size


@dataclasses.dataclass(frozen=True)
class Search:
    """The outcome of `largest_fitting`: ``sentences``, the largest size whose peak fits (0 when
    not even one sentence does), and ``peaks``, every size probed and its peak in bytes, in the
    order probed (``inf``: it did not fit on the device at all)."""

    sentences: int
    peaks: dict[int, float]

    @property
    def peak(self) -> float | None:
        """The measured peak at ``sentences`` (None when nothing fits)."""
        return self.peaks.get(self.sentences)


def _line(points: list[tuple[int, float]], budget: int) -> int | None:
    """The largest size at or under ``budget`` on the line through two (size, peak) points; None
    when the line does not rise (or runs to infinity)."""
    (n1, p1), (n2, p2) = sorted(points)
    if n1 == n2 or not p1 < p2 < math.inf:
        return None
    return n1 + int((budget - p1) * (n2 - n1) // (p2 - p1))


def largest_fitting(
    peak_of: Callable[[int], float], budget: int, small: tuple[int, int] = SMALL
) -> Search:
    """The largest number of sentences ``n`` with ``peak_of(n) <= budget`` and
    ``peak_of(n + 1) > budget``, both measured, for a peak that grows with ``n``.

    ``peak_of`` is measured at the two ``small`` sizes first. While every size measured fits,
    the next probe is where the line through the two largest crosses the budget, plus one (the
    first size it predicts not to fit), but at most `GROWTH` times the largest (a line through
    small batches can overshoot far), and at least 1, 2, 4, ... sentences beyond it when the
    line keeps falling short. Then each probe lies strictly inside the bracket [largest size
    known to fit, smallest known not to]: where the line through the two measurements nearest
    the budget crosses it or, when the last such probe did not halve the bracket, its middle.
    For a peak on its line that is two probes after the first that overshoots.
    """
    peaks = {n: peak_of(n) for n in small}
    candidate, creep, line_from = None, 0, None
    while True:
        if candidate is not None and candidate not in peaks:
            peaks[candidate] = peak_of(candidate)
        fit = sorted(n for n, p in peaks.items() if p <= budget)
        lo = fit[-1] if fit else 0
        hi = min((n for n, p in peaks.items() if p > budget and n > lo), default=None)
        if hi == lo + 1:
            return Search(lo, peaks)
        if hi is None:  # every size measured fits: go beyond
            line = _line([(n, peaks[n]) for n in fit[-2:]], budget)
            want = lo + 2**creep if line is None else max(line + 1, lo + 2**creep)
            if want >= GROWTH * lo:
                candidate = GROWTH * lo
            else:
                candidate, creep = want, creep + 1
            continue
        line = None
        if line_from is None or hi - lo <= line_from / 2:  # the last line probe halved it
            below = [(lo, peaks[lo])] if lo else []
            above = sorted((n, p) for n, p in peaks.items() if n >= hi)[: 2 - len(below)]
            line = _line(below + above, budget) if len(below + above) == 2 else None
        line_from = None if line is None else hi - lo
        candidate = (lo + hi) // 2 if line is None else min(max(line, lo + 1), hi - 1)


def probe(setup: Setup, batch: Batch, warm_up: bool) -> StepMemory | None:
    """The memory of a training step on ``batch``, after one unmeasured step of the same shape
    if ``warm_up``; None when the device ran out of memory."""
    try:
        if warm_up:
            setup.step(batch)
        return setup.memory(batch)
    except torch.OutOfMemoryError:
        setup.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return None


def run(
    presets: list[str],
    budget: int,
    layers: int,
    width: int,
    src_len: int,
    vocab: int = 8000,
    device: str = "cpu",
    scopes: tuple[str, ...] = ("gemm",),
    checkpointing: tuple[bool, ...] = (False,),
    fp32_head: bool = False,
    loss_chunk: int = DEFAULT_CHUNK_TOKENS,
) -> dict:
    dev = torch.device(device)
    rows = []
    for name in presets:
        for variant in variants_of(name, scopes, ("auto",), checkpointing, fp32_head, loss_chunk):
            rows.append(_search(name, variant, budget, layers, width, src_len, vocab, dev))
            gc.collect()  # the row's model, optimizer and probes, before the next row's
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    baseline_ratios(rows, "tokens")
    return {
        "budget_mb": budget / MIB,
        "layers": layers,
        "width": width,
        "src_len": src_len,
        "vocab": vocab,
        "head": "fp32" if fp32_head else "quantized",
        "loss_chunk": loss_chunk,
        "threads": torch.get_num_threads(),
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "rows": rows,
    }


def _search(name, variant, budget, layers, width, src_len, vocab, dev) -> dict:
    """One row: the largest batch of ``name`` trained as ``variant`` that fits ``budget``."""
    start = time.perf_counter()
    setup = Setup.build(name, variant, layers, width, vocab, dev)
    setup.step(Batch.random(SMALL[0], src_len, vocab, dev))  # compile; Adam's state
    measured: dict[int, StepMemory | None] = {}

    def peak_of(sentences: int) -> float:
        batch = Batch.random(sentences, src_len, vocab, dev)
        memory = measured[sentences] = probe(setup, batch, warm_up=dev.type == "cuda")
        total = math.inf if memory is None else memory.total
        log.info("%s: %d tokens, peak %.1f MiB", name, batch.tokens, total / MIB)
        return total

    search = largest_fitting(peak_of, budget)
    memory = measured.get(search.sentences)
    row = {
        "preset": name,
        "row": row_label(name, variant),
        "scope": variant.scope,
        "checkpointing": variant.checkpointing,
        "fp32_head": variant.fp32_head,
        "points": setup.points,
        "sentences": search.sentences,
        "tokens": search.sentences * src_len,
        **(memory.as_dict() if memory else NOTHING_FITS),
        "probes": [
            {"tokens": n * src_len, "peak_mb": p / MIB if p < math.inf else None}
            for n, p in search.peaks.items()
        ],
        "seconds": time.perf_counter() - start,
    }
    return row


def format_table(result: dict) -> str:
    lines = [
        f"dsq bench memory: the largest batch whose training step fits {result['budget_mb']:.0f} "
        f"MiB; fairseq transformer, {result['layers']}+{result['layers']} layers, width "
        f"{result['width']}, sentences of {result['src_len']} tokens, vocab {result['vocab']} "
        f"(output projection {HEAD_WORDS[result['head']]}; {loss_words(result['loss_chunk'])}), "
        f"{result['machine']}, torch {result['torch']}",
        "",
        f"{'row':<22} {'q0 / q1 / q2 / q3':<40} {'tokens':>8} {'x fp32':>7} {'x amp':>7} "
        f"{'peak MiB':>9} {'state MiB':>10} {'probes':>6} {'s':>6}",
        "-" * 121,
    ]
    for r in result["rows"]:
        pts = " / ".join(str(r["points"][p]) for p in POINTS)
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}"
        state = "-" if r["state_mb"] is None else f"{r['state_mb']:.1f}"
        lines.append(
            f"{r['row']:<22} {pts:<40} {r['tokens']:>8} {ratio_text(r['x_fp32']):>7} "
            f"{ratio_text(r['x_amp_bf16']):>7} {peak:>9} {state:>10} {len(r['probes']):>6} "
            f"{r['seconds']:>6.0f}"
        )
    lines.append(
        "row: the preset, then what sets the row apart (all: stash_scope=all; ckpt: every layer "
        "checkpointed; fp32-head: the output projection left fp32). tokens: source tokens per "
        "batch (whole sentences) of the largest batch that fits; x fp32, x amp: those tokens "
        "over fp32's and amp_bf16's (torch.autocast bf16); peak MiB: its training step's peak, "
        "measured: state MiB (parameters and Adam state) + the most the step held at once above "
        "it (allocator); probes: batches measured, one step each; s: seconds for the row."
    )
    return "\n".join(lines)
