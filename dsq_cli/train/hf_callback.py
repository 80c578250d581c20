"""``DSQCallback``: DSQ's time-adaptive stash inside a Hugging Face ``transformers.Trainer``
(docs/hf.md, "Training with the Trainer"). Needs ``pip install dsq[hf]``.

    model = quantize_model(model, cfg, exclude=["classifier"])
    trainer = Trainer(model=model, args=args, ...)
    DSQCallback.attach(trainer, cfg)
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)

* After each evaluation the schedule steps on its ``eval_loss`` (docs/spec.md §3, as
  ``dsq train`` steps it on the validation loss), at ``state.global_step``; after each step the
  policies of the step count (``cyclic``, ``shape``; docs/dsq.md, "Precision policies") move.
* Every log line the Trainer sends to its loggers carries the bits per value in force at each
  point (``dsq/q1_bits``) and the number of level changes so far (``dsq/level_changes``); each
  change is also logged (logger ``dsq.hf``) and kept in ``callback.changes``.
* Each Trainer checkpoint gets ``dsq_schedule.pt`` (the schedules and the rounding noise's
  state); resuming from a checkpoint restores it, so the run continues at the same level.
* ``callback.result(...)`` is the run's ``result.json`` (docs/spec.md §5) for ``dsq table``: the
  callback records the GEMMs of the first training step and the steps trained at each level,
  which price the run as ``dsq train`` prices its own (docs/cost-model.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from dsq.engine import POINTS, QuantConfig, record_gemms
from dsq_cli import runs
from dsq_cli.cost.run_cost import run_cost, stash_bits_mean
from dsq_cli.run_result import RunResult

log = logging.getLogger("dsq.hf")
CHECKPOINT_FILE = "dsq_schedule.pt"


def quiet_logs() -> None:
    """For a training script: the libraries' warnings and chatter off (fairseq sets the root
    logger to INFO when imported), the schedule's level changes (logger ``dsq``) on."""
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("dsq").setLevel(logging.INFO)


class DSQCallback(TrainerCallback):
    """Steps ``cfg`` on evaluations, reports it to the Trainer's loggers, checkpoints it."""

    def __init__(self, cfg: QuantConfig) -> None:
        if not isinstance(cfg, QuantConfig):
            raise TypeError(f"cfg must be the model's QuantConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.changes: list[dict] = []
        self.segments: list[list] = []  # [points in force, steps trained with them], in order
        self.gemm_shapes: list[dict] = []  # the first training step's GEMMs (GemmRecord dicts)
        self._recording: contextlib.ExitStack | None = None
        self._recorder = None

    @classmethod
    def attach(cls, trainer: Trainer, cfg: QuantConfig) -> DSQCallback:
        """Add a DSQCallback to ``trainer`` first in its list, so that the bits it adds to a log
        line are there before the logging integrations (wandb, TensorBoard) send it."""
        callback = cls(cfg)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    # -- the schedule ---------------------------------------------------------------------------
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None:
            raise ValueError(
                "DSQCallback steps the schedule on eval_loss, and this evaluation has none; "
                "give the Trainer an eval_dataset with labels"
            )
        self._book(self.cfg.step(float(loss), state.global_step), state.global_step)
        return control

    def _book(self, changes, step: int) -> None:
        for point, change in changes:
            self.changes.append({"point": point, **dataclasses.asdict(change)})
            log.info("dsq: %s %s -> %s after step %d (%s)", point, change.from_spec,
                     change.to_spec, step, change.policy)  # fmt: skip

    def bits_in_force(self) -> dict[str, float]:
        return {f"dsq/{p}_bits": self.cfg.format(p).bits_per_value for p in POINTS}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            added = {**self.bits_in_force(), "dsq/level_changes": len(self.changes)}
            logs.update(added)  # the dict every later callback (the loggers) receives
            if state.log_history:  # the Trainer's copy of this line, appended just before
                state.log_history[-1].update(added)
        return control

    # -- what the run did, for its result ----------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if not self.gemm_shapes and self._recording is None:
            self._recording = contextlib.ExitStack()
            self._recorder = self._recording.enter_context(record_gemms())
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._recording is not None:
            self._recording.close()
            self.gemm_shapes = [g.to_dict() for g in self._recorder.gemms]
            self._recording = self._recorder = None
        points = self.cfg.current()
        if self.segments and self.segments[-1][0] == points:
            self.segments[-1][1] += 1
        else:
            self.segments.append([points, 1])
        self._book(self.cfg.after_update(state.global_step), state.global_step)
        return control

    def result(self, *, task: str, preset: str, points: Mapping, metric: str, value: float,
               valid_loss: float | None, model: str, seed: int, wall_seconds: float,
               evaluation: Mapping | None = None) -> RunResult:  # fmt: skip
        """The completed run's result.json (write it with ``.write(run_dir)``): ``preset`` and
        ``points`` are the conf/quant preset the QuantConfig was made from, as in ``dsq train``."""
        from dsq_cli.config import quant_differences  # Hydra's config, only for a result

        steps = sum(n for _, n in self.segments)
        return RunResult(
            status="completed",
            task=task,
            quant={
                "preset": preset,
                **points,
                "modified": quant_differences({"preset": preset, **points}) != [],
            },
            metric=metric,
            value=value,
            valid_loss=valid_loss,
            updates=steps,
            wall_seconds=round(wall_seconds, 3),
            cost=run_cost(self.gemm_shapes, self.segments),
            stash_bits_mean=stash_bits_mean(self.segments),
            versions=runs.versions(),
            model=model,
            seed=seed,
            bits_final=self.cfg.current(),
            precision_segments=[{"points": p, "updates": n} for p, n in self.segments],
            evaluation=dict(evaluation or {}) | {"level_changes": self.changes},
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():  # the Trainer wrote its checkpoint there just before
            state_dict = {
                "schedule": self.cfg.state_dict(),
                "noise": self.cfg.noise_state(),
                "changes": self.changes,
                "segments": self.segments,
                "gemm_shapes": self.gemm_shapes,
            }
            torch.save(state_dict, folder / CHECKPOINT_FILE)
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        needs_losses = [p for p, s in self.cfg.schedules.items() if s.policy.name == "pfq"]
        if needs_losses:
            raise ValueError(
                f"{needs_losses[0]}: policy pfq needs every step's training loss, which a "
                "Trainer callback does not see; use plateau, cyclic or shape here"
            )
        if state.global_step > 0:
            self._restore(args, state)
        # the policies of the step count need the planned steps (a resumed run: its level)
        self.cfg.start(state.max_steps, state.global_step)
        return control

    def _restore(self, args, state) -> None:
        candidates = [Path(args.output_dir) / f"checkpoint-{state.global_step}" / CHECKPOINT_FILE]
        if isinstance(args.resume_from_checkpoint, str):
            candidates.insert(0, Path(args.resume_from_checkpoint) / CHECKPOINT_FILE)
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"resuming at step {state.global_step} without the DSQ schedule: no "
                f"{candidates[-1]}; resume from a checkpoint saved with DSQCallback attached"
            )
        saved = torch.load(found, weights_only=False)
        self.cfg.load_state_dict(saved["schedule"])
        self.cfg.load_noise_state(saved["noise"])
        self.changes = list(saved["changes"])
        self.segments = [list(segment) for segment in saved["segments"]]
        self.gemm_shapes = list(saved["gemm_shapes"])
        log.info("dsq: schedule restored from %s: %s", found, self.cfg.current())
