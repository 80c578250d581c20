"""``dsq bench step --breakdown``: where one training step's time goes, per row.

One step of each row runs under torch.profiler with shapes recorded. Every operator's own time
(its time less that of the operators it called) goes to one category:

- ``gemm <dtype>``: matrix products by the dtype they ran in (``aten::mm``, ``addmm``, ``bmm``,
  and the engine's exact bf16 GEMMs, ``dsq::gemm_bf16``), with their rate in GFLOP/s from the
  operands' shapes, beside the unit's peak measured here on a large square product;
- ``attention (fused)``: torch's scaled-dot-product attention kernels (an unpatched model's);
- ``attention (unfused)``: attention computed by separate operators, not one fused kernel: the
  softmax with its backward, which only attention runs in these models (the loss's is a
  log-softmax), and the own time of DSQ's tiled attention ops (``dsq::attention_*``: the host
  work around their tiles); its GEMMs are counted as GEMMs;
- ``quantizers``: the engine's C and compiled quantize, pack and decode kernels (``dsq::*``
  other than the GEMMs and conversions, and torch.compile's regions);
- ``casts``: conversions to bf16 (``dsq::to_bf16``, ``split_bf16``; autocast's copies);
- ``optimizer``: everything under ``Optimizer.step``;
- ``other``: every other operator (layer norms, dropout, masks, additions), and the engine's
  autograd functions, which the profiler records as operators: their own time is their Python.

What the profiler does not see, the Python of the model and of the engine outside its autograd
functions, is the step's profiled wall time less the sum of those: ``python``. The profiler
slows small operators down, so the categories are shares of a profiled step, not of the timed
one.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
DSQ_GEMMS = {"dsq::gemm_bf16": (0, 1)}
CASTS = ("dsq::to_bf16", "dsq::split_bf16", "aten::_to_copy", "aten::copy_")
SOFTMAX = ("aten::_softmax", "aten::_softmax_backward_data")
COMPILED = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")
_DTYPE = {"c10::BFloat16": "bf16", "float": "fp32", "c10::Half": "fp16"}


def gemm_flops(shapes: list, operands: tuple[int, int]) -> float:
    """2 m k n (times the batch) for operands ``[..., m, k]`` and ``[..., k, n]``."""
    a, b = shapes[operands[0]], shapes[operands[1]]
    if len(a) < 2 or len(b) < 2:
        return 0.0
    batch = 1
    for size in a[:-2]:
        batch *= size
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def category(event, in_optimizer: bool) -> tuple[str, float]:
    """(category, FLOPs if a GEMM) of one profiled operator."""
    name = event.name
    if in_optimizer:
        return "optimizer", 0.0
    operands = GEMM_OPS.get(name) or DSQ_GEMMS.get(name)
    if operands is not None:
        dtypes = event.input_dtypes or []
        dtype = "bf16" if name in DSQ_GEMMS else _DTYPE.get(dtypes[operands[0]], "other")
        return f"gemm {dtype}", gemm_flops(event.input_shapes or [], operands)
    if "scaled_dot_product" in name:
        return "attention (fused)", 0.0
    if name.startswith("dsq::attention") or name in SOFTMAX:
        return "attention (unfused)", 0.0
    if name in CASTS:
        return "casts", 0.0
    if name.startswith("dsq::") or name.startswith(COMPILED):
        return "quantizers", 0.0
    return "other", 0.0


def profile_step(step, batch) -> dict:
    """Profile ``step(batch)`` once: its wall time, the time of each category (ms) and each
    GEMM dtype's rate (GFLOP/s)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        step(batch)
        wall = time.perf_counter() - start
    events = prof.events()
    optimizer = set()
    for event in events:
        parent, inside = event.cpu_parent, event.name.startswith("Optimizer.step")
        while parent is not None and not inside:
            inside = parent.name.startswith("Optimizer.step")
            parent = parent.cpu_parent
        if inside:
            optimizer.add(event.id)
    ms: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        name, work = category(event, event.id in optimizer)
        ms[name] += event.self_cpu_time_total / 1e3
        flops[name] += work
    ms["python"] = max(0.0, wall * 1e3 - sum(ms.values()))
    rates = {
        name.split(" ", 1)[1]: flops[name] / (ms[name] / 1e3) / 1e9
        for name in flops
        if flops[name] and ms[name]
    }
    return {"wall_ms": wall * 1e3, "ms": dict(ms), "gemm_gflops": rates}


def unit_peaks(device: torch.device, size: int = 1024, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a [2 size, size] x [size, size] product in bf16 and in fp32, the best of
    ``repeats``: the rate each unit reaches here on a GEMM large enough to fill it."""
    peaks = {}
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(2 * size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        peaks[label] = 2.0 * 2 * size * size * size / best / 1e9
    return peaks


CATEGORY_ORDER = ("gemm bf16", "gemm fp32", "attention (fused)", "attention (unfused)",
                  "quantizers", "casts", "other", "optimizer", "python")  # fmt: skip


def format_breakdown(result: dict) -> str:
    """The rows' breakdowns as a table: ms per category, then each GEMM dtype's rate against
    its unit's peak."""
    peaks = result["unit_peaks"]
    profiled = [(_label(row), row["breakdown"]) for row in result["rows"] if row.get("breakdown")]
    width = max([22] + [len(label) for label, _ in profiled])
    lines = [
        "",
        "Where one profiled step's time goes (ms; docs/benchmarks.md): GEMMs by dtype, with "
        f"rate in GFLOP/s and share of the unit's peak here (bf16 {peaks['bf16']:.0f}, fp32 "
        f"{peaks['fp32']:.0f} GFLOP/s on a {2 * 1024}x1024x1024 product)",
        "",
        f"{'row':<{width}} {'wall':>7} " + " ".join(f"{c:>{max(10, len(c))}}"
                                                   for c in CATEGORY_ORDER)
        + "   GEMM rates",
    ]  # fmt: skip
    for label, b in profiled:
        cells = " ".join(f"{b['ms'].get(c, 0.0):>{max(10, len(c))}.1f}" for c in CATEGORY_ORDER)
        rates = ", ".join(
            f"{dtype} {rate:.0f} ({rate / peaks[dtype]:.0%})" if dtype in peaks else dtype
            for dtype, rate in sorted(b["gemm_gflops"].items())
        )
        lines.append(f"{label:<{width}} {b['wall_ms']:>7.1f} {cells}   {rates}")
    return "\n".join(lines)


def _label(row: dict) -> str:
    """A row's name, with its tokens a sequence where rows differ in that (transformers
    models)."""
    seq_len = row.get("seq_len")
    return row["row"] if seq_len is None else f"{row['row']}, {seq_len:,} a sequence"
