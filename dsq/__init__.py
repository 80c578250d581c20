"""dsq: Dynamic Stashing Quantization (Yang, Lo, Mullins, Zhao, EMNLP Findings 2023) for any
PyTorch model. It imports torch only (Triton optional; the ``hf`` extra, ``pip install '.[hf]'``
in a checkout, adds transformers); its CPU
kernels build on first use with ninja, setuptools and oneDNN's headers (pyproject.toml).

    >>> import dsq
    >>> cfg = dsq.QuantConfig.from_preset("dsq")     # the paper's DSQ (dsq.presets names them)
    >>> model = dsq.quantize_model(model, cfg)       # in place; model.dsq_report says what
    >>> cfg.step(valid_loss, update=n)                # after each validation

    >>> with dsq.record_gemms() as recorder:         # one training step
    ...     model(batch).sum().backward()
    >>> dsq.cost.ratios(recorder.gemms)               # (arith, DRAM) against fixed32: the cost
    (0.0513, 0.3607)                                  # model of docs/cost-model.md

Layers, each importing only those below it: ``integrations`` (fairseq, Hugging Face) -> ``cost``
(the cost model: arithmetic and DRAM per training step) -> ``engine`` (the quantized GEMMs, the
stash, precision policies, GEMM units, the spec of a quant config) with ``presets`` (the named
specs) -> ``formats`` (the number formats and their paths) -> ``kernels`` (C and Triton). The
names below (and the modules ``dsq.cost`` and ``dsq.presets``) load on first use, so
``import dsq`` itself loads nothing but this file.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"  # the distribution's version too (pyproject.toml reads it from here)

_API = {
    "CostModel": "dsq.cost",
    "QuantConfig": "dsq.engine",
    "QuantSpec": "dsq.engine",
    "Ladder": "dsq.engine",
    "Schedule": "dsq.engine",
    "dsq_linear": "dsq.engine",
    "dsq_matmul": "dsq.engine",
    "record_gemms": "dsq.engine",
    "patch_model": "dsq.engine",
    "POINTS": "dsq.engine",
    "parse_format": "dsq.formats",
    "quantize_model": "dsq.integrations",
    "unpatch": "dsq.integrations",
    "register_patcher": "dsq.integrations",
}
# submodules loaded on first use: dsq.cost.ratios(...), dsq.presets.get_preset("dsq")
_MODULES = ("cost", "presets")
__all__ = sorted([*_API, *_MODULES])


def __dir__() -> list[str]:
    """What completes after ``dsq.``: the exports, loaded or not, and the version."""
    return sorted([*__all__, "__version__"])


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"dsq.{name}")
    if name not in _API:
        raise AttributeError(f"module 'dsq' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
