"""The C kernels of ``bfp_cpu.c`` (BFP and fixed<w> with nearest rounding, on CPU tensors).

The source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
the machine's own CPU (``-march=native``) with OpenMP, each dropped if the compiler refuses it,
and loaded with ctypes. The library is cached in ``$DSQ_CACHE/c-kernels`` (default
``~/.cache/dsq``) under a name that hashes the source, the flags, the compiler's version and
the CPU's model and feature flags, so a cluster's shared home never hands one node's build to
another kind of CPU. The build writes a temporary file and renames it into place, so
concurrent first uses (test workers, ranks) never load half a file.

Like ``bfp.py`` this module knows nothing of ``dsq_cli``: its wrappers take contiguous float32
(or uint8) CPU tensors laid out as ``bfp_cpu.c`` states and return new tensors. The host glue
is ``dsq_cli/formats/compiled.py``, which decides what runs here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("bfp_cpu.c")
# IEEE arithmetic, no contraction into fused multiply-adds: the kernels' exactness argument
# (bfp_cpu.c's header) counts every rounding.
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
# Tried in order until one builds: the machine's own instruction set, and OpenMP threads. At run
# time the OpenMP calls bind to the libgomp torch has already loaded (same soname), so the
# kernels share torch's thread pool and follow torch.set_num_threads.
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the message says why)."""


