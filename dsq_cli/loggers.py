"""Experiment loggers: `logger=wandb` (offline unless the user has a login) or `logger=none`.

The run directory is the record of truth (``dsq table`` reads only it); a logger receives the
same dictionaries the run files get, so wandb's numbers equal result.json's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dsq_cli import runs

if TYPE_CHECKING:
    from dsq_cli.run_config import LoggerConfig

log = logging.getLogger(__name__)
LOGGERS: dict[str, type] = {}


def register_logger(name: str):
    def add(cls):
        LOGGERS[name] = cls
        return cls

    return add


@register_logger("none")
class NoLogger:
    """Writes nothing beyond the run directory."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: Mapping):
        pass

    def log(self, record: Mapping) -> None:
        pass

    def event(self, record: Mapping) -> None:
        pass

    def summary(self, values: Mapping) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def _has_wandb_login() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def wandb_mode(configured: str) -> str:
    """``auto``: WANDB_MODE if the user set it, else online with a login and offline without."""
    if configured != "auto":
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if _has_wandb_login() else "offline"


def _flatten(record: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            flat[name] = value
    return flat


@register_logger("wandb")
class WandbLogger:
    """Config, losses, learning rate, bits per point (as numbers), schedule events, final metrics
    and the cost summary. Files go under the run directory (``RUN/wandb``)."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: Mapping):
        import wandb

        self.wandb = wandb
        mode = wandb_mode(cfg.mode or "auto")
        self.run = wandb.init(
            project=cfg.project,  # null: wandb's default project
            entity=cfg.entity,
            group=cfg.group,
            tags=list(cfg.tags),
            name=run_dir.name,
            dir=str(run_dir),
            config=runs.scrub_secrets(dict(config)),  # no secrets in wandb (docs/spec.md §7)
            mode=mode,
            resume="allow",
            id=run_dir.name.replace("=", "-")[-120:],
            settings=wandb.Settings(console="off", silent=True),
        )
        log.info("wandb run %s (%s)", self.run.id, mode)

    def log(self, record: Mapping) -> None:
        kind = record.get("kind", "train")
        values = {
            f"{kind}/{k}": v
            for k, v in _flatten(record).items()
            if k not in ("kind", "update") and not isinstance(v, str)
        }
        values.update(_bits_as_numbers(record.get("bits"), f"{kind}/bits"))
        self.run.log(values, step=int(record.get("update", 0)))

    def event(self, record: Mapping) -> None:
        values = {f"schedule/{record['point']}_level": record["to_level"]}
        self.run.log(values, step=int(record["update"]))

    def summary(self, values: Mapping) -> None:
        # one message to wandb's service for all the values (set key by key, they were one
        # message each, and the run file of a run on a heavily overloaded machine lacked one)
        self.run.summary.update(_flatten(values))

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def _bits_as_numbers(bits, prefix: str) -> dict:
    """q0..q3 specs in force as bits per value, so that wandb can plot them."""
    if not isinstance(bits, Mapping):
        return {}
    from dsq.formats import parse_format

    return {f"{prefix}_{p}": parse_format(spec).bits_per_value for p, spec in bits.items()}


def make_logger(cfg: LoggerConfig, run_dir: Path, config: Mapping):
    name = cfg.name
    if name not in LOGGERS:
        raise ValueError(f"unknown logger {name!r}; choose one of {sorted(LOGGERS)}")
    return LOGGERS[name](cfg, run_dir, config)
