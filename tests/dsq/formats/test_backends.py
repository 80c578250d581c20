"""The one switch over the quantizer backends (docs/formats.md, "Implementations: the backends"):
every backend module holds every operation, DSQ_BACKEND names one or is refused in one line."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dsq.formats import backends, parse_format
from dsq.warn_once import warn_once


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_loads_and_holds_the_bfp_and_fixed_point_kernels(name):
    """Every backend module says where it runs (the triton one loads without CUDA too), and
    registers a kernel for every operation of the families it was written for."""
    module = backends.load_backend(name)
    assert callable(module.unavailable_reason)
    assert backends.family_ops("bfp") == (
        "quantize",
        "pack",
        "unpack",
        "fusable_quantize_and_pack",
        "quantize_and_pack",
        "fusable_quantize_chain",
        "quantize_chain",
    )
    assert backends.family_ops("fixed_static") == ("quantize", "pack", "unpack")
    assert backends.missing_kernels(name, "bfp") == []
    assert backends.missing_kernels(name, "fixed_static") == []


def test_a_missing_kernel_runs_the_reference_with_one_logged_line(monkeypatch, caplog):
    """A backend without a kernel for an operation runs the family's reference kernel, says so
    once, and lists the operation in `missing_kernels`."""
    import logging

    from dsq.formats import fixed_reference as reference

    assert backends.missing_kernels("compile", "fixed_static") == []  # its module loaded
    monkeypatch.delitem(backends._KERNELS, ("compile", "fixed_static", "quantize"))
    warn_once.cache_clear()
    x = torch.randn(40, generator=torch.Generator().manual_seed(1))
    fmt = parse_format("fixed8f4")
    with caplog.at_level(logging.WARNING, logger="dsq.formats"):
        for _ in range(3):
            assert backends.kernel("fixed_static", "quantize", "compile") is (
                reference.fixed_static_quantize
            )
            assert torch.equal(
                fmt.quantize(x, backend="compile"), fmt.quantize(x, backend="reference")
            )
    assert [r.getMessage() for r in caplog.records] == [
        "dsq: the compile backend has no fixed_static quantize kernel; the reference runs it"
    ]
    assert backends.missing_kernels("compile", "fixed_static") == ["fixed_static.quantize"]


def test_the_environment_variable_chooses_and_auto_is_the_default(monkeypatch):
    x = torch.randn(4, 32)
    monkeypatch.delenv("DSQ_BACKEND", raising=False)
    automatic = backends.select_backend(x)
    monkeypatch.setenv("DSQ_BACKEND", "auto")
    assert backends.select_backend(x) is automatic
    monkeypatch.setenv("DSQ_BACKEND", "reference")
    assert backends.select_backend(x) is backends.load_backend("reference")
    assert backends.default_backend() == "reference"
    # a call's own backend= wins over the variable
    assert backends.select_backend(x, "compile") is backends.load_backend("compile")


def test_the_reference_runs_pairs_as_the_two_calls(monkeypatch):
    """The reference fuses nothing: a pair asked of it runs the two calls (its own pair functions
    never run), with the two calls' results."""
    from dsq.formats import bfp_reference as reference

    def refuse(*args):
        raise AssertionError("the reference ran a fused pair")

    monkeypatch.setattr(reference, "bfp_quantize_and_pack", refuse)
    monkeypatch.setattr(reference, "bfp_quantize_chain", refuse)
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    bfp8, bfp2, fixed16 = (parse_format(s) for s in ("bfp8", "bfp2", "fixed16"))
    values, packed = bfp8.quantize_and_pack(x, 1, bfp2, 0, backend="reference")
    assert torch.equal(values, bfp8.quantize(x, 1, backend="reference"))
    assert torch.equal(packed.unpack(), bfp2.quantize(x, 0, backend="reference"))
    first, second = fixed16.quantize_chain(x, 0, bfp8, 1, backend="reference")
    assert torch.equal(second, bfp8.quantize(first, 1, backend="reference"))


@pytest.mark.parametrize("command", [["version"], ["format", "bfp4", "--values", "1,2"]])
def test_dsq_refuses_an_unknown_backend_in_one_line(command, monkeypatch):
    from dsq_cli.cli import app

    monkeypatch.setenv("DSQ_BACKEND", "fast")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "dsq: error: unknown DSQ_BACKEND 'fast'; choose one of auto, reference, compile, c, triton"
    ]
    monkeypatch.setenv("DSQ_BACKEND", "reference")
    assert CliRunner().invoke(app, command).exit_code == 0


def test_a_backend_that_cannot_run_here_is_refused_before_a_run_starts(monkeypatch, tmp_path):
    """DSQ_BACKEND=triton on a CPU-only run: one line, exit 2, no run directory."""
    from dsq_cli.cli import app

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter, off
    reason = backends.unavailable_reason("triton", "cpu")
    assert reason is not None
    monkeypatch.setenv("DSQ_BACKEND", "triton")
    result = CliRunner().invoke(
        app, ["train", "task=demo", "quant=dsq", "train.device=cpu", f"run.root={tmp_path}"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"dsq: error: DSQ_BACKEND=triton cannot run on cpu here: {reason}; unset it (auto) or "
        "choose another backend"
    ]
    assert not any(tmp_path.iterdir())
    result = CliRunner().invoke(app, ["bench", "step", "--repeats", "1"])
    assert result.exit_code == 2 and "DSQ_BACKEND=triton cannot run on cpu" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "c"])  # compile: its own compiled kernels
def test_torch_compile_traces_a_stash_round_trip_as_one_graph(backend):
    """A BFP stash packed and unpacked on the automatic backend (the C kernels here) or a named
    one traces as one graph with eager's values bit for bit: the backend lookups, a named
    backend's availability check and the C decode's row joining (which reads torch's thread
    count) break no graph."""
    if backend and backends.unavailable_reason(backend, "cpu"):
        pytest.skip(backends.unavailable_reason(backend, "cpu"))
    fmt = parse_format("bfp4")
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))

    def round_trip(x):
        return fmt.pack(x, axis=-1, backend=backend).unpack(backend=backend)

    eager = round_trip(x)  # the first call imports the backend; a compiled one only looks it up
    explained = torch._dynamo.explain(round_trip)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    compiled = torch.compile(round_trip, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(compiled(x).view(torch.int32), eager.view(torch.int32))


def test_backend_modules_hold_no_familys_kernels_and_each_family_names_its_own():
    """A backend module says where it runs and holds what its families' kernels share; every
    kernel of BFP and static fixed point is in a module of the family's, named in its
    ``declare_family`` (docs/formats.md, "Adding a format family")."""
    import importlib
    import inspect

    for name in ("compile", "c", "triton"):
        source = inspect.getsource(backends.load_backend(name))
        assert "register_kernel" not in source, name
    for family, prefix in (("bfp", "bfp"), ("fixed_static", "fixed")):
        declared = backends._FAMILY_MODULES[family]
        assert declared == {b: f"dsq.formats.{prefix}_{b}" for b in ("compile", "c", "triton")}
        for backend, module in declared.items():
            importlib.import_module(module)
            assert backends.missing_kernels(backend, family) == []
