"""Framework integrations: what ``quantize_model`` patches in fairseq and Hugging Face
``transformers`` models beyond ``nn.Linear``, as registered patchers (``dsq.engine.patch.Patcher``).

``quantize_model`` looks at the packages the model's modules come from and loads the integration
of each framework it finds there (its module registers the framework's patchers on import), so a
plain PyTorch or ``transformers`` model never imports fairseq, and a fairseq model never imports
``transformers``. A third party registers its own layers the same way:
``register_patcher("mylib", MyPatcher())`` patches them in any model holding a module of
``mylib``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from dsq.engine.accounting import observe_linears
from dsq.engine.config import QuantConfig
from dsq.engine.patch import Patcher, patch_model, unpatch_model
from dsq.engine.spec import QuantSpec

# The integration modules of this package, by the top-level package whose classes they patch.
INTEGRATIONS = {"fairseq": f"{__name__}.fairseq", "transformers": f"{__name__}.hf"}
_PATCHERS: dict[str, list[Patcher]] = {}


def register_patcher(framework: str, patcher: Patcher) -> None:
    """Patch ``framework``'s layers with ``patcher`` in every model holding a module of it."""
    _PATCHERS.setdefault(framework, []).append(patcher)


def frameworks_of(model: nn.Module) -> set[str]:
    """The top-level packages the classes of ``model``'s modules come from."""
    return {type(module).__module__.partition(".")[0] for module in model.modules()}


def patchers_for(model: nn.Module) -> list[Patcher]:
    """The registered patchers of the frameworks ``model`` is built from, loading the
    integration of each (its framework is imported already: the model's classes come from it)."""
    frameworks = sorted(frameworks_of(model))
    for framework in frameworks:
        if framework in INTEGRATIONS:
            importlib.import_module(INTEGRATIONS[framework])
    return [p for framework in frameworks for p in _PATCHERS.get(framework, [])]


def quantize_model(
    model: nn.Module,
    cfg: QuantConfig | QuantSpec,
    exclude=(),
    strict: bool = False,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Patch ``model`` in place for DSQ training and return it; ``model.dsq_report`` tells what
    was patched. ``cfg`` is a `QuantConfig`, or a frozen `QuantSpec`
    (``dsq.presets.get_preset("dsq")``), of which a QuantConfig is made: ``model.dsq_cfg``, the
    schedule to step. ``exclude`` holds glob patterns of module names
    (``decoder.output_projection``, ``*.out_proj``); ``filter_fn(module, name)``, as torchao's
    ``quantize_``, returns whether a layer is patched (False: it stays as it is, and the report
    lists it as excluded). Works on plain PyTorch, fairseq and ``transformers`` models
    (docs/hf.md). ``strict=True``: a GEMM that would run unquantized (an unknown layer holding a
    matrix, an attention implementation dsq cannot route) is an error instead of a line of the
    report. `unpatch` undoes it."""
    return patch_model(model, cfg, patchers_for(model), exclude, strict, filter_fn)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `quantize_model` in place and return ``model``: its modules' classes, hooks and
    attention routing as before, so it computes what it computed before and can be patched
    again (another config) or saved as the plain model."""
    return unpatch_model(model)


def observe_model(model: nn.Module, cfg: QuantConfig) -> list:
    """Hooks that note the GEMMs of a model the engine does not patch (``cfg.engine`` autocast)
    as `dsq.engine.accounting` records in ``cfg``'s formats: every ``nn.Linear``, and the
    attention products of modules a framework's patcher can observe (its ``observe``). The run is
    then priced on the GEMMs it ran, as a patched one is. Returns the hooks' handles."""
    handles = observe_linears(model, cfg)
    observers = [p for p in patchers_for(model) if hasattr(p, "observe")]
    for module in model.modules():
        patcher = next((p for p in observers if p.claims(module)), None)
        if patcher is not None:
            handles += patcher.observe(module, cfg)
    return handles
