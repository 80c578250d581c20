"""Translation training: fairseq's Trainer in process, the model patched by the DSQ engine.

The loop is fairseq's own (``fairseq_cli.train``) reduced to what DSQ needs and made resumable
exactly: every update runs ``Trainer.train_step`` (which seeds dropout from seed + update number);
after each validation the DSQ schedule steps; a checkpoint holds model, optimizer, lr schedule,
the batch iterator's position and the schedule state, so that a resumed run repeats the
uninterrupted one update for update. At the end, beam search on the test split is scored with
sacrebleu on detokenized text.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dsq_cli.data.prepare import PreparedData
from dsq_cli.engine import quantize_model, record_gemms

from . import distributed
from .base import BaseTrainer, gemm_as_dict
from .common import (
    Diverged,
    Progress,
    RunRecorder,
    StopRequest,
    finite,
    rng_state,
    set_rng_state,
)
from .fairseq_compat import nan_detector_disabled

log = logging.getLogger(__name__)


def _model_args(model_cfg) -> list[str]:
    """conf/model keys as fairseq flags (``encoder_layers: 3`` -> --encoder-layers 3)."""
    args = ["--arch", str(model_cfg.arch)]
    for key, value in model_cfg.items():
        if key in ("name", "arch"):
            continue
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            args += [flag] if value else []
        else:
            args += [flag, str(value)]
    return args


def fairseq_config(
    cfg,
    data: PreparedData,
    save_dir: Path,
    device: str,
    rank: distributed.Rank = distributed.SINGLE,
):
    """fairseq's FairseqConfig for this run, through fairseq's own parser (so every default is
    fairseq's). A distributed rank gets torch's DDP through fairseq's wrapper, its batches from
    fairseq's sharded iterators and its logging outputs all-reduced by fairseq's Trainer."""
    from fairseq import options
    from omegaconf import open_dict

    from .fairseq_compat import namespace_to_config

    train = cfg.train
    argv = [
        str(data.path),
        "--task", "translation",
        "--source-lang", data.src,
        "--target-lang", data.tgt,
        "--dataset-impl", "mmap",
        *_model_args(cfg.model),
        "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", str(train.label_smoothing),
        "--optimizer", "adam",
        "--adam-betas", f"({train.adam_betas[0]}, {train.adam_betas[1]})",
        "--lr", str(train.lr),
        "--lr-scheduler", "inverse_sqrt",  # its warmup is the run's Budget (set by the trainer)
        "--weight-decay", str(train.weight_decay),
        "--clip-norm", str(train.clip_norm),
        "--max-tokens", str(train.max_tokens),
        "--update-freq", str(train.update_freq),
        "--seed", str(cfg.seed),
        "--save-dir", str(save_dir),
        "--num-workers", "0",
        "--distributed-world-size", str(rank.world_size),
        "--distributed-rank", str(rank.rank),
        "--ddp-backend", distributed.fairseq_ddp_backend(device),
        "--device-id", str(rank.local_rank),
        # fairseq's default multiple of 8 drops the remainder of a length bucket, which is
        # always its longest sentences: every epoch and every validation would lose some
        "--required-batch-size-multiple", "1",
        "--skip-invalid-size-inputs-valid-test",
        "--no-progress-bar",
        "--log-format", "simple",
    ]  # fmt: skip
    if device == "cpu":
        argv.append("--cpu")
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=argv)
    fs_cfg = namespace_to_config(args)
    with open_dict(fs_cfg):
        fs_cfg.generation.beam = int(cfg.eval.beam)
        fs_cfg.generation.lenpen = float(cfg.eval.lenpen)
        fs_cfg.generation.max_len_a = float(cfg.eval.max_len_a)
        fs_cfg.generation.max_len_b = int(cfg.eval.max_len_b)
    return fs_cfg


class TranslationTrainer(BaseTrainer):
    """One translation run: ``train`` to the budget, then ``evaluate`` scores BLEU."""

    def __init__(
        self,
        cfg,
        data: PreparedData,
        recorder: RunRecorder,
        device: str,
        rank: distributed.Rank = distributed.SINGLE,
    ):
        from fairseq import tasks, utils
        from fairseq.trainer import Trainer
        from omegaconf import open_dict

        super().__init__(cfg, recorder, device, rank)
        self.data = data
        self.fs_cfg = fairseq_config(cfg, data, recorder.checkpoint_dir, device, rank)
        utils.set_torch_seed(int(cfg.seed))
        self.task = tasks.setup_task(self.fs_cfg.task)
        self.model = self.task.build_model(self.fs_cfg.model)
        self.criterion = self.task.build_criterion(self.fs_cfg.criterion)
        quantize_model(self.model, self.quant)
        self.patch_report = self.model.dsq_report
        log.info(self.patch_report.summary())
        for split in ("valid", str(cfg.eval.split)):
            self.task.load_dataset(split, combine=False, epoch=1)
        self.trainer = Trainer(self.fs_cfg, self.task, self.model, self.criterion)
        # The first epoch's batches give the updates per epoch, hence the budget; fairseq builds
        # its lr scheduler lazily, after this, with the planned warmup.
        self.epoch_itr = self.trainer.get_train_iterator(epoch=1, load_dataset=True)
        update_freq = int(cfg.train.update_freq)
        budget = self._plan(-(-len(self.epoch_itr) // update_freq))
        with open_dict(self.fs_cfg):
            self.fs_cfg.lr_scheduler.warmup_updates = budget.warmup_updates

    def trained_model(self):
        return self.trainer.get_model()

    @property
    def epoch(self) -> int:
        return self.epoch_itr.epoch

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.trainer.get_model().state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "lr_scheduler": self.trainer.lr_scheduler.state_dict(),
            "num_updates": self.trainer.get_num_updates(),
            "epoch_iterator": self.epoch_itr.state_dict(),
            "dsq_schedule": self.quant.state_dict(),
            "progress": self.progress,
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.trainer.get_model().load_state_dict(state["model"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.trainer.set_num_updates(int(state["num_updates"]))
        self.quant.load_state_dict(state["dsq_schedule"])
        self.progress = dict(state["progress"])
        itr_state = state["epoch_iterator"]
        self.epoch_itr = self.trainer.get_train_iterator(
            epoch=itr_state["epoch"], load_dataset=True
        )
        self.epoch_itr.load_state_dict(itr_state)
        set_rng_state(state["rng"])

    # -- loop ---------------------------------------------------------------------------------
    @property
    def updates(self) -> int:
        return self.trainer.get_num_updates()

    def train(self, stop: StopRequest, resume_state: dict | None) -> None:
        if resume_state is not None:
            self.load_state_dict(resume_state)
        else:  # the first epoch's iterator is the one the budget was planned on
            self.trainer.lr_step(self.epoch_itr.epoch)
        with nan_detector_disabled():
            self._train_loop(stop)
        self._finish(self.validate)

    def _train_loop(self, stop: StopRequest) -> None:
        from fairseq.data import iterators

        train_cfg = self.cfg.train
        progress_bar = Progress(self.budget.total_updates, self.updates,
                                quiet=not self.rank.is_main)  # fmt: skip
        self._start_clock()
        try:
            while self._budget_left():
                epoch_itr = iterators.GroupedIterator(
                    self.epoch_itr.next_epoch_itr(shuffle=True), int(train_cfg.update_freq)
                )
                self.trainer.begin_epoch(self.epoch_itr.epoch)
                for samples in epoch_itr:
                    logging_output = self._train_step(samples)
                    loss = float(logging_output.get("loss", float("nan")))
                    self._after_update(
                        loss,
                        not epoch_itr.has_next(),  # the end of an epoch
                        progress_bar,
                        stop,
                        lambda window, output=logging_output: self._log_train(window, output),
                    )
                    if not self._budget_left():
                        break
                self.trainer.lr_step(self.epoch_itr.epoch, self.progress["last_valid_loss"])
                if not self.epoch_itr.end_of_epoch():
                    break  # stopped by the update budget mid-epoch
                self.epoch_itr = self.trainer.get_train_iterator(
                    self.epoch_itr.next_epoch_idx, load_dataset=False
                )
        finally:
            progress_bar.close()
            self._stop_clock()

    def _lr(self) -> float:
        return float(self.trainer.get_lr())

    def _train_step(self, samples) -> dict:
        # The first step of a process is recorded: its GEMM shapes price the run (SPEC 4).
        record = self.progress["gemm_shapes"] is None
        try:
            if record:
                with record_gemms() as recorder:
                    logging_output = self.trainer.train_step(samples)
                self.progress["gemm_shapes"] = [gemm_as_dict(g) for g in recorder.gemms]
            else:
                logging_output = self.trainer.train_step(samples)
        except FloatingPointError as err:  # fairseq: NaN/Inf gradients
            self._drop_fairseq_crash_file()
            raise Diverged(f"non-finite gradients at update {self.updates + 1}: {err}") from None
        if logging_output is None or not finite(logging_output.get("loss")):
            loss = None if logging_output is None else logging_output.get("loss")
            raise Diverged(f"loss is {loss} at update {self.updates}")
        return logging_output

    def _drop_fairseq_crash_file(self) -> None:
        # fairseq saves crash.pt (its own pickled format) on NaN; the last good dsq checkpoint
        # is the one to keep, so the run directory holds one kind of checkpoint only.
        (self.recorder.checkpoint_dir / "crash.pt").unlink(missing_ok=True)

    def _log_train(self, window: list[float], logging_output: dict) -> None:
        record = {
            "kind": "train",
            "update": self.updates,
            "epoch": self.epoch_itr.epoch,
            "loss": sum(window) / len(window),
            "nll_loss": _float(logging_output.get("nll_loss")),
            "lr": self._lr(),
            "bits": self.quant.current(),
            "wall_seconds": round(self.progress["wall_seconds"], 3),
        }
        self.recorder.metrics(record)

    def validate(self, step_schedule: bool) -> float:
        from fairseq.logging import metrics

        itr = self.trainer.get_valid_iterator("valid").next_epoch_itr(shuffle=False)
        with metrics.aggregate(new_root=True) as agg:
            for sample in itr:
                self.trainer.valid_step(sample)
        stats = agg.get_smoothed_values()
        # fairseq all-reduces the loss over the ranks' shards of the validation set; rank 0's
        # value is broadcast anyway, so that the schedule sees the very same float everywhere.
        valid_loss = distributed.broadcast_from_main(float(stats["loss"]))
        self._after_validation(
            valid_loss, {"valid_nll_loss": _float(stats.get("nll_loss"))}, step_schedule
        )
        return valid_loss

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, stop: StopRequest) -> dict:
        """result.json's evaluation fields: BLEU is the run's ``value``."""
        scores = self.bleu(stop)
        return {"value": scores["bleu"], **scores}

    def bleu(self, stop: StopRequest) -> dict:
        """Beam search on the eval split, detokenized, scored by sacrebleu against the raw
        references."""
        import sacrebleu
        import sentencepiece as spm
        from fairseq import utils

        split = str(self.cfg.eval.split)
        processor = spm.SentencePieceProcessor(model_file=str(self.data.spm_model))
        model = self.trainer.get_model()
        model.eval()
        generator = self.task.build_generator([model], self.fs_cfg.generation)
        itr = self.task.get_batch_iterator(
            dataset=self.task.dataset(split),
            max_tokens=int(self.cfg.train.max_tokens),
            max_sentences=int(self.cfg.eval.max_sentences),
            max_positions=utils.resolve_max_positions(
                self.task.max_positions(), model.max_positions()
            ),
            ignore_invalid_inputs=True,
            seed=int(self.cfg.seed),
            num_workers=0,
        ).next_epoch_itr(shuffle=False)
        references = _read(self.data.raw(split, "tgt"))
        sources = _read(self.data.raw(split, "src"))
        hypotheses = [""] * len(references)  # a sentence skipped as too long scores as empty
        tgt_dict = self.task.target_dictionary
        with torch.no_grad():
            for sample in itr:
                stop.check()
                if self.device == "cuda":
                    sample = utils.move_to_cuda(sample)
                outputs = self.task.inference_step(generator, [model], sample)
                for sample_id, hyps in zip(sample["id"].tolist(), outputs):
                    pieces = tgt_dict.string(hyps[0]["tokens"].int().cpu())
                    hypotheses[sample_id] = processor.decode(pieces.split())
        metric = sacrebleu.metrics.BLEU()
        score = metric.corpus_score(hypotheses, [references])
        copy_score = sacrebleu.metrics.BLEU().corpus_score(sources, [references])
        (self.recorder.dir / f"{split}.hyp").write_text("".join(h + "\n" for h in hypotheses))
        return {
            "bleu": round(score.score, 4),
            "bleu_signature": str(metric.get_signature()),
            "copy_source_bleu": round(copy_score.score, 4),
            "eval_split": split,
            "eval_sentences": len(references),
        }


def _read(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]  # written by raw.write_lines


def _float(value):
    return None if value is None else float(value)
