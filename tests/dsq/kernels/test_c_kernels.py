"""The C kernels of the c backend (dsq/kernels/bfp_cpu.c) against the reference, bit for bit,
over the formats they cover (nearest rounding, E <= 8, 2 <= m <= 23; codes for m <= 8), with
values at every edge of float32; the same results on any number of threads; and the loader:
its cache (shared by checkouts, read as it is where read-only), its lock (a killed build blocks
nobody), and a failed build (``auto`` then takes the compile backend, still exact)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.tensors import assert_bitwise_equal

from dsq.formats import backend_c, backends, parse_format
from dsq.kernels import cpu as c_kernels
from dsq.warn_once import warn_once

pytestmark = pytest.mark.skipif(
    backends.unavailable_reason("c", "cpu") is not None,
    reason=str(backends.unavailable_reason("c", "cpu")),
)


def wide_tensor(shape, seed: int) -> torch.Tensor:
    """Magnitudes from subnormal to the largest float32, zeros of both signs, blocks whose max
    sits at 2^127 (the top block exponent) and at the bottom of the normal range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, torch.randint(-150, 128, shape, generator=g).to(torch.float64))
    x = x.clamp(-3.4e38, 3.4e38).to(torch.float32)
    flat = x.view(-1)
    flat[:20] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, -1.1e-38, 3.4e38, -3.3e38] * 2
                             + [2.0**-127, -(2.0**-126), 5e-39, 1.0])  # fmt: skip
    flat[40:56] = -0.0
    flat[60] = 1.7e38  # a block whose max is in [2^126, 2^127)
    flat[80] = 2.0**127
    return x


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    flat[33], flat[97], flat[130] = math.nan, math.inf, -math.inf
    return x


# (m, E, B): every width of a code, a few exponent widths, long, short and odd blocks
FORMATS = [(2, 8, 16), (3, 8, 16), (4, 8, 16), (5, 4, 3), (6, 5, 16), (7, 2, 1), (8, 8, 16),
           (8, 3, 33), (12, 8, 16), (16, 6, 7), (23, 8, 16), (2, 2, 64)]  # fmt: skip


def spy(monkeypatch) -> list[str]:
    """Record which C kernels run (a test must know the C code, not the fallback, ran)."""
    ran: list[str] = []
    for name in ("bfp_quantize", "bfp_quantize_columns", "fixed_quantize", "fixed_then_bfp",
                 "bfp_quantize_and_pack", "pack_codes", "bfp_decode"):  # fmt: skip
        original = getattr(c_kernels, name)

        def wrapper(*args, _original=original, _name=name):
            ran.append(_name)
            return _original(*args)

        monkeypatch.setattr(c_kernels, name, wrapper)
    return ran


@pytest.mark.parametrize("m,E,B", FORMATS)
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.slow  # 48 cases; each format's first takes seconds
def test_bfp_equals_reference(m, E, B, nonfinite, axis, monkeypatch):
    fmt = parse_format(f"bfp{m}e{E}b{B}")
    x = wide_tensor((37, 70), seed=m * 100 + E * 10 + B)
    x = with_nonfinite(x) if nonfinite else x
    ran = spy(monkeypatch)
    expected = fmt.quantize(x, axis, backend="reference")
    assert_bitwise_equal(fmt.quantize(x, axis, backend="c"), expected, "quantize")
    packed, reference = (
        fmt.pack(x, axis, backend="c"),
        fmt.pack(x, axis, backend="reference"),
    )
    for name, stream in reference.payload.items():
        assert torch.equal(packed.payload[name], stream), name
    assert_bitwise_equal(packed.unpack(backend="c"), expected, "unpack")
    assert ("bfp_quantize" if axis == -1 else "bfp_quantize_columns") in ran
    assert ("bfp_decode" in ran) == (m <= 8)


