"""``dsq bench gemm``: one quantized GEMM on the unit its operands' formats allow, beside the same
GEMM in float32 (docs/dsq.md, "GEMM units").

Each row quantizes two random operands to their formats and times ``units.gemm`` on the unit
the plan would choose, conversion and padding included, against ``units.gemm`` in float32, the
two alternating within each repetition. The shapes default to the GEMMs of ``dsq bench step``'s
model (2,048 tokens, width 256, FFN 1,024) and a size sweep that shows where the bf16 unit
starts to pay (``units.MIN_MACS``).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from dsq.engine import units
from dsq.formats import parse_format

from .quant import machine_description

# (name, batch, m, k, n, format of a, format of b, a as a transposed view, b as one), laid out
# as the engine calls them: forward x W^T (W^T a view), dx = g W, dW = g^T stash (g^T a view)
GEMMS = (
    ("linear forward, FFN in", 1, 2048, 256, 1024, "bfp8", "bfp8", False, True),
    ("linear dx, FFN out", 1, 2048, 1024, 256, "bfp8", "bfp8", False, False),
    ("linear dW, FFN in", 1, 1024, 2048, 256, "bfp8", "bfp2", True, False),
    ("linear fwd, 256 x 256", 1, 2048, 256, 256, "bfp8", "bfp8", False, True),
    ("size 128 x 256 x 256", 1, 128, 256, 256, "bfp8", "bfp8", False, True),
    ("size 256 x 256 x 256", 1, 256, 256, 256, "bfp8", "bfp8", False, True),
    ("size 1024 x 256 x 256", 1, 1024, 256, 256, "bfp8", "bfp8", False, True),
    ("attention, 30 tokens", 256, 30, 64, 30, "bfp8", "bfp8", False, True),
)


def _operand(shape, spec: str, transposed: bool, dev: torch.device, seed: int) -> torch.Tensor:
    """A [..., r, c] operand in ``spec`` with blocks along the GEMM's reduction (c for a, r for
    b is the caller's choice of shape), stored transposed when ``transposed``."""
    g = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    if transposed:
        x = torch.randn(*lead, cols, rows, generator=g)
        return parse_format(spec).quantize(x, axis=-2).to(dev).transpose(-1, -2)
    return parse_format(spec).quantize(torch.randn(*shape, generator=g), axis=-1).to(dev)


def _time(fn, dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def run(repeats: int = 11, device: str = "cpu") -> dict:
    dev = torch.device(device)
    rows = []
    for name, batch, m, k, n, fa, fb, ta, tb in GEMMS:
        lead = (batch,) if batch > 1 else ()
        a = _operand((*lead, m, k), fa, ta, dev, 1)
        b = _operand((*lead, k, n), fb, tb, dev, 2)
        how = units.plan(parse_format(fa), parse_format(fb), dev, macs=units.MIN_MACS)
        kind = f"bench.{name}"
        both = {"fp32": units.FP32, "unit": how}
        for setup in both.values():  # warm up: primitives, kernels, pages
            units.gemm(a, b, setup, kind)
            units.gemm(a, b, setup, kind)
        times: dict[str, list[float]] = {key: [] for key in both}
        for _ in range(repeats):
            for key, setup in both.items():
                times[key].append(_time(functools.partial(units.gemm, a, b, setup, kind), dev))
        fp32_ms = statistics.median(times["fp32"]) * 1e3
        unit_ms = statistics.median(times["unit"]) * 1e3
        rows.append(
            {
                "gemm": name,
                "shape": [batch, m, k, n],
                "formats": [fa, fb],
                "macs_per_matrix": m * k * n,
                "unit": how.unit,
                "fp32_ms": fp32_ms,
                "unit_ms": unit_ms,
                "speedup": fp32_ms / unit_ms,
            }
        )
    return {
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "repeats": repeats,
        "min_macs": units.MIN_MACS,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    lines = [
        f"dsq bench gemm: {result['machine']}, torch {result['torch']}, median of "
        f"{result['repeats']}, each unit beside float32 in every repetition",
        "",
        f"{'GEMM':<24} {'batch x m x k x n':<20} {'a / b':<12} {'unit':<6} {'fp32 ms':>9} "
        f"{'unit ms':>9} {'speed-up':>9}",
        "-" * 95,
    ]
    for r in result["rows"]:
        shape = " x ".join(str(d) for d in r["shape"])
        lines.append(
            f"{r['gemm']:<24} {shape:<20} {' / '.join(r['formats']):<12} {r['unit']:<6} "
            f"{r['fp32_ms']:>9.3f} {r['unit_ms']:>9.3f} {r['speedup']:>8.2f}x"
        )
    lines.append(
        "unit: the unit the operands' formats allow on this device, whatever the size (the "
        f"engine keeps GEMMs below {result['min_macs']:,} multiply-adds per matrix in float32); "
        "unit ms includes the conversion to bf16, its exactness check and the padding."
    )
    return "\n".join(lines)
