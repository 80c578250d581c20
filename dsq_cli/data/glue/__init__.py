"""The GLUE data layer: the registered tasks (``tasks``), the strict TSV reader (``reader``), the
verified download and preparation (``prepare``) and a run's examples (``load``).

Scoring lives with the trainer (dsq_cli.train.glue_metrics)."""

from .load import GlueData, load_glue
from .prepare import PREPARED, prepare_glue
from .reader import GlueExample, read_examples
from .tasks import GLUE_TASKS, GlueTask, get_glue_task, register_glue_task

__all__ = [
    "GLUE_TASKS",
    "PREPARED",
    "GlueData",
    "GlueExample",
    "GlueTask",
    "get_glue_task",
    "load_glue",
    "prepare_glue",
    "read_examples",
    "register_glue_task",
]