@pytest.mark.parametrize("width", [2, 4, 8, 12, 16, 23])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_fixed_equals_reference(width, nonfinite, monkeypatch):
    fmt = parse_format(f"fixed{width}")
    ran = spy(monkeypatch)
    for seed, scale in ((1, 1.0), (2, 2.0**-140), (3, 2.0**120)):
        x = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed)) * scale
        x = with_nonfinite(x) if nonfinite else x
        ran.clear()
        assert_bitwise_equal(
            fmt.quantize(x, backend="c"), fmt.quantize(x, backend="reference"), str(seed)
        )
        assert ran == ["fixed_quantize"]


# (q0 format, stash format): the stash written as its stream straight from the tiles (block
# codes and each column's codes filling whole bytes: 2 x 16, 4 x 16, 8 x 16, 3 x 8, 5 x 8, 6 x 4,
# over whole blocks of rows or a partial last one: 44 rows of 2, 4, 6 or 8 bits, 37 of 8) or as
# one byte per code first (7 x 4, 3 x 5, a column of 37 or 1 codes of fewer than 8 bits, 44 of 3
# or 5, and any row whose q0 blocks are padded: 34 columns). The direct stream is gathered in
# runs of tiles filling 64 bytes of each column: 340 rows make several runs, the last one
# shorter and its last tile partial, and 2 x 340 x 64 values run on the kernels' threads.
PAIRS = [((8, 8, 16), (2, 8, 16)), ((8, 8, 16), (4, 8, 16)), ((8, 8, 16), (8, 8, 16)),
         ((4, 8, 16), (3, 8, 8)), ((8, 8, 16), (5, 2, 8)), ((8, 8, 16), (6, 5, 4)),
         ((6, 5, 8), (7, 3, 4)), ((23, 8, 16), (3, 8, 5))]  # fmt: skip


@pytest.mark.parametrize("q,p", PAIRS)
@pytest.mark.parametrize(
    "shape",
    [(64, 32), (2, 48, 48), (2, 37, 48), (2, 44, 48), (1, 160), (2, 48, 34), (2, 340, 64)],
)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_quantize_and_pack_equals_reference(q, p, shape, nonfinite, monkeypatch):
    fmt, stash = parse_format("bfp{}e{}b{}".format(*q)), parse_format("bfp{}e{}b{}".format(*p))
    x = wide_tensor(shape, seed=sum(shape))
    x = with_nonfinite(x) if nonfinite and x.numel() > 130 else x
    routes = []
    original = c_kernels.bfp_quantize_and_pack
    monkeypatch.setattr(
        c_kernels,
        "bfp_quantize_and_pack",
        lambda *args: routes.append(args[-1]) or original(*args),
    )
    last, before = x.dim() - 1, x.dim() - 2
    values, packed = fmt.quantize_and_pack(x, last, stash, before, backend="c")
    direct = shape[-1] % q[2] == 0 and p[0] * p[2] % 8 == 0 and shape[-2] * p[0] % 8 == 0
    assert routes == [direct]
    assert_bitwise_equal(values, fmt.quantize(x, last, backend="reference"), "values")
    expected = stash.pack(x, before, backend="reference")
    for name, stream in expected.payload.items():
        assert torch.equal(packed.payload[name], stream), name


@pytest.mark.parametrize("stream", [True, False])
def test_quantize_and_pack_of_no_rows_writes_nothing(stream):
    """The operator takes [L, 0, K] (no tile, no run): empty outputs, not a division by zero."""
    values, stash, exps = c_kernels.bfp_quantize_and_pack(
        torch.empty(2, 0, 16), 16, 8, 8, 16, 8, 8, stream
    )
    assert values.shape == (2, 0, 16) and stash.numel() == 0 and exps.shape == (2, 16, 0)


