"""The C kernels of ``bfp_cpu.c`` (BFP and fixed<w> with nearest rounding, on CPU tensors), as
the torch custom ops ``torch.ops.dsq.*``.

``bfp_ops.cpp`` compiles ``bfp_cpu.c`` as C++ and registers each kernel with torch's dispatcher
(namespace ``dsq``); this module builds it on first use with torch's extension machinery
(``torch.utils.cpp_extension``: the machine's C++ compiler, ``$CXX`` else ``c++``, driven by
ninja) and loads it. So torch.compile traces the kernels as single ops (each has a fake
implementation here, which gives its outputs' shapes and dtypes without running it), the
profiler lists them by name (``dsq::bfp_quantize``), and every call checks its tensors at the
boundary: a tensor of another dtype, device or layout is a one-line ValueError, never memory
read as the wrong type. The ops are registered in C++ (``TORCH_LIBRARY``) rather than with
``torch.library`` in Python because a training step makes hundreds of calls: through the
dispatcher (``torch.ops.dsq.<op>.default``) a call on a 16 x 16 block costs no more than the
former ctypes call (about 4 us against 4.5 on a 2-core VM), a Python kernel behind
``torch.library.Library.impl`` about twice that and one made by ``torch.library.custom_op`` four
to five times.

What the build guarantees:

* exactness: the kernels' argument (``bfp_cpu.c``'s header) counts every rounding, so every
  variant compiles with IEEE arithmetic and no contraction into fused multiply-adds (FLAGS);
* the first of VARIANTS that builds wins (the machine's own instruction set and OpenMP, then
  OpenMP alone, then neither); when none builds, BuildError quotes the compiler's complaint for
  each, and the callers run the torch.compile kernels instead (slower, bit for bit the same);
* one build per CPU: each variant builds in its own folder of ``$DSQ_CACHE/c-kernels`` (default
  ``~/.cache/dsq``) whose name hashes the sources, the flags, torch's version and the CPU's model
  and feature flags, so a cluster's shared home never hands one node's ``-march=native`` build to
  another kind of CPU. Deleting the folder rebuilds;
* concurrent first uses (test workers, ranks) build once: cpp_extension holds a lock file in the
  folder while it builds, and the others wait for it. A lock left by a process killed mid-build
  is removed once older than any build could be (STALE_LOCK_S).

At run time the OpenMP calls bind to the libgomp torch has already loaded, sharing its thread
pool; every op passes torch's thread count to the kernels (``dsq_set_threads``) on each call.

Like ``bfp.py`` this module knows nothing of the formats above it: its wrappers take float32 (or
uint8) CPU tensors laid out as ``bfp_cpu.c`` states and return new tensors. The host glue is
``dsq/formats/backend_compile.py``, which decides what runs here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).parent
# the first includes the others (the build key hashes all three)
SOURCES = (HERE / "bfp_ops.cpp", HERE / "bfp_cpu.c", HERE / "op_checks.h")
# IEEE arithmetic, no contraction into fused multiply-adds: the kernels' exactness argument
# (bfp_cpu.c's header) counts every rounding.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math")
# Tried in order until one builds: the machine's own instruction set, and OpenMP threads.
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
# A build takes under a minute; a lock file an hour old was left by a process killed mid-build
# (a build suspended for that long, or on a host of a shared cache whose clock is that far off,
# loses its lock and builds again beside the next one, each into the same files).
STALE_LOCK_S = 3600
log = logging.getLogger("dsq.kernels")


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the message says why)."""


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


def build_key(sources: Sequence[Path], flags: Sequence[str], identity: str = "") -> str:
    """What a build depends on, hashed: the sources' text, every flag, torch's version (the
    library links against it), the CPU and ``identity`` (anything else, such as the path of a
    linked library)."""
    parts = [source.read_bytes() for source in sources]
    parts += [" ".join(flags).encode(), torch.__version__.encode(), _cpu_identity().encode()]
    return hashlib.sha256(b"\0".join([*parts, identity.encode()])).hexdigest()[:16]


def _complaint(message: str) -> str:
    """The compiler's first error line in cpp_extension's message (ninja's report: "FAILED:
    target", the command, then the compiler's output), else the message's first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    failed = next((i for i, line in enumerate(lines) if line.startswith("FAILED:")), None)
    if failed is not None:
        output = [line for line in lines[failed + 2 :] if not line.startswith("ninja:")]
        lines = output or lines[failed : failed + 1]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["failed without a message"])[0]


def _remove_stale_lock(directory: Path) -> None:
    """Delete the lock file of a build killed midway (cpp_extension would wait for it forever);
    a younger one is a build running elsewhere, which cpp_extension waits for."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:  # no lock, or another process removed it first
        pass


