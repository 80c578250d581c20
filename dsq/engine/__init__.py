"""The DSQ engine (docs/spec.md §2 and §3): quantized GEMMs with a packed stash, and time-adaptive
precision controlled from one ``QuantConfig``.

    >>> from dsq.engine import QuantConfig, Schedule, dsq_linear, dsq_matmul
    >>> cfg = QuantConfig(q0="bfp8", q1=Schedule(["bfp2", "bfp4", "bfp8"], patience=1),
    ...                   q2="bfp8", q3="fixed16", stash_scope="gemm")
    >>> y = dsq_linear(x, weight, bias, cfg)
    >>> cfg.step(valid_loss, update=1000)   # after each validation: every layer sees the change
"""

from .accounting import GemmRecord, record_gemms
from .config import POINT_HELP, POINTS, STASH_SCOPES, QuantConfig
from .functions import DSQLinearFunction, DSQMatmulFunction, dsq_linear, dsq_matmul
from .history import PrecisionHistory, change_record
from .patch import DSQLinear, Patcher, PatchReport, make_dsq_linear, patch_model, stash_all_hooks
from .schedule import LevelChange, Schedule
from .spec import Ladder, QuantSpec

__all__ = [
    "DSQLinear",
    "DSQLinearFunction",
    "GemmRecord",
    "PatchReport",
    "Patcher",
    "make_dsq_linear",
    "patch_model",
    "record_gemms",
    "stash_all_hooks",
    "DSQMatmulFunction",
    "LevelChange",
    "Ladder",
    "POINTS",
    "PrecisionHistory",
    "change_record",
    "POINT_HELP",
    "QuantConfig",
    "QuantSpec",
    "STASH_SCOPES",
    "Schedule",
    "dsq_linear",
    "dsq_matmul",
]
