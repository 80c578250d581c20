"""fairseq 0.12 against the Hydra 1.3 and torch 2.6+ that dsq runs with.

* ``convert_namespace_to_omegaconf`` uses ``hydra.experimental`` and Hydra 1.0-style configs,
  an error once Hydra's version base is 1.2 or later (dsq's own composition sets 1.3):
  `namespace_to_config` runs it under base 1.1, for the duration of the call only.
* fairseq's NanDetector fails under torch 2.6+: `nan_detector_disabled` swaps in a neutral one
  while training.
* fairseq 0.12 warns at every update about torch APIs it uses: `quiet_library_warnings`.
* `transformer_layers`: the layers of a fairseq model, for activation checkpointing.

Loading fairseq's own checkpoint format lives with the models (dsq_cli.models.fairseq_checkpoint).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _hydra_11_for_fairseq():
    """fairseq composes its config with Hydra 1.1 semantics (``hydra.experimental``, ``@package
    _group_``), which Hydra 1.3 keeps only while the global version base is 1.1. dsq's own
    composition sets base 1.3; fairseq gets 1.1 for the duration of its call."""
    import warnings

    from hydra import version
    from hydra.core.global_hydra import GlobalHydra
    from packaging.version import Version

    saved = version.getbase()
    version.setbase("1.1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hydra's deprecation notes about fairseq's usage
            yield
    finally:
        if isinstance(saved, Version):  # unset before: every later initialize() sets its own
            version.VersionBase.instance().setbase(saved)
        GlobalHydra.instance().clear()


def namespace_to_config(args):
    """fairseq's ``convert_namespace_to_omegaconf(args)``, working under Hydra 1.3."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    with _hydra_11_for_fairseq():
        return convert_namespace_to_omegaconf(args)


class _NoNanDetector:
    """Stands in for fairseq's NanDetector, whose forward hooks fail under torch 2.6+ (a
    ``StopIteration`` from torch's hook plumbing), turning a NaN into an unrelated crash."""

    def __init__(self, model, forward=True, backward=True):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def nan_detector_disabled():
    """While training: fairseq re-runs a NaN step under NanDetector before raising
    FloatingPointError; with the detector neutral, the FloatingPointError (which dsq reports as
    a divergence) is what comes out."""
    import fairseq.trainer

    saved = fairseq.trainer.NanDetector
    fairseq.trainer.NanDetector = _NoNanDetector
    try:
        yield
    finally:
        fairseq.trainer.NanDetector = saved


def quiet_library_warnings() -> None:
    """fairseq 0.12 on torch 2.x warns at every update about APIs it uses (autocast, jit,
    pin_memory without a GPU); they say nothing about the run and drown the progress line."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairseq\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true.*")


def transformer_layers(model) -> list:
    """Every fairseq transformer layer of ``model`` (encoder and decoder layers, RoBERTa's
    included), in module order."""
    from fairseq.modules import transformer_layer

    kinds = (transformer_layer.TransformerEncoderLayerBase,
             transformer_layer.TransformerDecoderLayerBase)  # fmt: skip
    return [m for m in model.modules() if isinstance(m, kinds)]