@contextlib.contextmanager
def _quiet(logger):
    """Within the block, ``logger`` (cpp_extension's) logs errors only: its compiler check logs a
    banner for every compiler it does not recognise (clang, a wrapper script), once per variant,
    while a compiler that cannot build the kernels is named in BuildError anyway."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _ninja_on_path():
    """Within the block, ``ninja`` (the builder runs it from PATH) is on PATH: the ``ninja``
    package's binary where the system has none, as when the package sits in a virtualenv that
    was not activated."""
    path = os.environ.get("PATH")
    try:
        import ninja  # the PyPI package: a binary and the folder holding it

        if shutil.which("ninja") is None:
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([path] if path else [])])
    except ImportError:
        pass
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def build(
    name: str,
    sources: Sequence[Path],
    variants=VARIANTS,
    flags: Sequence[str] = FLAGS,
    *,
    ldflags: Sequence[str] = (),
    includes: Sequence[Path] = (),
    identity: str = "",
) -> str:
    """``sources[0]`` (a C++ file, which may include the others) built into a cached shared
    library with torch's extension machinery and loaded into this process, its ops registered;
    the library's path. The first of ``variants`` (extra flags) that builds wins, each in its
    own folder ``name-<build_key>`` of `cache_dir`. BuildError (never another exception) if none
    builds or loads, naming the compiler and its complaint for each."""
    try:
        from torch.utils import cpp_extension  # imports setuptools: only when first used

        cache_dir().mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError) as err:  # an unwritable cache, no setuptools
        raise BuildError(f"the C kernels cannot be built here: {err}") from None
    complaints = []
    for variant in variants:
        all_flags = (*flags, *variant)
        key = build_key(sources, [*all_flags, *ldflags, *map(str, includes)], identity)
        directory = cache_dir() / f"{name}-{key}"
        # torch's builder keeps one build per extension name and process, and rebuilds under a
        # new name (loading the ops twice, which aborts) when one name meets two folders
        extension = f"dsq_{name}_{hashlib.sha256(str(directory).encode()).hexdigest()[:16]}"
        try:
            directory.mkdir(exist_ok=True)
            _remove_stale_lock(directory)
            if not (directory / f"{extension}.so").exists():
                log.info("building %s for this CPU in %s (once, under a minute)", name, directory)
            with _quiet(cpp_extension.logger), _ninja_on_path():
                return cpp_extension.load(
                    name=extension,
                    sources=[str(sources[0])],
                    extra_cflags=list(all_flags),
                    extra_ldflags=[*(flag for flag in variant if flag == "-fopenmp"), *ldflags],
                    extra_include_paths=[str(path) for path in includes],
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
        except Exception as err:  # noqa: BLE001 - a compiler's or loader's complaint, quoted
            complaints.append(f"[{' '.join(variant) or 'plain'}] {_complaint(str(err))}")
    compiler = os.environ.get("CXX") or "c++"
    raise BuildError(
        f"{sources[0].name} did not build with {compiler} (set CXX to choose the C++ compiler): "
        + "; ".join(complaints)
    )


_loaded: str | None = None  # the loaded library's path, once `library` has run


@functools.cache
def library() -> str:
    """The path of the loaded kernels (``torch.ops.dsq.*`` registered), built first if this
    machine has no cached build; BuildError (never another exception) if they cannot be built
    or loaded."""
    global _loaded
    path = build("bfp_ops", SOURCES)
    _register_fakes()
    _loaded = path
    return path


def _ops():
    """``torch.ops.dsq``, its kernels loaded. torch.compile reads `_loaded` as a constant (it
    would trace `library` itself, not its cache, and stop at the build's file system calls)."""
    if _loaded is None:
        library()
    return torch.ops.dsq


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (`build_failure`), or None when they can. Running without
    them on purpose is a choice of backend (``DSQ_BACKEND=compile``), not of this module."""
    return build_failure()


@functools.cache
def build_failure() -> str | None:
    """Why the kernels could not be built or loaded on this machine (BuildError's message), or
    None once they are loaded."""
    try:
        library()
    except BuildError as err:
        return str(err)
    return None


# ----------------------------------------------------------------------------- fake kernels
def need(op: str, t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> None:
    """The boundary check of ``bfp_ops.cpp``'s ``need``, with its message, for the fake
    kernels: under torch.compile the fake tensors are CPU tensors, and a meta tensor (which
    runs the fake kernel in eager mode) is refused like any other device."""
    if t.dtype != dtype or t.device.type != "cpu" or t.layout != torch.strided:
        got = f"{str(t.dtype).removeprefix('torch.')} on {t.device}"
        if t.layout != torch.strided:
            got += f" ({str(t.layout).removeprefix('torch.')} layout)"
        raise ValueError(f"{op} needs a {str(dtype).removeprefix('torch.')} CPU tensor, got {got}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op} needs a {dim}-D tensor, got shape {list(t.shape)}")


def _floats(*shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _bytes(*shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8)


def _fake_bfp_quantize(blocks, man_bits, exp_bits):
    need("dsq::bfp_quantize", blocks, torch.float32, 2)
    return _floats(*blocks.shape)


def _fake_bfp_quantize_columns(x, block, man_bits, exp_bits):
    need("dsq::bfp_quantize_columns", x, torch.float32, 3)
    return _floats(*x.shape)


def _fake_fixed_quantize(x, man_bits, exp_bits):
    need("dsq::fixed_quantize", x, torch.float32)
    return _floats(*x.shape)


def _fake_fixed_then_bfp(x, f_man, f_exp, s_man, s_exp, s_block):
    need("dsq::fixed_then_bfp", x, torch.float32)
    return _floats(*x.shape), _floats(*x.shape)


def _fake_bfp_quantize_and_pack(x, p_block, q_man, q_exp, q_block, p_man, p_exp, stream):
    need("dsq::bfp_quantize_and_pack", x, torch.float32, 3)
    lead, n, k = x.shape
    stash = _bytes(lead * k * n * p_man // 8) if stream else _bytes(lead, k, n)
    return _floats(lead, n, k), stash, _bytes(lead, k, n // p_block)


def _fake_pack_codes(codes, width):
    need("dsq::pack_codes", codes, torch.uint8)
    return _bytes((codes.numel() * width + 7) // 8)


def _fake_bfp_decode(mantissas, exponents, rows, n, block, man_bits, exp_bits):
    need("dsq::bfp_decode", mantissas, torch.uint8)
    need("dsq::bfp_decode", exponents, torch.uint8)
    return _floats(rows, n)


@functools.cache
def _register_fakes() -> None:
    """Each op's fake kernel (once per process: the ops are registered once, by the library)."""
    for name, fake in globals().items():
        if name.startswith("_fake_"):
            torch.library.register_fake(f"dsq::{name.removeprefix('_fake_')}", fake)


# ----------------------------------------------------------------------------- wrappers
def bfp_quantize(blocks: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """BFP(man_bits, exp_bits, B) of ``blocks`` [n_blocks, B] float32."""
    return _ops().bfp_quantize.default(blocks, man_bits, exp_bits)


def bfp_quantize_columns(x: torch.Tensor, block: int, man_bits: int, exp_bits: int):
    """BFP(man_bits, exp_bits, block) of ``x`` [outer, n, inner] float32 along its middle axis,
    in the same layout (blocks of ``block`` along n, the last one partial)."""
    return _ops().bfp_quantize_columns.default(x, block, man_bits, exp_bits)


def fixed_quantize(flat: torch.Tensor, man_bits: int, exp_bits: int) -> torch.Tensor:
    """fixed<man_bits> of ``flat`` float32 (any shape, read flat): one block over the whole
    tensor."""
    return _ops().fixed_quantize.default(flat, man_bits, exp_bits)


def fixed_then_bfp(flat, f_man: int, f_exp: int, s_man: int, s_exp: int, s_block: int):
    """(first, second): ``fixed_quantize(flat, f_man, f_exp)`` and BFP(s_man, s_exp, s_block)
    of it in consecutive blocks (``flat``'s length a multiple of s_block)."""
    return _ops().fixed_then_bfp.default(flat, f_man, f_exp, s_man, s_exp, s_block)


def bfp_quantize_and_pack(
    x, p_block: int, q_man: int, q_exp: int, q_block: int, p_man: int, p_exp: int, stream: bool
):
    """For ``x`` [L, N, K] float32 (N a multiple of p_block, K of q_block, p_man <= 8; K's
    stride 1, the other two any): (values [L, N, K] of BFP(q_man, q_exp, q_block) along K, the
    stash of BFP(p_man, p_exp, p_block) along N, exponent codes [L, K, N / p_block] uint8). The
    stash is its mantissa stream when ``stream`` (p_block * p_man a multiple of 8, and the
    caller's rows not padded), else one code per byte, [L, K, N] uint8."""
    return _ops().bfp_quantize_and_pack.default(
        x, p_block, q_man, q_exp, q_block, p_man, p_exp, stream
    )


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The stream of ``codes`` (uint8, flat) at ``width`` <= 8 bits each."""
    return _ops().pack_codes.default(codes, width)


def bfp_decode(mantissas, exponents, rows: int, n: int, block: int, man_bits: int, exp_bits: int):
    """Values [rows, n] float32 of BFP(man_bits <= 8, exp_bits, block) streams, the block axis
    last (the streams' order). A stream shorter than its codes is refused (the C code trusts
    the lengths)."""
    return _ops().bfp_decode.default(mantissas, exponents, rows, n, block, man_bits, exp_bits)
