"""The table (and its frontier plot) logged as one wandb run."""

from __future__ import annotations

import os
from pathlib import Path

from .cells import Table
from .records import CSV_COLUMNS, cell_records, reference_records


def log_to_wandb(
    table: Table,
    project: str = "dsq",
    wandb_dir: str | os.PathLike = ".",
    plot_path: str | os.PathLike | None = None,
):
    """Log Table 1 (the CSV's columns) and the frontier plot as one wandb run (job_type
    ``table``): online with a login, offline otherwise (as ``logger.mode=auto``)."""
    import wandb

    from dsq_cli.loggers import wandb_mode

    Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        job_type="table",
        dir=str(wandb_dir),
        mode=wandb_mode("auto"),
        config={"rows": table.rows, "columns": [c.label for c in table.columns]},
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        records = [{"kind": "result", **r} for r in cell_records(table)]
        records += reference_records(table)
        data = [[record.get(column) for column in CSV_COLUMNS] for record in records]
        values = {"table1": wandb.Table(columns=list(CSV_COLUMNS), data=data)}
        if plot_path is not None:
            values["frontier"] = wandb.Image(str(plot_path))
        run.log(values)
    finally:
        run.finish()
    return run