@pytest.mark.parametrize("layout", ["rows-strided", "last-axis-strided"])
def test_quantize_and_pack_reads_strided_operands(layout, monkeypatch):
    """An attention operand seen through a transpose: rows and matrices interleaved (read in
    place, no copy), or the last axis itself strided (copied first); values and stash exact."""
    fmt, stash = parse_format("bfp8"), parse_format("bfp4")
    if layout == "rows-strided":
        x = wide_tensor((48, 3, 64), seed=21).transpose(0, 1)  # [3, 48, 64], strides (64, 192, 1)
    else:
        x = wide_tensor((3, 64, 48), seed=22).transpose(1, 2)  # [3, 48, 64], last stride 48
    assert not x.is_contiguous()
    ran = spy(monkeypatch)
    values, packed = fmt.quantize_and_pack(x, 2, stash, 1, backend="c")
    assert "bfp_quantize_and_pack" in ran
    assert_bitwise_equal(values, fmt.quantize(x, 2, backend="reference"), "values")
    for name, stream in stash.pack(x, 1, backend="reference").payload.items():
        assert torch.equal(packed.payload[name], stream), name


@pytest.mark.parametrize(
    "spec,shape,joined",
    [
        ("bfp8", (256, 32, 64), (128, 4096)),  # an attention stash: rows of 32, 16,384 of them
        ("bfp8", (3, 32, 100), (3, 3200)),  # 300 rows: 128 to a row do not divide them, 100 do
        ("bfp2", (3, 32, 17), (3, 544)),  # 51 rows, no more than 25 a row (two threads): 17
        ("bfp5e3b3", (2, 6, 1023), (3, 4092)),  # 2,046 rows of 30 bits, each exponent 3 bits:
        # the joined rows start mid-byte in both streams
        ("bfp3", (2, 4096, 3), (6, 4096)),  # rows at the joined length already: none joined
        ("bfp4", (5, 40, 4), (20, 40)),  # a partial last block in every row: none joined
    ],
)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_decode_joins_rows_of_whole_blocks(spec, shape, joined, nonfinite, monkeypatch):
    """The stash decoded with consecutive rows of whole blocks taken as one longer row (they
    follow each other in both streams), leaving at least one row per thread (here two): the
    rows the kernel is given, and the values, bit for bit the reference's."""
    fmt = parse_format(spec)
    x = wide_tensor(shape, seed=len(spec) + sum(shape))
    x = with_nonfinite(x) if nonfinite else x
    packed = fmt.pack(x, 1, backend="c")
    calls = []
    original = c_kernels.bfp_decode
    monkeypatch.setattr(
        c_kernels, "bfp_decode", lambda *args: calls.append(args[2:4]) or original(*args)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        unpacked = packed.unpack(backend="c")
    finally:
        torch.set_num_threads(threads)
    assert_bitwise_equal(unpacked, fmt.quantize(x, 1, backend="reference"))
    assert calls == [joined]


@pytest.mark.parametrize("first,second", [("fixed16", "bfp8"), ("fixed8", "bfp3e4b8"),
                                          ("fixed23", "bfp23")])  # fmt: skip
def test_chain_equals_reference(first, second, monkeypatch):
    f, s = parse_format(first), parse_format(second)
    ran = spy(monkeypatch)
    for x in (wide_tensor((24, 64), seed=3), with_nonfinite(torch.randn(24, 64))):
        ran.clear()
        a, b = f.quantize_chain(x, -1, s, -1, backend="c")
        assert ran == ["fixed_then_bfp"]
        expected = f.quantize(x, backend="reference")
        assert_bitwise_equal(a, expected, "first")
        assert_bitwise_equal(b, s.quantize(expected, -1, backend="reference"), "second")


def test_results_do_not_depend_on_the_thread_count():
    """Tensors above the kernels' parallel threshold (32,768 values), on 1 and on 2 threads."""
    x = wide_tensor((512, 256), seed=11)
    bfp8, bfp2, fixed16 = parse_format("bfp8"), parse_format("bfp2"), parse_format("fixed16")
    runs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            values, packed = bfp8.quantize_and_pack(x, 1, bfp2, 0, backend="c")
            runs.append(
                [bfp8.quantize(x, backend="c"), fixed16.quantize(x, backend="c"),
                 values, *packed.payload.values(), packed.unpack(backend="c"),
                 *fixed16.quantize_chain(x, -1, bfp8, -1, backend="c")]
            )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*runs):
        assert torch.equal(one.contiguous().view(torch.uint8), two.contiguous().view(torch.uint8))


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as in a new process, with its cache in tmp_path (restored afterwards)."""
    monkeypatch.setenv("DSQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSQ_BACKEND", raising=False)  # the fallback is auto's

    def forget():
        c_kernels.library.cache_clear()
        c_kernels.build_failure.cache_clear()
        backends.auto_backend.cache_clear()
        backend_c.unavailable_reason.cache_clear()
        warn_once.cache_clear()

    forget()
    yield forget
    forget()


def _falls_back(caplog) -> None:
    """``auto`` runs a covered call on the compile backend, exactly, with one warning saying so;
    the c backend named explicitly is an error."""
    x = wide_tensor((4, 32), seed=6)
    with caplog.at_level("INFO", logger="dsq.formats"):
        for _ in range(2):
            out = parse_format("bfp8").quantize(x)
    assert_bitwise_equal(out, parse_format("bfp8").quantize(x, backend="reference"))
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "quantizers on the compile backend" in warned[0].message
    with pytest.raises(RuntimeError, match="backend 'c' cannot run here"):
        parse_format("bfp8").quantize(x, backend="c")


def fake_compiler(tmp_path, calls) -> str:
    """An executable C++ compiler that answers --version (torch's extension builder asks it) and
    fails every compilation with an error line, then a last line; each call logged to calls."""
    script = tmp_path / "fake-c++"
    script.write_text(
        "#!/bin/sh\n"
        f'echo x >> "{calls}"\n'
        'case "$*" in *--version*) echo "g++ (fake) 1.0"; exit 0;; esac\n'
        'echo "bfp_ops.cpp:1:1: error: no such thing" >&2\n'
        'echo "compilation terminated." >&2\nexit 1\n'
    )
    script.chmod(0o755)
    return str(script)


def test_a_missing_compiler_is_named_and_the_compile_backend_runs_instead(
    monkeypatch, tmp_path, caplog, fresh_loader
):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    reason = c_kernels.unavailable_reason()
    assert reason is not None and "no-such-c++" in reason and "set CXX" in reason
    _falls_back(caplog)


def test_an_unwritable_cache_falls_back(monkeypatch, tmp_path, caplog, fresh_loader):
    """A cache path that cannot be a folder (a read-only home, a file in the way) is a build
    failure like any other, not an exception from every quantizer call."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DSQ_CACHE", str(tmp_path / "a-file"))
    assert "cannot be built here" in c_kernels.unavailable_reason()
    _falls_back(caplog)