def _compiler() -> str:
    name = os.environ.get("CC") or "cc"
    found = shutil.which(name) or (shutil.which("gcc") if "CC" not in os.environ else None)
    if found is None:
        raise BuildError(f"no C compiler ({name}) on PATH; set CC to one")
    return found


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows of it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    picked = {line.split(":")[0].strip(): line for line in lines if line.startswith(wanted)}
    return "\n".join(sorted(picked.values())) or f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    root = os.environ.get("DSQ_CACHE") or Path.home() / ".cache" / "dsq"
    return Path(root) / "c-kernels"


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` atomically; the compiler's complaint, or None on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", temporary],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
        os.replace(temporary, target)
        return None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built first if this machine has no cached build; BuildError if not."""
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    source = SOURCE.read_bytes()
    complaint = None
    for flags in (FLAGS + variant for variant in VARIANTS):
        key = hashlib.sha256(
            b"\0".join(
                [source, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()]
            )
        ).hexdigest()[:20]
        target = cache_dir() / f"bfp_cpu-{key}.so"
        if not target.exists():
            complaint = _compile(compiler, flags, target)
            if complaint is not None:
                continue
        try:
            return _declare(ctypes.CDLL(str(target)))
        except OSError as err:
            complaint = str(err)
    raise BuildError(f"the C kernels did not build with {compiler}: {complaint}")


_switched_off = 0  # depth of `switched_off` blocks


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (DSQ_DISABLE_C_KERNELS set to anything but 0, inside
    `switched_off`, no compiler, a failed build), or None when they can. Read on every call:
    setting the variable takes effect at once."""
    if os.environ.get("DSQ_DISABLE_C_KERNELS", "") not in ("", "0"):
        return "DSQ_DISABLE_C_KERNELS is set"
    if _switched_off:
        return "switched off by the caller"
    return _build_failure()


@contextlib.contextmanager
def switched_off():
    """Within the block, `unavailable_reason` says no: what the callers run without the kernels
    (a benchmark's side-by-side column, a test of the fallback)."""
    global _switched_off
    _switched_off += 1
    try:
        yield
    finally:
        _switched_off -= 1


@functools.cache
def _build_failure() -> str | None:
    try:
        library()
    except BuildError as err:
        return str(err)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "dsq_bfp_quantize": (None, [p, p, i64, i64, i32, i32]),
        "dsq_fixed_quantize": (None, [p, p, i64, i32, i32]),
        "dsq_fixed_then_bfp": (None, [p, p, p, i64, i32, i32, i32, i32, i64]),
        "dsq_bfp_quantize_and_pack": (
            i32,
            [p, p, p, p, i64, i64, i64, i64, i32, i32, i64, i32, i32, i32],
        ),
        "dsq_pack_codes": (None, [p, i64, i32, p]),
        "dsq_bfp_decode": (i32, [p, i64, p, i64, p, i64, i64, i64, i32, i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


# ----------------------------------------------------------------------------- wrappers
def bfp_quantize(blocks: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """BFP(man_bits, exp_bits, B) of ``blocks`` [n_blocks, B] float32."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    library().dsq_bfp_quantize(
        blocks.data_ptr(), out.data_ptr(), blocks.shape[0], blocks.shape[1], man_bits, exp_bits
    )
    return out


def fixed_quantize(flat: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """fixed<man_bits> of ``flat`` [n] float32: one block over the whole tensor."""
    flat = flat.contiguous()
    out = torch.empty_like(flat)
    library().dsq_fixed_quantize(flat.data_ptr(), out.data_ptr(), flat.numel(), man_bits, exp_bits)
    return out


def fixed_then_bfp(flat, f_man: int, f_exp: int, s_man: int, s_exp: int, s_block: int):
    """(first, second): ``fixed_quantize(flat, f_man, f_exp)`` and BFP(s_man, s_exp, s_block)
    of it in consecutive blocks (``flat``'s length a multiple of s_block)."""
    flat = flat.contiguous()
    first, second = torch.empty_like(flat), torch.empty_like(flat)
    library().dsq_fixed_then_bfp(
        flat.data_ptr(), first.data_ptr(), second.data_ptr(), flat.numel(),
        f_man, f_exp, s_man, s_exp, s_block,
    )  # fmt: skip
    return first, second


def bfp_quantize_and_pack(
    rows, q_man: int, q_exp: int, q_block: int, p_man: int, p_exp: int, stream: bool
):
    """For ``rows`` [L, n_blocks, Bp, K] float32 (K a multiple of q_block, p_man <= 8):
    (values [L, n_blocks * Bp, K] of BFP(q_man, q_exp, q_block) along K, the stash of
    BFP(p_man, p_exp, Bp) along the rows, exponent codes [L, K, n_blocks] uint8). The stash is
    its mantissa stream when ``stream`` (Bp * p_man a multiple of 8, and the caller's rows not
    padded), else one code per byte, [L, K, n_blocks * Bp] uint8."""
    rows = rows.contiguous()
    lead, n_blocks, p_block, k = rows.shape
    if stream and (p_block * p_man) % 8:
        raise ValueError(f"blocks of {p_block} codes of {p_man} bits do not fill whole bytes")
    values = torch.empty(lead, n_blocks * p_block, k, dtype=torch.float32)
    size = lead * k * n_blocks * p_block
    out = torch.empty(size * p_man // 8 if stream else size, dtype=torch.uint8)
    exps = torch.empty(lead, k, n_blocks, dtype=torch.uint8)
    status = library().dsq_bfp_quantize_and_pack(
        rows.data_ptr(), values.data_ptr(), out.data_ptr(), exps.data_ptr(),
        lead, n_blocks, p_block, k, q_man, q_exp, q_block, p_man, p_exp, int(stream),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"no scratch memory for a tile of {p_block} x {k}")
    return values, out if stream else out.reshape(lead, k, n_blocks * p_block), exps


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The stream of ``codes`` (uint8, flat) at ``width`` <= 8 bits each."""
    codes = codes.contiguous()
    count = codes.numel()
    stream = torch.empty((count * width + 7) // 8, dtype=torch.uint8)
    library().dsq_pack_codes(codes.data_ptr(), count, width, stream.data_ptr())
    return stream


def bfp_decode(mantissas, exponents, rows: int, n: int, block: int, man_bits: int, exp_bits: int):
    """Values [rows, n] float32 of BFP(man_bits <= 8, exp_bits, block) streams, the block axis
    last (the streams' order). A stream shorter than its codes is refused (the C code trusts
    the lengths)."""
    mantissas, exponents = mantissas.contiguous(), exponents.contiguous()
    n_blocks = -(-n // block)
    for stream, count, width in (
        (mantissas, rows * n, man_bits),
        (exponents, rows * n_blocks, exp_bits),
    ):
        if stream.dtype != torch.uint8 or stream.numel() < (count * width + 7) // 8:
            raise ValueError(
                f"a stream of {stream.numel()} {stream.dtype} holds fewer than {count} codes "
                f"of {width} bits"
            )
    out = torch.empty(rows, n, dtype=torch.float32)
    status = library().dsq_bfp_decode(
        mantissas.data_ptr(), mantissas.numel(), exponents.data_ptr(), exponents.numel(),
        out.data_ptr(), rows, n, block, man_bits, exp_bits,
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"no scratch memory for a row of {n} codes")
    return out
