"""The C kernels of ``bfp_cpu.c`` (BFP and fixed<w> with nearest rounding, on CPU tensors).

The source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
the machine's own CPU (``-march=native``) with OpenMP, each dropped if the compiler refuses it,
and loaded with ctypes. The library is cached in ``$DSQ_CACHE/c-kernels`` (default
``~/.cache/dsq``) under a name that hashes the source, the flags, the compiler's version and
the CPU's model and feature flags, so a cluster's shared home never hands one node's build to
another kind of CPU. The build writes a temporary file and renames it into place, so
concurrent first uses (test workers, ranks) never load half a file.

Like ``bfp.py`` this module knows nothing of the formats above it: its wrappers take contiguous
float32 (or uint8) CPU tensors laid out as ``bfp_cpu.c`` states and return new tensors. The host
glue is ``dsq/formats/compiled.py``, which decides what runs here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("bfp_cpu.c")
# IEEE arithmetic, no contraction into fused multiply-adds: the kernels' exactness argument
# (bfp_cpu.c's header) counts every rounding.
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
# Tried in order until one builds: the machine's own instruction set, and OpenMP threads. At run
# time the OpenMP calls bind to the libgomp torch has already loaded where torch ships it as
# libgomp.so.1 (same soname), sharing torch's thread pool; elsewhere the compiler's own runtime
# loads beside torch's. Either way the wrappers pass torch's thread count (`dsq_set_threads`).
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the message says why)."""


def _compiler() -> list[str]:
    """The C compiler's command ($CC may carry words, as in ``ccache gcc``)."""
    command = shlex.split(os.environ.get("CC") or "cc")
    if not command:
        raise BuildError("CC is empty; set it to a C compiler")
    found = shutil.which(command[0])
    if found is None and "CC" not in os.environ:
        found = shutil.which("gcc")
    if found is None:
        raise BuildError(f"no C compiler ({command[0]}) on PATH; set CC to one")
    return [found, *command[1:]]


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


def _complaint(stderr: str) -> str:
    """The compiler's first error line (the last line is usually "compilation terminated")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["failed without a message"])[0]


def _compile(
    compiler: list[str], flags: tuple[str, ...], source: Path, target: Path, links=()
) -> str | None:
    """Compile into ``target`` atomically (a temporary file renamed into place, readable by
    all, as a shared cache needs); the compiler's complaint, or None on success. A failure is
    remembered beside the target (``.failed``), so other processes do not compile it again."""
    failed = target.with_suffix(".failed")
    if failed.exists():
        return failed.read_text()
    handle, temporary = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run(
            [*compiler, *flags, str(source), "-o", temporary, *links],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            complaint = _complaint(done.stderr)
            _write_atomically(failed, complaint)
            return complaint
        os.chmod(temporary, 0o755)
        os.replace(temporary, target)
        return None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


STALE_AFTER_S = 86400  # a build takes about a second: a day-old temporary file's build died


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete the temporary files of builds killed midway (they are never renamed into place).
    A build still running in another process is far younger than STALE_AFTER_S, also when it
    was suspended for hours or runs on another host of a shared cache whose clock is off."""
    now = time.time()
    for temporary in directory.glob(".build-*"):
        try:
            if now - temporary.stat().st_mtime > STALE_AFTER_S:
                temporary.unlink()
        except OSError:  # another process removed it first
            pass