def test_a_compiler_error_is_quoted_for_each_variant(monkeypatch, tmp_path, caplog, fresh_loader):
    """When no variant builds, BuildError quotes the compiler's error line (not its last line)
    for each, and each variant was tried in its own folder of the cache."""
    calls = tmp_path / "calls"
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, calls))
    reason = c_kernels.unavailable_reason()
    assert reason.startswith("bfp_ops.cpp did not build with ") and "set CXX" in reason
    assert "error: no such thing" in reason and "compilation terminated" not in reason
    assert reason.count("error: no such thing") == len(c_kernels.VARIANTS)
    for variant in ("[-march=native -fopenmp]", "[-fopenmp]", "[plain]"):
        assert variant in reason
    folders = sorted(path.name for path in (tmp_path / "cache" / "c-kernels").iterdir())
    assert len(folders) == len(c_kernels.VARIANTS) and all(
        name.startswith("bfp_ops-") for name in folders
    )
    _falls_back(caplog)


@pytest.mark.slow
def test_the_build_lock_waits_for_its_holder_and_outlives_a_killed_build(tmp_path, caplog,
                                                                         monkeypatch):  # fmt: skip
    """A build waits, with one warning, while another process holds its folder's lock; once that
    process is killed (SIGKILL, as a build killed midway) the system releases the lock, and the
    lock file torch's builder left in the folder (which it would wait on forever) is deleted."""
    pytest.importorskip("fcntl")
    monkeypatch.setattr(c_kernels, "WAIT_WARNING_S", 0.3)
    (tmp_path / "lock").write_text("")  # torch's builder's, left by the killed build
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fcntl.flock(os.open(sys.argv[1], os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\ntime.sleep(300)", str(tmp_path / c_kernels.LOCK_FILE)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        threading.Timer(1.0, holder.kill).start()
        with caplog.at_level("WARNING", logger="dsq.kernels"), c_kernels._build_lock(tmp_path):
            assert holder.wait(timeout=5) == -9
            assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    waited = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert waited == [f"waiting for another process's build of the C kernels in {tmp_path}"]


def _folders(sources=c_kernels.SOURCES) -> set[str]:
    """The cache folders of the variants' builds of ``sources`` on this CPU."""
    flags = [[*c_kernels.FLAGS, *variant] for variant in c_kernels.VARIANTS]
    return {f"bfp_ops-{c_kernels.build_key(sources, f)}" for f in flags}


ROOT = Path(c_kernels.__file__).parents[2]  # the checkout this process imported dsq from
LOAD = "from dsq.kernels import cpu\nprint(cpu.__file__)\nprint(cpu.library())\n"


def _load(cache: Path, root: Path = ROOT, code: str = LOAD, timeout: float = 600) -> list[str]:
    """The lines a new process prints running ``code`` with dsq imported from the checkout
    ``root`` and the cache ``cache`` (the kernels are loaded in another process: this one may
    have loaded them from another folder already, and loading them twice aborts)."""
    env = {**os.environ, "PYTHONPATH": str(root), "DSQ_CACHE": str(cache)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(a cache of the tests' own, the library built in it by a new process)."""
    cache = tmp_path_factory.mktemp("c-kernels") / "cache"
    return cache, Path(_load(cache)[1])


@pytest.mark.slow  # builds the kernels (once per module, in a new process)
def test_the_build_is_cached_per_cpu_and_sources(monkeypatch, tmp_path, built):
    """The library lies in $DSQ_CACHE/c-kernels, in a folder named by the hash of its sources,
    flags, torch's version and the CPU, and a new process loads it without building it again;
    an edited source, or another CPU model or flag set, builds elsewhere."""
    cache, path = built
    assert path.parent.parent == cache / "c-kernels" and path.parent.name in _folders()
    stamp = path.stat().st_mtime_ns
    assert _load(cache) == [c_kernels.__file__, str(path)]
    assert path.stat().st_mtime_ns == stamp
    edited = tmp_path / "bfp_cpu.c"
    edited.write_bytes(c_kernels.SOURCES[1].read_bytes() + b"\n")
    assert not _folders() & _folders((c_kernels.SOURCES[0], edited))
    identity = c_kernels._cpu_identity()
    monkeypatch.setattr(c_kernels, "_cpu_identity", lambda: identity + " another_flag")
    assert path.parent.name not in _folders()


@pytest.mark.slow  # builds the kernels (once per module, in a new process)
def test_another_checkout_with_the_same_sources_shares_the_build(tmp_path, built):
    """The build compiles copies of the sources in its folder, so its command names no checkout:
    a clone's process loads the same library without rebuilding it (formerly the two checkouts
    relinked it in turn, each under the other's feet)."""
    cache, path = built
    assert (path.parent / "src" / "bfp_cpu.c").read_bytes() == c_kernels.SOURCES[1].read_bytes()
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "dsq", clone / "dsq", ignore=shutil.ignore_patterns("__pycache__"))
    stamp = path.stat().st_mtime_ns
    module, loaded = _load(cache, root=clone)
    assert Path(module).is_relative_to(clone) and loaded == str(path)
    assert path.stat().st_mtime_ns == stamp
    command = (path.parent / "build.ninja").read_text()
    assert str(ROOT / "dsq") not in command and str(clone) not in command


@pytest.mark.slow  # builds the kernels (once per module, in a new process)
def test_the_build_runs_the_ninja_packages_binary_whatever_ninja_path_finds_first(
    monkeypatch, tmp_path, built
):
    """Two ninja versions hash a build command differently, and each rebuilds what the other
    logged: the builder runs the `ninja` package's binary, not the first `ninja` on PATH (here
    one that records its call and fails), so processes started with and without an activated
    virtualenv share the build."""
    pytest.importorskip("ninja")
    cache, path = built
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'called'}\nexit 1\n")
    fake.chmod(0o755)
    stamp = path.stat().st_mtime_ns
    # _load's process inherits it
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake.parent), os.environ.get("PATH", "")]))
    assert _load(cache)[1] == str(path)
    assert not (tmp_path / "called").exists()
    assert path.stat().st_mtime_ns == stamp
    # by a folder of its own: nothing else of the package's folder (a virtualenv's bin, or
    # /usr/bin with its compilers) comes before the user's PATH
    import ninja

    (folder,) = (cache / "ninja").iterdir()
    assert [p.name for p in folder.iterdir()] == ["ninja"]
    assert (folder / "ninja").resolve() == (Path(ninja.BIN_DIR) / "ninja").resolve()


