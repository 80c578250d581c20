"""The C kernels of ``bfp_cpu.c`` (BFP and fixed<w> with nearest rounding, on CPU tensors), as
the torch custom ops ``torch.ops.dsq.*``.

``bfp_ops.cpp`` compiles ``bfp_cpu.c`` as C++ and registers each kernel with torch's dispatcher
(namespace ``dsq``); this module builds it on first use with torch's extension machinery
(``torch.utils.cpp_extension``: the machine's C++ compiler, ``$CXX`` else ``c++``, driven by
ninja) and loads it. So torch.compile traces the kernels as single ops (each has a fake
implementation here, which gives its outputs' shapes and dtypes without running it), the
profiler lists them by name (``dsq::bfp_quantize``), and every call checks its tensors at the
boundary: a tensor of another dtype, device or layout, or a width or block length the kernels
do not hold, is a one-line ValueError, never memory read as the wrong type or a wrong result.
The ops are registered in C++ (``TORCH_LIBRARY``) rather than with ``torch.library`` in Python
because a training step makes hundreds of calls: through the dispatcher
(``torch.ops.dsq.<op>.default``) a call on a 16 x 16 block costs no more than the former ctypes
call (about 4 us against 4.5 on a 2-core VM), a Python kernel behind
``torch.library.Library.impl`` about twice that and one made by ``torch.library.custom_op`` four
to five times.

What the build guarantees:

* exactness: the kernels' argument (``bfp_cpu.c``'s header) counts every rounding, so every
  variant compiles with IEEE arithmetic and no contraction into fused multiply-adds (FLAGS);
* the first of VARIANTS that builds wins (the machine's own instruction set and OpenMP, then
  OpenMP alone, then neither); when none builds, BuildError quotes the compiler's complaint for
  each, and the callers run the torch.compile kernels instead (slower, bit for bit the same);
* one build per CPU: each variant builds in its own folder of ``$DSQ_CACHE/c-kernels`` (default
  ``~/.cache/dsq``) whose name hashes the sources, the flags, torch's version and install
  folder, the Python headers, the compiler's name and the CPU's model and feature flags, so a
  cluster's shared home never hands one node's ``-march=native`` build to another kind of CPU.
  Deleting the folder (or all of ``c-kernels``) rebuilds on the next use;
* the build does not depend on the checkout: the sources are copied into the folder's ``src``
  (rewritten only when they differ) and compiled from there, so two clones of the repository
  (or an installed copy) with the same sources share one build instead of relinking it in turn;
* concurrent first uses (test workers, ranks) build once: each holds an exclusive lock
  (``flock``) on the folder's ``.dsq-lock`` around the build and load, and the others wait,
  with one warning if that takes over WAIT_WARNING_S. The system releases the lock when its
  holder dies, so a build killed midway (SIGKILL, SIGTERM) blocks nobody: the next process takes
  the lock, deletes the ``lock`` file torch's builder left behind and builds again;
* a cache folder that is not writable (a shared, read-only cache) but holds the built library
  is loaded as it is, without the builder.

At run time the OpenMP calls bind to the libgomp torch has already loaded, sharing its thread
pool; every op passes torch's thread count to the kernels (``dsq_set_threads``) on each call.

Like ``bfp.py`` this module knows nothing of the formats above it: its wrappers take float32 (or
uint8) CPU tensors laid out as ``bfp_cpu.c`` states and return new tensors. The host glue is
``dsq/formats/bfp_c.py`` (and ``fixed_c.py``), which decides what runs here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not on Windows: builds there are not locked against each other
    fcntl = None

HERE = Path(__file__).parent
# the first includes the others (the build key hashes all three)
SOURCES = (HERE / "bfp_ops.cpp", HERE / "bfp_cpu.c", HERE / "op_checks.h")
# IEEE arithmetic, no contraction into fused multiply-adds: the kernels' exactness argument
# (bfp_cpu.c's header) counts every rounding.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math")
# Tried in order until one builds: the machine's own instruction set, and OpenMP threads.
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
# The lock a build holds in its folder (flock: released by the system when its holder dies),
# and how long a process waits for another's build before saying so (a build takes under a
# minute on 2 cores).
LOCK_FILE = ".dsq-lock"
WAIT_WARNING_S = 10.0
log = logging.getLogger("dsq.kernels")


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the message says why)."""