def _write_atomically(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(prefix=".build-", dir=path.parent)
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def build(
    source: Path, variants, flags=FLAGS, links: tuple[str, ...] = (), identity: str = ""
) -> ctypes.CDLL:
    """``source`` compiled into a cached shared library (one build per source, flags, compiler,
    CPU and ``identity``: what else the build depends on, such as a linked library's path) and
    loaded; the first of ``variants`` (extra flags) that builds wins. BuildError (never another
    exception) if none builds or loads, naming the compiler and its complaint for each."""
    try:
        compiler = _compiler()
        version = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, check=False
        ).stdout
        cache_dir().mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(cache_dir())
    except OSError as err:  # an unwritable cache, a compiler that does not run
        raise BuildError(f"the C kernels cannot be built here: {err}") from None
    text = source.read_bytes()
    complaints = []
    for variant in variants:
        all_flags = tuple(flags) + tuple(variant)
        key = hashlib.sha256(
            b"\0".join(
                [
                    text,
                    " ".join(all_flags + tuple(links)).encode(),
                    version.encode(),
                    _cpu_identity().encode(),
                    identity.encode(),
                ]
            )
        ).hexdigest()[:20]
        target = cache_dir() / f"{source.stem}-{key}.so"
        try:
            complaint = (
                None if target.exists() else _compile(compiler, all_flags, source, target, links)
            )
            if complaint is None:
                return ctypes.CDLL(str(target))
        except OSError as err:
            complaint = str(err)
        complaints.append(f"[{' '.join(variant) or 'plain'}] {complaint}")
    raise BuildError(
        f"{source.name} did not build with {' '.join(compiler)}: {'; '.join(complaints)}"
    )


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built first if this machine has no cached build; BuildError (never
    another exception) if they cannot be built or loaded."""
    return _declare(build(SOURCE, VARIANTS))


_switched_off = 0  # depth of `switched_off` blocks


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (`disabled_reason`, or `build_failure`), or None when
    they can."""
    return disabled_reason() or build_failure()


def disabled_reason() -> str | None:
    """Why the kernels are switched off (DSQ_DISABLE_C_KERNELS set to anything but 0, or inside
    `switched_off`), or None. Read on every call: setting the variable takes effect at once."""
    if os.environ.get("DSQ_DISABLE_C_KERNELS", "") not in ("", "0"):
        return "DSQ_DISABLE_C_KERNELS is set"
    if _switched_off:
        return "switched off by the caller"
    return None


@functools.cache
def build_failure() -> str | None:
    """Why the kernels could not be built or loaded on this machine (BuildError's message), or
    None once they are loaded."""
    try:
        library()
    except BuildError as err:
        return str(err)
    return None


