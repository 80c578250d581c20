"""Training: from a typed run config to a finished run directory.

The layers, each importing only those below it (docs/architecture.md):

    entry        train(), load_resume(): family -> data -> run directory -> launch
    launch       N processes on this machine, each running the per-rank function it is given
    rank_run     one rank's run: its trainer, its statuses, its result.json
    families     task.family (= model.family) -> data, trainer and the family's output lines
    translation, glue   the two trainers, filling in
    loop         the training loop both share (`Trainer`)
    glue_metrics   the GLUE dev metrics
    budget, recorder, progress_line, stop, ranks, fairseq_compat   what the loop uses
"""

from .entry import load_resume, prepare_data, train
from .fairseq_compat import quiet_library_warnings
from .families import family_of
from .rank_run import Outcome

__all__ = ["Outcome", "family_of", "load_resume", "prepare_data", "quiet_library_warnings", "train"]
