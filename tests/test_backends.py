"""The one switch over the quantizer backends (docs/formats.md, "Implementations: the backends"):
every backend module holds every operation, DSQ_BACKEND names one or is refused in one line."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dsq.formats import backends, parse_format


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_defines_every_operation(name):
    """Loading checks the module against the protocol (the triton one loads without CUDA too)."""
    module = backends.load_backend(name)
    assert backends.OPERATIONS == (
        "unavailable_reason",
        "bfp_quantize",
        "bfp_pack",
        "bfp_unpack",
        "fixed_static_quantize",
        "fixed_static_pack",
        "fixed_static_unpack",
        "fusable_quantize_and_pack",
        "bfp_quantize_and_pack",
        "fusable_quantize_chain",
        "bfp_quantize_chain",
    )
    assert all(callable(getattr(module, op)) for op in backends.OPERATIONS)


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
    from dsq.formats import reference

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