@pytest.mark.slow  # builds the kernels (once per module, in a new process)
def test_a_killed_builds_lock_file_does_not_block_a_load(built):
    """torch's builder waits forever on a lock file left by a build killed midway; the next load
    deletes it (it holds the folder's flock, so no live builder owns it) and goes on."""
    cache, path = built
    (path.parent / "lock").write_text("")
    assert _load(cache, timeout=180)[1] == str(path)
    assert not (path.parent / "lock").exists()


@pytest.mark.slow  # builds the kernels (once per module, in a new process)
def test_a_read_only_cache_loads_its_build(built):
    """A folder holding the built library that this user cannot write (a shared, read-only cache)
    is loaded as it is, its fake kernels registered, instead of failing torch's lock step and
    falling back to the compile backend."""
    cache, path = built
    code = (
        "import os, torch, torch.utils.cpp_extension\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from dsq.kernels import cpu\n"
        "if os.geteuid() == 0:  # root writes anywhere: the folder and the builder as for a user\n"
        "    cpu._writable = lambda directory: False\n"
        "    def refuse(*args, **kwargs):\n"
        "        raise PermissionError(13, 'Permission denied', 'lock')\n"
        "    torch.utils.cpp_extension.load = refuse\n"
        "print(cpu.library())\n"
        "print(cpu.bfp_quantize(torch.full((1, 16), 0.3), 2, 8)[0, 0].item())\n"
        "with FakeTensorMode():\n"
        "    print(tuple(cpu.bfp_quantize(torch.empty(3, 16), 4, 8).shape))\n"
    )
    before = sorted(path.parent.iterdir()), path.stat().st_mtime_ns
    path.parent.chmod(0o555)
    try:
        assert _load(cache, code=code, timeout=180) == [str(path), "0.25", "(3, 16)"]
    finally:
        path.parent.chmod(0o755)
    assert (sorted(path.parent.iterdir()), path.stat().st_mtime_ns) == before


def test_decode_refuses_a_short_stream():
    packed = parse_format("bfp4").pack(torch.randn(4, 32))
    mantissas, exponents = packed.payload["mantissas"], packed.payload["exponents"]
    with pytest.raises(ValueError, match="fewer than 128 codes of 4 bits"):
        c_kernels.bfp_decode(mantissas[:-1], exponents, 4, 32, 16, 4, 8)
    with pytest.raises(ValueError, match="fewer than 8 codes of 8 bits"):
        c_kernels.bfp_decode(mantissas, exponents[:-1], 4, 32, 16, 4, 8)