@contextlib.contextmanager
def switched_off():
    """Within the block, `unavailable_reason` says no, in every thread of the process: what the
    callers run without the kernels (a benchmark's side-by-side column, a test of the
    fallback)."""
    global _switched_off
    _switched_off += 1
    try:
        yield
    finally:
        _switched_off -= 1


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "dsq_set_threads": (None, [i32]),
        "dsq_bfp_quantize": (None, [p, p, i64, i64, i32, i32]),
        "dsq_fixed_quantize": (None, [p, p, i64, i32, i32]),
        "dsq_bfp_quantize_columns": (i32, [p, p, i64, i64, i64, i64, i32, i32]),
        "dsq_fixed_then_bfp": (None, [p, p, p, i64, i32, i32, i32, i32, i64]),
        "dsq_bfp_quantize_and_pack": (
            i32,
            [p, i64, i64, p, p, p, i64, i64, i64, i64, i32, i32, i64, i32, i32, i32],
        ),
        "dsq_pack_codes": (None, [p, i64, i32, p]),
        "dsq_bfp_decode": (i32, [p, i64, p, i64, p, i64, i64, i64, i32, i32]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


# ----------------------------------------------------------------------------- wrappers
_threads_set = 0  # the thread count the library was last told


def _threaded() -> ctypes.CDLL:
    """The library, told torch's thread count for this thread (OpenMP's count is per thread, and
    the library's runtime may not be torch's)."""
    global _threads_set
    lib = library()
    threads = torch.get_num_threads()
    if threads != _threads_set:
        lib.dsq_set_threads(threads)
        _threads_set = threads
    return lib


def bfp_quantize(blocks: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """BFP(man_bits, exp_bits, B) of ``blocks`` [n_blocks, B] float32."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    _threaded().dsq_bfp_quantize(
        blocks.data_ptr(), out.data_ptr(), blocks.shape[0], blocks.shape[1], man_bits, exp_bits
    )
    return out


def bfp_quantize_columns(x: torch.Tensor, block: int, man_bits: int, exp_bits: int):
    """BFP(man_bits, exp_bits, block) of ``x`` [outer, n, inner] float32 along its middle axis,
    in the same layout (blocks of ``block`` along n, the last one partial)."""
    x = x.contiguous()
    outer, n, inner = x.shape
    out = torch.empty_like(x)
    status = _threaded().dsq_bfp_quantize_columns(
        x.data_ptr(), out.data_ptr(), outer, n, inner, block, man_bits, exp_bits
    )
    if status != 0:
        raise MemoryError(f"no scratch memory for a tile of {block} x {inner}")
    return out


def fixed_quantize(flat: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """fixed<man_bits> of ``flat`` [n] float32: one block over the whole tensor."""
    flat = flat.contiguous()
    out = torch.empty_like(flat)
    _threaded().dsq_fixed_quantize(
        flat.data_ptr(), out.data_ptr(), flat.numel(), man_bits, exp_bits
    )
    return out


def fixed_then_bfp(flat, f_man: int, f_exp: int, s_man: int, s_exp: int, s_block: int):
    """(first, second): ``fixed_quantize(flat, f_man, f_exp)`` and BFP(s_man, s_exp, s_block)
    of it in consecutive blocks (``flat``'s length a multiple of s_block)."""
    flat = flat.contiguous()
    if flat.numel() % s_block:
        raise ValueError(f"{flat.numel()} values are not whole blocks of {s_block}")
    first, second = torch.empty_like(flat), torch.empty_like(flat)
    _threaded().dsq_fixed_then_bfp(
        flat.data_ptr(), first.data_ptr(), second.data_ptr(), flat.numel(),
        f_man, f_exp, s_man, s_exp, s_block,
    )  # fmt: skip
    return first, second


def bfp_quantize_and_pack(
    x, p_block: int, q_man: int, q_exp: int, q_block: int, p_man: int, p_exp: int, stream: bool
):
    """For ``x`` [L, N, K] float32 (N a multiple of p_block, K of q_block, p_man <= 8; K's
    stride 1, the other two any): (values [L, N, K] of BFP(q_man, q_exp, q_block) along K, the
    stash of BFP(p_man, p_exp, p_block) along N, exponent codes [L, K, N / p_block] uint8). The
    stash is its mantissa stream when ``stream`` (p_block * p_man a multiple of 8, and the
    caller's rows not padded), else one code per byte, [L, K, N] uint8."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    lead, n, k = x.shape
    if n % p_block or k % q_block:
        raise ValueError(f"[{n}, {k}] is not whole blocks of {p_block} rows and {q_block} values")
    if stream and (p_block * p_man) % 8:
        raise ValueError(f"blocks of {p_block} codes of {p_man} bits do not fill whole bytes")
    values = torch.empty(lead, n, k, dtype=torch.float32)
    out = torch.empty(lead * k * n * p_man // 8 if stream else lead * k * n, dtype=torch.uint8)
    exps = torch.empty(lead, k, n // p_block, dtype=torch.uint8)
    status = _threaded().dsq_bfp_quantize_and_pack(
        x.data_ptr(), x.stride(0), x.stride(1), values.data_ptr(), out.data_ptr(),
        exps.data_ptr(), lead, n // p_block, p_block, k, q_man, q_exp, q_block, p_man, p_exp,
        int(stream),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"no scratch memory for a tile of {p_block} x {k}")
    return values, out if stream else out.reshape(lead, k, n), exps


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The stream of ``codes`` (uint8, flat) at ``width`` <= 8 bits each."""
    codes = codes.contiguous()
    count = codes.numel()
    stream = torch.empty((count * width + 7) // 8, dtype=torch.uint8)
    _threaded().dsq_pack_codes(codes.data_ptr(), count, width, stream.data_ptr())
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
    status = _threaded().dsq_bfp_decode(
        mantissas.data_ptr(), mantissas.numel(), exponents.data_ptr(), exponents.numel(),
        out.data_ptr(), rows, n, block, man_bits, exp_bits,
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"no scratch memory for a row of {n} codes")
    return out
