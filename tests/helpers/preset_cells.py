"""The (preset, stash_scope) cells a test may run: every preset of dsq_cli/conf/quant/ (globbed,
so a new file is covered) at each scope its configuration accepts. ``quant.engine=autocast``
(amp_bf16) accepts ``gemm`` only (docs/dsq.md, "Autocast: the baseline users run"): autograd
keeps its own saved tensors there, so there is no stash to widen, and `dsq train` refuses the
other scope with a usage error (tests/dsq_cli/test_config_matrix.py)."""

from __future__ import annotations

from dsq.engine import QuantConfig
from dsq.engine.config import STASH_SCOPES
from dsq_cli.presets import CONF_DIR, load_quant_preset

PRESETS = sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))


def scope_refusal(preset: str, scope: str) -> str | None:
    """Why the configuration refuses ``preset`` at ``scope``, or None where it accepts it."""
    try:
        QuantConfig.from_dict(load_quant_preset(preset) | {"stash_scope": scope})
    except ValueError as err:
        return str(err)
    return None


def accepted_cells(presets=PRESETS) -> list[tuple[str, str]]:
    return [(p, s) for p in presets for s in sorted(STASH_SCOPES) if scope_refusal(p, s) is None]


def refused_cells(presets=PRESETS) -> list[tuple[str, str]]:
    return [(p, s) for p in presets for s in sorted(STASH_SCOPES) if scope_refusal(p, s)]