def _cpu_lines() -> list[str]:
    """The lines of /proc/cpuinfo (Linux), else none."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows of it."""
    lines = _cpu_lines()
    wanted = ("model name", "flags", "Features", "CPU part")
    picked = {line.split(":")[0].strip(): line for line in lines if line.startswith(wanted)}
    return "\n".join(sorted(picked.values())) or f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    root = os.environ.get("DSQ_CACHE") or Path.home() / ".cache" / "dsq"
    return Path(root) / "c-kernels"


def build_key(sources: Sequence[Path], flags: Sequence[str], identity: str = "") -> str:
    """What a build depends on, hashed: the sources' text, every flag, torch's version and
    folder (the library links against it), the Python headers, the compiler's name (what the
    build command holds besides the copied sources' path), the CPU and ``identity`` (anything
    else, such as the path of a linked library)."""
    words = [" ".join(flags), torch.__version__, _cpu_identity(), str(Path(torch.__file__).parent)]
    words += [sysconfig.get_path("include"), os.environ.get("CXX") or "c++", identity]
    parts = [*(source.read_bytes() for source in sources), *(word.encode() for word in words)]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


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


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Within the block, this process alone builds in ``directory``: it holds an exclusive
    ``flock`` on its LOCK_FILE, waiting (with one warning after WAIT_WARNING_S) for another
    process's build to end. The system releases the lock when its holder dies, so a lock file of
    torch's builder found then (``lock``, which the builder waits on forever) was left by a
    build killed midway, and is deleted. Without flock (another OS, a file system refusing
    locks) the block runs unlocked and leaves torch's file alone."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start, warned = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:  # another process builds here
                if not warned and time.monotonic() - start >= WAIT_WARNING_S:
                    log.warning(
                        "waiting for another process's build of the C kernels in %s", directory
                    )
                    warned = True
                time.sleep(0.2)
            except OSError as err:  # no locks on this file system
                log.debug("building in %s without a lock: %s", directory, err)
                locked = False
                break
        if locked:
            with contextlib.suppress(FileNotFoundError):
                (directory / "lock").unlink()
        yield
    finally:
        os.close(fd)  # releases the lock


