"""Device check of the Triton path: bit-exactness against the reference, then bandwidth.

On a CUDA machine:
  (a) the Triton path equals the reference bit for bit (values, -0.0, NaN positions, packed
      bytes) on CUDA tensors, for a few formats, random and edge-case tensors;
  (b) timings (torch.cuda.Event, warmup then REPEATS runs) for 2^24 and 2^26 float32 values:
      bfp4 / bfp8 / fixed16 quantize, pack, unpack next to a device copy (``y.copy_(x)``) and
      ``x.clone()``, with GB/s counted as the bytes the op reads plus writes, and each op's GB/s
      relative to the copy's; the engine's fused pairs (q0 plus the stash, q3 plus q2) against
      their two calls; the engine's GEMM units (bf16, TF32, bf16x2: exact on integer operands,
      then timed against a float32 GEMM); a training step per preset with its GEMMs on their
      units (quant.gemm_unit=auto) and all in float32, against fp32, and fp32 under bf16
      autocast.
Without CUDA it sets TRITON_INTERPRET=1 and runs (a) on tiny CPU tensors, skipping (b).

Prints PASS/FAIL lines; exits 1 if any bit-exact check fails.
Usage: scripts/gpu_check.sh [--sizes 24,26] [--repeats 20] [--skip-timing]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsq.formats import bfp_reference as ref  # noqa: E402
from dsq.formats import bfp_triton as tp  # noqa: E402
from dsq.formats import fixed_reference as rf  # noqa: E402
from dsq.formats import fixed_triton as tf  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
FAILS: list[str] = []


# ----------------------------------------------------------------------------- (a) exactness
def same(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if bit-identical (dtype, shape, NaN positions, float32 bits), else why not."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a, b = a.float(), b.float()
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return f"NaN positions differ ({int((an != bn).sum())} elements)"
    ab = torch.where(an, 0, a.view(torch.int32))
    bb = torch.where(bn, 0, b.view(torch.int32))
    if not torch.equal(ab, bb):
        i = (ab != bb).nonzero()[0]
        return f"{int((ab != bb).sum())} values differ, e.g. at {tuple(i.tolist())}: " + (
            f"{a[tuple(i)].item()!r} vs {b[tuple(i)].item()!r}"
        )
    return None


def report(name: str, problem: str | None) -> None:
    if problem is None:
        print(f"PASS {name}")
    else:
        print(f"FAIL {name}: {problem}")
        FAILS.append(name)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def check_bfp(name, x, m, E, B, axis, rounding):
    want = ref.bfp_quantize(x, m, E, B, axis, rounding, gen(1))
    got = tp.bfp_quantize(x, m, E, B, axis, rounding, gen(1))
    problem = same(got, want)
    if problem is None:
        rm, re_ = ref.bfp_pack(x, m, E, B, axis, rounding, gen(1))
        gm, ge = tp.bfp_pack(x, m, E, B, axis, rounding, gen(1))
        if not torch.equal(gm, rm):
            problem = "mantissa stream differs"
        elif not torch.equal(ge, re_):
            problem = "exponent stream differs"
        else:
            out = tp.bfp_unpack(gm, ge, m, E, B, tuple(x.shape), axis, x.dtype)
            problem = same(out, want)
            problem = None if problem is None else "unpack: " + problem
    report(name, problem)


def check_fixed(name, x, w, f, rounding):
    want = rf.fixed_static_quantize(x, w, f, rounding, gen(2))
    got = tf.fixed_static_quantize(x, w, f, rounding, gen(2))
    problem = same(got, want)
    if problem is None:
        ri, rn = rf.fixed_static_pack(x, w, f, rounding, gen(2))
        gi, gn = tf.fixed_static_pack(x, w, f, rounding, gen(2))
        if not torch.equal(gi, ri):
            problem = "integer stream differs"
        elif (gn is None) != (rn is None) or (gn is not None and not torch.equal(gn, rn)):
            problem = "NaN mask stream differs"
        else:
            out = tf.fixed_static_unpack(gi, gn, w, f, tuple(x.shape), x.dtype)
            problem = same(out, want)
            problem = None if problem is None else "unpack: " + problem
    report(name, problem)


def edge_tensor() -> torch.Tensor:
    nan, inf = math.nan, math.inf
    rows = [
        [0.0] * 16,
        [-0.0] * 16,
        [1.0, nan] + [2.0] * 14,
        [inf] + [1.0] * 15,
        [1e-40, -1e-40, 1.4e-45, -1.4e-45, 0.0, -0.0, 5e-39, 1.1754942e-38] * 2,
        [3.4e38, -3.4e38, 1.0, -1e-38, 3.4028235e38, 1e30, 0.0, -0.0] * 2,
        [1e30, 1e-30, -1e-40, -1e30, 1.0, -1.0, 2.5e29, -0.0] * 2,
        [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 4.0, 0.25, 0.75, -0.75, 5.5, 6.5, 7.5, -7.5],
        [-0.3, 0.3, 2.9, -1.7, 0.05, 0.0, -0.0, 1e-3, -1e-3, 0.1, -0.1, 0.2, -0.2, 0.4, -0.4, 1],
    ]
    return torch.tensor(rows, dtype=torch.float32, device=DEVICE)


def random_tensor(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g))
    r = torch.rand(shape, generator=g)
    ties = (torch.randint(-40, 40, shape, generator=g) + 0.5) * 0.25
    x = torch.where(r < 0.1, ties, x)
    x = torch.where((r >= 0.1) & (r < 0.12), -0.0, x)
    x = torch.where(r > 0.9999, math.nan, x)
    return x.to(DEVICE)


def exactness() -> None:
    shape = (257, 1031) if CUDA else (13, 37)
    x = random_tensor(shape, 0)
    edges = edge_tensor()
    small = random_tensor((5, 3, 7), 1)
    for rounding in ("nearest", "stochastic"):
        for m, E, B in [(4, 8, 16), (8, 8, 16), (3, 5, 3), (16, 10, 33), (24, 8, 1), (2, 2, 16)]:
            fmt = f"bfp{m}e{E}b{B}"
            for axis in (0, 1):
                check_bfp(f"{fmt} {rounding} random{tuple(x.shape)} axis={axis}", x, m, E, B,
                          axis, rounding)  # fmt: skip
            check_bfp(f"{fmt} {rounding} edges", edges, m, E, B, 1, rounding)
            check_bfp(f"{fmt} {rounding} transposed", x.t(), m, E, B, 0, rounding)
            check_bfp(f"{fmt} {rounding} bf16 3-d axis=1", small.bfloat16(), m, E, B, 1, rounding)
        for w in (8, 16, 32):
            check_bfp(f"fixed{w} {rounding} random", x, w, 8, None, 0, rounding)
            check_bfp(f"fixed{w} {rounding} edges", edges, w, 8, None, 0, rounding)
        for w, f in [(8, 4), (16, 8), (32, 30), (2, 0)]:
            check_fixed(f"fixed{w}f{f} {rounding} random", x, w, f, rounding)
            check_fixed(f"fixed{w}f{f} {rounding} edges", edges, w, f, rounding)
    check_bfp("bfp4 0-dim", torch.tensor(-2.75, device=DEVICE), 4, 8, 16, 0, "nearest")
    # the fused pairs, on tensors whose last axis the quantizer's blocks tile
    tiled = [random_tensor((1031, 256) if CUDA else (37, 64), 2), random_tensor((3, 21, 32), 3),
             edges]  # fmt: skip
    for q, p in [((8, 8, 16), (2, 8, 16)), ((8, 8, 16), (4, 8, 16)), ((4, 6, 8), (11, 8, 4))]:
        for t in tiled:
            check_quantize_and_pack(f"fused q{q} + stash{p} {tuple(t.shape)}", t, q, p)
    for f, s in [((16, 8, None), (8, 8, 16)), ((8, 8, None), (3, 8, 16))]:
        for t in tiled:
            check_quantize_chain(f"fused {f} then {s} {tuple(t.shape)}", t, f, s)


def check_quantize_and_pack(name, x, q_args, p_args):
    last, before = x.dim() - 1, x.dim() - 2
    if not tp.fusable_quantize_and_pack(x, q_args, last, p_args, before):
        return report(name, "not fusable")
    values, man, exps = tp.bfp_quantize_and_pack(x, q_args, last, p_args, before)
    problem = same(values, ref.bfp_quantize(x, *q_args, last))
    rm, re_ = ref.bfp_pack(x, *p_args, before)
    if problem is None and not (torch.equal(man, rm) and torch.equal(exps, re_)):
        problem = "stash streams differ"
    report(name, problem)


def check_quantize_chain(name, x, first_args, second_args):
    last = x.dim() - 1
    if not tp.fusable_quantize_chain(x, first_args, 0, second_args, last):
        return report(name, "not fusable")
    first, second = tp.bfp_quantize_chain(x, first_args, 0, second_args, last)
    want = ref.bfp_quantize(x, *first_args, 0)
    problem = same(first, want) or same(second, ref.bfp_quantize(want, *second_args, x.dim() - 1))
    report(name, problem)


# ----------------------------------------------------------------------------- (b) timings
def cuda_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(start, end, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end, strict=True))
    return times[len(times) // 2]  # median


def time_size(n: int, repeats: int) -> list[tuple[str, float, int]]:
    """(op, ms, bytes read + written) for n float32 values, the device copy first."""
    formats = [("bfp4", 4, 8, 16), ("bfp8", 8, 8, 16), ("fixed16", 16, 8, None)]
    x = torch.randn(n // 4096, 4096, device=DEVICE)
    y = torch.empty_like(x)
    shape = tuple(x.shape)
    rows = [("copy y.copy_(x)", cuda_ms(lambda: y.copy_(x), repeats), 8 * n)]
    rows.append(("x.clone()", cuda_ms(lambda: x.clone(), repeats), 8 * n))
    for name, m, E, B in formats:
        n_exp = 1 if B is None else n // B
        packed = math.ceil(n * m / 8) + math.ceil(n_exp * E / 8)
        man, exps = tp.bfp_pack(x, m, E, B, -1)

        def quantize(m=m, E=E, B=B):
            return tp.bfp_quantize(x, m, E, B, -1)

        def pack(m=m, E=E, B=B):
            return tp.bfp_pack(x, m, E, B, -1)

        def unpack(m=m, E=E, B=B, man=man, exps=exps):
            return tp.bfp_unpack(man, exps, m, E, B, shape, -1, torch.float32)

        rows.append((f"{name} quantize", cuda_ms(quantize, repeats), 8 * n))
        rows.append((f"{name} pack", cuda_ms(pack, repeats), 4 * n + packed))
        rows.append((f"{name} unpack", cuda_ms(unpack, repeats), packed + 4 * n))
    return rows


def fused_pairs(repeats: int) -> None:
    """The engine's fused pairs against their two calls, on a linear layer's [tokens, width]."""
    print(f"\nfused pairs, [16384, 1024] float32, median of {repeats} runs")
    x = torch.randn(16384, 1024, device=DEVICE)
    q0, q1, q2, q3 = (8, 8, 16), (2, 8, 16), (8, 8, 16), (16, 8, None)
    pairs = [
        ("q0(x) + stash, two calls",
         lambda: (tp.bfp_quantize(x, *q0, 1), tp.bfp_pack(x, *q1, 0))),
        ("q0(x) + stash, fused", lambda: tp.bfp_quantize_and_pack(x, q0, 1, q1, 0)),
        ("q3(dy) + q2(g), two calls",
         lambda: tp.bfp_quantize(tp.bfp_quantize(x, *q3, 0), *q2, 1)),
        ("q3(dy) + q2(g), fused", lambda: tp.bfp_quantize_chain(x, q3, 0, q2, 1)),
        ("x.clone()", lambda: x.clone()),
    ]  # fmt: skip
    for name, fn in pairs:
        print(f"{name:<28}{cuda_ms(fn, repeats):>9.3f} ms")


def bf16_step(repeats: int) -> None:
    """The fp32 step of training_step's model under bf16 autocast, beside plain fp32."""
    dev = torch.device("cuda")
    try:
        from dsq_cli.bench import step

        setup = step.Setup.build("fp32", step.Variant(), 6, 512, 8000, dev)
    except ImportError as err:  # fairseq missing on the GPU machine
        print(f"bf16 step skipped: {err}")
        return
    batch = step.Batch.random(4096 // 32, 32, 8000, dev)

    def bf16():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            setup.step(batch)

    fp32_ms = cuda_ms(lambda: setup.step(batch), repeats)
    bf16_ms = cuda_ms(bf16, repeats)
    print(f"\nstep of the same model: fp32 {fp32_ms:.2f} ms, bf16 autocast {bf16_ms:.2f} ms "
          f"({bf16_ms / fp32_ms:.2f}x fp32)")  # fmt: skip


def gemm_units_exactness() -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's CUDA units (bf16, TF32, bf16x2) on integer-valued operands, whose products and
    sums are exact: each must equal the float64 product bit for bit. Returns the operands, the
    benchmark model's FFN shape, for gemm_units' timing."""
    from dsq.engine import units

    gen_ = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(-8, 9, (4096, 512), device="cuda", generator=gen_).float()
    b = torch.randint(-8, 9, (512, 2048), device="cuda", generator=gen_).float()
    wide = a * 256 + torch.randint(-8, 9, a.shape, device="cuda", generator=gen_)  # 12+ bits
    exact = (a.double() @ b.double()).float()
    for name, left, plan, expected in (
        ("bf16", a, units.GemmPlan("bf16"), exact),
        ("tf32", a, units.GemmPlan("tf32"), exact),
        ("bf16x2", wide, units.GemmPlan("bf16x2", split="a"), (wide.double() @ b.double()).float()),
    ):
        out = units.gemm(left, b, plan, f"gpu_check.{name}")
        report(f"GEMM unit {name} (integers)", same(out, expected))
    return a, b


def gemm_units() -> None:
    """gemm_units_exactness, then each unit's time against a float32 GEMM of the same shape."""
    from dsq.engine import units

    a, b = gemm_units_exactness()
    print(f"\nGEMM units, [4096, 512] @ [512, 2048]: {units.tally()}")
    fp32_ms = cuda_ms(lambda: a @ b, 20)
    for name, plan in (("bf16", units.GemmPlan("bf16")), ("tf32", units.GemmPlan("tf32"))):
        ms = cuda_ms(lambda plan=plan: units.gemm(a, b, plan, "gpu_check.time"), 20)
        print(f"{name:<8}{ms:>9.3f} ms  ({fp32_ms / ms:.2f}x the float32 GEMM's {fp32_ms:.3f} ms)")


def timings(log2_sizes, repeats: int) -> None:
    print(f"\n{torch.cuda.get_device_name()}, median of {repeats} runs after 3 warmups")
    for log2n in log2_sizes:
        n = 2**log2n
        rows = time_size(n, repeats)
        torch.cuda.empty_cache()
        copy_gbs = rows[0][2] / rows[0][1] / 1e6
        print(f"\n2^{log2n} float32 values ({4 * n / 2**20:.0f} MiB)")
        print(f"{'op':<20}{'ms':>9}{'GB/s':>9}{'vs copy':>9}")
        for name, ms, nbytes in rows:
            gbs = nbytes / ms / 1e6
            print(f"{name:<20}{ms:>9.3f}{gbs:>9.0f}{gbs / copy_gbs:>9.2f}")


def training_step() -> None:
    """A training step of a fairseq transformer per preset against fp32 (dsq bench step)."""
    try:
        from dsq_cli.bench import step

        result = step.run(
            ["fp32", "bfp8", "stash_bfp", "dsq"],
            layers=6,
            width=512,
            tokens=4096,
            src_len=32,
            repeats=10,
            device="cuda",
            gemm_units=("auto", "fp32"),  # each GEMM on its exact unit, and all in float32
        )
    except ImportError as err:  # fairseq missing on the GPU machine: keep the kernel results
        print(f"training step skipped: {err}")
        return
    print(step.format_table(result))


def attention(repeats: int) -> None:
    """Tiled attention (docs/dsq.md, "Attention in tiles") on the GPU: equal to the explicit path
    to float32 summation order (dsq, mx_dsq and nvfp4_dsq, causal, grouped-query), then forward plus
    backward time and the allocator's peak against the explicit path and SDPA under bf16
    autocast, a Llama-style layer's attention (8 heads, 4 key/value heads of 64), 4 sequences."""
    from dsq.engine import QuantConfig
    from dsq.engine.attention import dsq_attention, explicit_attention

    def inputs(n, b=4, seed=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        shapes = ((b, 8, n, 64), (b, 4, n, 64), (b, 4, n, 64), (b, 8, n, 64))
        t = [torch.randn(s, device=DEVICE, generator=g) for s in shapes]
        return [x.requires_grad_() for x in t[:3]] + [t[3]]

    # dsq and mx_dsq run the Triton kernels (dsq/kernels/attention.py), nvfp4_dsq the torch
    # kernel; their tolerance is tests/dsq/kernels/test_attention_triton.py's: within 1e-4 of the
    # largest value but in at most 1% of the values (a value moved by one quantum), within 1e-2
    for preset in ("dsq", "mx_dsq", "nvfp4_dsq"):
        cfg = QuantConfig.from_preset(preset)
        q, k, v, d_out = inputs(200, b=2)
        want, _ = explicit_attention(q, k, v, cfg, scaling=0.125, causal=True)
        got = dsq_attention(q, k, v, cfg, scaling=0.125, causal=True, tile_rows=64)
        pairs = zip((got, *torch.autograd.grad(got, (q, k, v), d_out)),
                    (want, *torch.autograd.grad(want, (q, k, v), d_out)))  # fmt: skip
        errors = [(a - b).abs() / b.abs().max() for a, b in pairs]
        worst = max(float(e.max()) for e in errors)
        moved = max(float((e > 1e-4).float().mean()) for e in errors)
        problem = None if worst <= 1e-2 and moved <= 0.01 else "beyond one quantum's moves"
        report(f"attention tiled = explicit, {preset} (worst {worst:.1e} of the largest, "
               f"{moved:.2%} beyond 1e-4)", problem)  # fmt: skip
    from dsq_cli.bench import attention as attention_bench

    print()
    result = attention_bench.run((1024, 2048, 4096), batch=4, repeats=repeats, device=DEVICE)
    print(attention_bench.format_table(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="24,26", help="log2 of the timed sizes")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    where = torch.cuda.get_device_name() if CUDA else "CPU, TRITON_INTERPRET=1 (tiny sizes)"
    print(f"Triton path check on {where}; torch {torch.__version__}")
    t0 = time.time()
    exactness()
    print(f"bit-exact checks: {len(FAILS)} failed ({time.time() - t0:.1f} s)")
    if not CUDA:
        print("timings skipped: they need a CUDA device")
    elif not args.skip_timing:
        timings([int(s) for s in args.sizes.split(",")], args.repeats)
        fused_pairs(args.repeats)
        gemm_units()
        attention(5)
        training_step()
        bf16_step(10)
    if FAILS:
        print(f"FAIL: {len(FAILS)} bit-exact check(s) failed: {', '.join(FAILS[:10])}")
        return 1
    print("PASS: all bit-exact checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
