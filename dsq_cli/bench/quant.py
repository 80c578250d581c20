"""``dsq bench quant``: quantize / pack / unpack throughput beside a clone, measured in one run.

Each repetition times the operation and, right after it, ``x.clone()`` on the same tensor, so
the ratio of the two is taken under the same machine conditions (shared machines are noisy);
the table reports medians. GB/s counts the bytes an operation must read plus write. Below the
table, each operation a backend has no kernel for, and runs on the reference instead
(``dsq.formats.backends.missing_kernels``), is listed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable

import torch

from dsq.formats import bfp_compile, parse_format
from dsq.formats.backends import BACKENDS, missing_kernels, unavailable_reason


@dataclasses.dataclass
class Row:
    format: str
    backend: str
    op: str
    ms: float
    gbps: float
    clone_ms: float
    x_clone: float  # median over repetitions of (op time / clone time in the same repetition)
    bytes_moved: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(fn, x, device, repeats: int, warmup: int = 2) -> tuple[float, float, float]:
    """(median op seconds, median clone seconds, median per-repetition ratio)."""
    for _ in range(warmup):
        fn()
    ops, clones, ratios = [], [], []
    for _ in range(repeats):
        op = _timed(fn, device)
        clone = _timed(lambda: x.clone(), device)
        ops.append(op)
        clones.append(clone)
        ratios.append(op / clone)
    return statistics.median(ops), statistics.median(clones), statistics.median(ratios)


def _eager(fmt, x):
    """The compile backend's float32 code without torch.compile: what plain PyTorch costs."""
    if fmt.family == "bfp":
        return bfp_compile.eager_bfp_quantizer(x, fmt.man_bits, fmt.exp_bits, fmt.block)
    return None


def _peer_qtorch(fmt, x):
    from qtorch.quant import block_quantize  # optional: pip install qtorch

    return lambda: block_quantize(x.view(-1, fmt.block), wl=fmt.man_bits, dim=0)


def run(
    numel: int,
    specs: list[str],
    backends: list[str],
    repeats: int,
    device: str = "cpu",
    peers: bool = False,
    ops: tuple[str, ...] = ("quantize", "pack", "unpack"),
) -> dict:
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(numel, generator=g, device=dev)
    value_bytes = numel * x.element_size()
    formats = [parse_format(s) for s in specs]  # ValueError on a bad spec, before any work

    dst = torch.empty_like(x)
    copy_s, clone_s, copy_ratio = measure(lambda: dst.copy_(x), x, dev, repeats)
    rows = [
        Row(
            "-",
            "torch",
            "x.clone()",
            clone_s * 1e3,
            2 * value_bytes / clone_s / 1e9,
            clone_s * 1e3,
            1.0,
            2 * value_bytes,
        ),
        Row(
            "-",
            "torch",
            "copy_ (preallocated)",
            copy_s * 1e3,
            2 * value_bytes / copy_s / 1e9,
            clone_s * 1e3,
            copy_ratio,
            2 * value_bytes,
        ),
    ]
    skipped, fallbacks = [], []
    for fmt in formats:
        for backend in backends:
            reason = unavailable_reason(backend, dev.type) if backend in BACKENDS else None
            if reason is not None:
                skipped.append(f"{backend}: {reason}")
                continue
            if backend in BACKENDS and backend != "reference" and fmt.family is not None:
                fallbacks += [f"{backend}: {op}" for op in missing_kernels(backend, fmt.family)]
            reps = min(repeats, 2) if backend == "reference" else repeats
            if backend == "eager":
                fn = _eager(fmt, x)
                if fn is not None:
                    op_s, c_s, r = measure(fn, x, dev, reps)
                    rows.append(
                        Row(
                            fmt.spec,
                            "eager",
                            "quantize",
                            op_s * 1e3,
                            2 * value_bytes / op_s / 1e9,
                            c_s * 1e3,
                            r,
                            2 * value_bytes,
                        )
                    )
                continue
            packed = fmt.pack(x, backend=backend)
            for op in ops:
                if op == "quantize":
                    fn, moved = (lambda f=fmt, p=backend: f.quantize(x, backend=p)), 2 * value_bytes
                elif op == "pack":
                    fn, moved = (
                        (lambda f=fmt, p=backend: f.pack(x, backend=p)),
                        value_bytes + packed.nbytes,
                    )
                else:
                    fn, moved = (
                        (lambda p=backend, pk=packed: pk.unpack(backend=p)),
                        value_bytes + packed.nbytes,
                    )
                op_s, c_s, r = measure(fn, x, dev, reps)
                rows.append(
                    Row(fmt.spec, backend, op, op_s * 1e3, moved / op_s / 1e9, c_s * 1e3, r, moved)
                )
    if peers:
        if importlib.util.find_spec("qtorch") is None:
            skipped.append("peer qtorch: not installed (pip install qtorch)")
        else:
            for fmt in formats:
                if fmt.spec.startswith("bfp"):
                    op_s, c_s, r = measure(_peer_qtorch(fmt, x), x, dev, repeats)
                    rows.append(
                        Row(
                            fmt.spec,
                            "qtorch",
                            "quantize",
                            op_s * 1e3,
                            2 * value_bytes / op_s / 1e9,
                            c_s * 1e3,
                            r,
                            2 * value_bytes,
                        )
                    )
    return {
        "numel": numel,
        "device": str(dev),
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": [dataclasses.asdict(r) for r in rows],
        "skipped": sorted(set(skipped)),
        "on_the_reference": sorted(set(fallbacks)),
    }


def machine_description(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from dsq.kernels import onednn

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # the family tells CPUs apart that share a model name ("AMD EPYC"), and with it how fast
    # their bf16 GEMMs are (docs/dsq.md, "GEMM units")
    identity = onednn.cpu_vendor_family_model()
    family = f" (family {identity[1]})" if identity else ""
    return f"{cpu}{family}, {torch.get_num_threads()} threads"


def format_table(result: dict) -> str:
    lines = [
        f"dsq bench quant: {result['numel']:,} fp32 values "
        f"({result['numel'] * 4 / 2**20:.1f} MiB) on {result['device']} ({result['machine']}), "
        f"torch {result['torch']}, median of {result['repeats']}",
        "",
        f"{'format':<12} {'backend':<13} {'op':<22} {'ms':>9} {'GB/s':>7} {'x clone':>8}",
        "-" * 75,
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['format']:<12} {r['backend']:<13} {r['op']:<22} {r['ms']:>9.2f} "
            f"{r['gbps']:>7.2f} {r['x_clone']:>8.2f}"
        )
    for s in result["skipped"]:
        lines.append(f"skipped {s}")
    for s in result.get("on_the_reference", []):
        lines.append(f"no kernel, runs on the reference: {s}")
    lines.append("x clone: op time / x.clone() time, taken in the same repetition (median).")
    return "\n".join(lines)