def _copied_sources(directory: Path, sources: Sequence[Path]) -> list[Path]:
    """``sources`` copied into ``directory/src`` (each written to a temporary name, then renamed
    over the copy; left alone when it already holds the same bytes, since ninja rebuilds what is
    newer than its output), so that the build command names no checkout's path."""
    folder = directory / "src"
    folder.mkdir(exist_ok=True)
    copies = []
    for source in sources:
        text, copy = source.read_bytes(), folder / source.name
        try:
            same = copy.read_bytes() == text
        except OSError:  # no copy yet
            same = False
        if not same:
            temporary = folder / f".{source.name}.{os.getpid()}.tmp"
            temporary.write_bytes(text)
            os.replace(temporary, copy)
        copies.append(copy)
    return copies


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK)


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
    """Within the block, the ``ninja`` package's binary (a dependency) first on PATH, where the
    builder looks for ``ninja``, by a folder of its own that holds nothing else (the package's
    folder may be a virtualenv's ``bin`` or ``/usr/bin``, whose compilers would then shadow the
    user's): found whether or not its virtualenv is activated, and the same binary for every
    process of this environment. Two ninja versions may hash a build command differently (1.13
    changed the hash), so a system ninja and the package's taking turns on one cached build
    rebuild it every time the other ran (two runs at once, one started from an activated
    virtualenv, did). Without the package's binary, PATH's own ninja."""
    path = os.environ.get("PATH")
    folder = _ninja_folder()
    if folder is not None:
        os.environ["PATH"] = os.pathsep.join([str(folder), *([path] if path else [])])
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def _ninja_folder() -> Path | None:
    """A folder beside the kernels' cache holding only ``ninja``, a link to the ``ninja``
    package's binary (a folder per binary, so that environments sharing the cache do not take
    turns on it); None where the package or its binary is missing or the link cannot be made."""
    try:
        import ninja  # the PyPI package: a binary and the folder holding it
    except ImportError:
        return None
    binary = Path(ninja.BIN_DIR, "ninja") if ninja.BIN_DIR else None
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        return None
    folder = cache_dir().parent / "ninja" / hashlib.sha256(str(binary).encode()).hexdigest()[:16]
    link = folder / "ninja"
    try:
        if not (link.is_symlink() and os.readlink(link) == str(binary)):
            folder.mkdir(parents=True, exist_ok=True)
            temporary = folder / f".ninja.{os.getpid()}.tmp"
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(binary)
            os.replace(temporary, link)  # atomic: a process beside this one sees one or the other
    except OSError:
        return None
    return folder


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
    """``sources[0]`` (a C++ file, which may include the others, all in one folder) built into a
    cached shared library with torch's extension machinery and loaded into this process, its ops
    registered; the library's path. The first of ``variants`` (extra flags) that builds wins,
    each in its own folder ``name-<build_key>`` of `cache_dir`, from copies of ``sources`` in
    its ``src``, under `_build_lock`. BuildError (never another exception) if none builds or
    loads, naming the compiler and its complaint for each."""
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
        library = directory / f"{extension}.so"
        try:
            directory.mkdir(exist_ok=True)
            if library.exists() and not _writable(directory):
                # a read-only cache holding the build: torch's builder would fail to lock it
                torch.ops.load_library(str(library))
                return str(library)
            with _build_lock(directory):
                if not library.exists():
                    log.info(
                        "building %s for this CPU in %s (once, under a minute)", name, directory
                    )
                copies = _copied_sources(directory, sources)
                with _quiet(cpp_extension.logger), _ninja_on_path():
                    return cpp_extension.load(
                        name=extension,
                        sources=[str(copies[0])],
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


def failure_of(load: Callable[[], str]) -> str | None:
    """Why ``load`` (a module's ``library``) could not build or load its library on this
    machine (BuildError's message), or None once it is loaded: each C library's
    ``build_failure``."""
    try:
        load()
    except BuildError as err:
        return str(err)
    return None


@functools.cache
def build_failure() -> str | None:
    """Why the kernels could not be built or loaded on this machine (BuildError's message), or
    None once they are loaded."""
    return failure_of(library)


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


def need_range(op: str, name: str, value: int, low: int, high: int | None = None) -> None:
    """``bfp_ops.cpp``'s ``need_range``, with its message, for the fake kernels: the integer
    argument ``name`` of ``op`` lies in [low, high] (no upper bound when high is None)."""
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"{low} to {high}"
        raise ValueError(f"{op} needs {name} of {bounds}, got {value}")


def need_format(op: str, man: tuple[str, int], exp: tuple[str, int], most: int = 23) -> None:
    """``bfp_ops.cpp``'s ``need_format``: BFP(m, E) or fixed<m> as the kernels hold it, 2 <= m
    <= most (23; 8 for codes, one byte each) and 1 <= E <= 8 (``bfp_cpu.c``'s header)."""
    need_range(op, *man, 2, most)
    need_range(op, *exp, 1, 8)


def _floats(*shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _bytes(*shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8)


def _fake_bfp_quantize(blocks, man_bits, exp_bits):
    need("dsq::bfp_quantize", blocks, torch.float32, 2)
    need_format("dsq::bfp_quantize", ("man_bits", man_bits), ("exp_bits", exp_bits))
    return _floats(*blocks.shape)


def _fake_bfp_quantize_columns(x, block, man_bits, exp_bits):
    need("dsq::bfp_quantize_columns", x, torch.float32, 3)
    need_range("dsq::bfp_quantize_columns", "block", block, 1)
    need_format("dsq::bfp_quantize_columns", ("man_bits", man_bits), ("exp_bits", exp_bits))
    return _floats(*x.shape)


def _fake_bfp_codes(blocks, man_bits, exp_bits):
    need("dsq::bfp_codes", blocks, torch.float32, 2)
    need_format("dsq::bfp_codes", ("man_bits", man_bits), ("exp_bits", exp_bits), most=8)
    return _bytes(*blocks.shape), _bytes(blocks.shape[0])


def _fake_fixed_quantize(x, man_bits, exp_bits):
    need("dsq::fixed_quantize", x, torch.float32)
    need_format("dsq::fixed_quantize", ("man_bits", man_bits), ("exp_bits", exp_bits))
    return _floats(*x.shape)


def _fake_fixed_then_bfp(x, f_man, f_exp, s_man, s_exp, s_block):
    op = "dsq::fixed_then_bfp"
    need(op, x, torch.float32)
    need_format(op, ("f_man", f_man), ("f_exp", f_exp))
    need_format(op, ("s_man", s_man), ("s_exp", s_exp))
    need_range(op, "s_block", s_block, 1)
    if x.numel() % s_block != 0:
        raise ValueError(f"{op}: {x.numel()} values are not whole blocks of {s_block}")
    return _floats(*x.shape), _floats(*x.shape)


def _fake_bfp_quantize_and_pack(x, p_block, q_man, q_exp, q_block, p_man, p_exp, stream):
    op = "dsq::bfp_quantize_and_pack"
    need(op, x, torch.float32, 3)
    need_range(op, "p_block", p_block, 1)
    need_range(op, "q_block", q_block, 1)
    need_format(op, ("q_man", q_man), ("q_exp", q_exp))
    need_format(op, ("p_man", p_man), ("p_exp", p_exp), most=8)
    lead, n, k = x.shape
    if k % q_block != 0:
        raise ValueError(f"{op}: rows of {k} values are not whole blocks of {q_block}")
    if stream and ((p_block * p_man) % 8 != 0 or (n * p_man) % 8 != 0):
        raise ValueError(
            f"{op}: blocks of {p_block} codes or rows of {n} codes of {p_man} bits do not fill "
            "whole bytes"
        )
    stash = _bytes(lead * k * n * p_man // 8) if stream else _bytes(lead, k, n)
    return _floats(lead, n, k), stash, _bytes(lead, k, -(-n // p_block))


def _fake_pack_codes(codes, width):
    need("dsq::pack_codes", codes, torch.uint8)
    if not 1 <= width <= 8:
        raise ValueError(f"dsq::pack_codes needs a width of 1 to 8 bits, got {width}")
    return _bytes((codes.numel() * width + 7) // 8)


def _fake_bfp_decode(mantissas, exponents, rows, n, block, man_bits, exp_bits):
    op = "dsq::bfp_decode"
    need(op, mantissas, torch.uint8)
    need(op, exponents, torch.uint8)
    need_range(op, "rows", rows, 0)
    need_range(op, "n", n, 0)
    need_range(op, "block", block, 1)
    need_format(op, ("man_bits", man_bits), ("exp_bits", exp_bits), most=8)
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


def bfp_codes(blocks: torch.Tensor, man_bits: int, exp_bits: int):
    """(mantissa codes [n_blocks, B], exponent codes [n_blocks]), uint8, of BFP(man_bits <= 8,
    exp_bits, B) of ``blocks`` [n_blocks, B] float32: stage 1 of a per-block pack."""
    return _ops().bfp_codes.default(blocks, man_bits, exp_bits)


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
    """For ``x`` [L, N, K] float32 (K a multiple of q_block, p_man <= 8; K's stride 1, the
    other two any): (values [L, N, K] of BFP(q_man, q_exp, q_block) along K, the stash of
    BFP(p_man, p_exp, p_block) along N, the last block of each column partial when N is not a
    multiple of p_block, exponent codes [L, K, ceil(N / p_block)] uint8). The stash is its
    mantissa stream when ``stream`` (p_block * p_man and N * p_man multiples of 8), else one
    code per byte, [L, K, N] uint8."""
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
