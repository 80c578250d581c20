"""Translation training: fairseq's Trainer in process, the model patched by the DSQ engine.

The loop is fairseq's own (``fairseq_cli.train``) reduced to what DSQ needs and made resumable
exactly: every update runs ``Trainer.train_step`` (which seeds dropout from seed + update number);
after each validation the DSQ schedule steps; a checkpoint holds model, optimizer, lr schedule,
the batch iterator's position and the schedule state, so that a resumed run repeats the
uninterrupted one update for update. At the end, beam search on the test split is scored with
sacrebleu on detokenized text, for the final model and for the checkpoint of the best validation
loss (checkpoint_best.pt); ``eval.checkpoint`` says which of the two is the run's ``value``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from dsq.engine import QuantConfig
from dsq_cli.data.prepare import PreparedData
from dsq_cli.run_config import EvalConfig, ModelConfig, RunConfig, TrainConfig

from . import ranks
from .fairseq_compat import namespace_to_config, nan_detector_disabled
from .loop import Trainer
from .recorder import RunRecorder, load_checkpoint
from .stop import Diverged, StopRequest, check_finite

log = logging.getLogger(__name__)


def _model_args(model_cfg: ModelConfig) -> list[str]:
    """conf/model keys as fairseq flags (``encoder_layers: 3`` -> --encoder-layers 3)."""
    args = ["--arch", str(model_cfg["arch"])]
    for key, value in model_cfg.items():
        if key in ("name", "arch", "family"):  # which builder and tasks, not fairseq flags
            continue
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            args += [flag] if value else []
        else:
            args += [flag, str(value)]
    return args


def fairseq_config(
    train: TrainConfig,
    eval_cfg: EvalConfig,
    model: ModelConfig,
    seed: int,
    data: PreparedData,
    save_dir: Path,
    device: str,
    rank: ranks.Rank = ranks.SINGLE,
):
    """fairseq's FairseqConfig for this run, through fairseq's own parser (so every default is
    fairseq's). A distributed rank gets torch's DDP through fairseq's wrapper, its batches from
    fairseq's sharded iterators and its logging outputs all-reduced by fairseq's Trainer."""
    from fairseq import options
    from omegaconf import open_dict

    criterion = "label_smoothed_cross_entropy"
    if train.loss_chunk_tokens:
        from .criterion import NAME as criterion  # registers it with fairseq

    argv = [
        str(data.path),
        "--task", "translation",
        "--source-lang", data.src,
        "--target-lang", data.tgt,
        "--dataset-impl", "mmap",
        *_model_args(model),
        "--criterion", criterion,
        "--label-smoothing", str(train.label_smoothing),
        "--optimizer", "adam",
        "--adam-betas", f"({train.adam_betas[0]}, {train.adam_betas[1]})",
        "--lr", str(train.lr),
        "--lr-scheduler", "inverse_sqrt",  # its warmup is the run's Budget (set by the trainer)
        "--weight-decay", str(train.weight_decay),
        "--clip-norm", str(train.clip_norm),
        "--max-tokens", str(train.max_tokens),
        "--update-freq", str(train.update_freq),
        "--seed", str(seed),
        "--save-dir", str(save_dir),
        "--num-workers", "0",
        "--distributed-world-size", str(rank.world_size),
        "--distributed-rank", str(rank.rank),
        "--ddp-backend", ranks.fairseq_ddp_backend(device),
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
        fs_cfg.generation.beam = eval_cfg.beam
        fs_cfg.generation.lenpen = eval_cfg.lenpen
        fs_cfg.generation.max_len_a = eval_cfg.max_len_a
        fs_cfg.generation.max_len_b = eval_cfg.max_len_b
    return fs_cfg


class TranslationTrainer(Trainer):
    """One translation run: `train` to the budget (fairseq's Trainer makes each update), then
    `evaluate` scores BLEU on the eval split."""

    saves_best_checkpoint = True

    @classmethod
    def from_run_config(cls, cfg: RunConfig, quant, data, recorder, device, rank):
        return cls(cfg.train, cfg.eval, cfg.model, cfg.seed, quant, data, recorder, device, rank)

    def __init__(
        self,
        train: TrainConfig,
        eval_cfg: EvalConfig,
        model: ModelConfig,
        seed: int,
        quant: QuantConfig,
        data: PreparedData,
        recorder: RunRecorder,
        device: str,
        rank: ranks.Rank = ranks.SINGLE,
    ):
        from fairseq import tasks, utils
        from fairseq.trainer import Trainer as FairseqTrainer
        from omegaconf import open_dict

        super().__init__(train, quant, recorder, device, rank)
        self.eval_cfg, self.seed, self.data = eval_cfg, seed, data
        # fairseq's own config (model flags, optimizer, batching, generation) through its parser
        self.fs_cfg = fairseq_config(train, eval_cfg, model, seed, data, recorder.checkpoint_dir,
                                     device, rank)  # fmt: skip
        utils.set_torch_seed(self.seed)
        self.task = tasks.setup_task(self.fs_cfg.task)
        self.model = self.task.build_model(self.fs_cfg.model)
        self.criterion = self.task.build_criterion(self.fs_cfg.criterion)
        self.criterion.chunk_tokens = train.loss_chunk_tokens
        self.patch(self.model)
        for split in ("valid", self.eval_cfg.split):
            self.task.load_dataset(split, combine=False, epoch=1)
        self.fairseq_trainer = FairseqTrainer(self.fs_cfg, self.task, self.model, self.criterion)
        # The first epoch's batches give the updates per epoch, hence the budget; fairseq builds
        # its lr scheduler lazily, after this, with the planned warmup.
        self.epoch_itr = self.fairseq_trainer.get_train_iterator(epoch=1, load_dataset=True)
        self._lr_step_due = True  # a fresh start: lr_step(1) before the first update
        self._loaded_iterator_state: dict | None = None  # what a resume restored
        self._epoch_begun = False
        update_freq = self.train_cfg.update_freq
        budget = self.plan(-(-len(self.epoch_itr) // update_freq))
        with open_dict(self.fs_cfg):
            self.fs_cfg.lr_scheduler.warmup_updates = budget.warmup_updates

    def trained_model(self):
        return self.fairseq_trainer.get_model()

    @property
    def updates(self) -> int:
        return self.fairseq_trainer.get_num_updates()

    @property
    def epoch(self) -> int:
        return self.epoch_itr.epoch

    def lr(self) -> float:
        return self.fairseq_trainer.get_lr()

    # -- state --------------------------------------------------------------------------------
    def own_state(self) -> dict:
        return {
            "optimizer": self.fairseq_trainer.optimizer.state_dict(),
            "lr_scheduler": self.fairseq_trainer.lr_scheduler.state_dict(),
            "epoch_iterator": self._epoch_iterator_state(),
        }

    def _epoch_iterator_state(self) -> dict:
        # fairseq's iterator describes itself only once an epoch has begun in this process; a
        # run resumed at its budget (stopped during its last validation or evaluation) begins
        # none, and keeps the state it was loaded with
        if self._loaded_iterator_state is not None and not self._epoch_begun:
            return self._loaded_iterator_state
        return self.epoch_itr.state_dict()

    def load_own_state(self, state: dict) -> None:
        self.fairseq_trainer.optimizer.load_state_dict(state["optimizer"])
        self.fairseq_trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.fairseq_trainer.set_num_updates(state["num_updates"])
        itr_state = state["epoch_iterator"]
        # The iterator an uninterrupted run uses in every epoch: fairseq's, cached for the
        # dataset loaded at the start. Reloading the dataset built a new one, whose batches hold
        # other sentences of the same lengths, so a run resumed after its first epoch trained on
        # other batches than it would have.
        self.epoch_itr = self.fairseq_trainer.get_train_iterator(
            epoch=itr_state["epoch"], load_dataset=False
        )
        self.epoch_itr.load_state_dict(itr_state)
        self._loaded_iterator_state = itr_state
        self._lr_step_due = False

    # -- the update ---------------------------------------------------------------------------
    def training_context(self):
        return nan_detector_disabled()

    def batches(self):
        """fairseq's epoch iterators, ``train.update_freq`` batches per update; the lr schedule
        steps at each epoch's end (fairseq's own order)."""
        from fairseq.data import iterators

        if self._lr_step_due:  # the first epoch's iterator is the one the budget was planned on
            self.fairseq_trainer.lr_step(self.epoch_itr.epoch)
        while self.budget_left():
            epoch_batches = iterators.GroupedIterator(
                self.epoch_itr.next_epoch_itr(shuffle=True), self.train_cfg.update_freq
            )
            self._epoch_begun = True
            self.fairseq_trainer.begin_epoch(self.epoch_itr.epoch)
            for samples in epoch_batches:
                yield samples, not epoch_batches.has_next()
                if not self.budget_left():
                    break
            self.fairseq_trainer.lr_step(self.epoch_itr.epoch, self.progress["last_valid_loss"])
            if not self.epoch_itr.end_of_epoch():
                break  # stopped by the update budget mid-epoch
            self.epoch_itr = self.fairseq_trainer.get_train_iterator(
                self.epoch_itr.next_epoch_idx, load_dataset=False
            )

    def train_step(self, samples) -> tuple[float, dict]:
        try:
            logging_output = self.fairseq_trainer.train_step(samples)
        except FloatingPointError as err:  # fairseq: NaN/Inf gradients
            self._drop_fairseq_crash_file()
            raise Diverged(f"non-finite gradients at update {self.updates + 1}: {err}") from None
        loss = None if logging_output is None else logging_output.get("loss")
        check_finite("training loss", loss, self.updates)  # fairseq has counted the update
        return float(loss), {"nll_loss": _float(logging_output.get("nll_loss"))}

    def _drop_fairseq_crash_file(self) -> None:
        # fairseq saves crash.pt (its own pickled format) on NaN; the last good dsq checkpoint
        # is the one to keep, so the run directory holds one kind of checkpoint only.
        (self.recorder.checkpoint_dir / "crash.pt").unlink(missing_ok=True)

    def validation_loss(self) -> tuple[float, dict]:
        from fairseq.logging import metrics

        itr = self.fairseq_trainer.get_valid_iterator("valid").next_epoch_itr(shuffle=False)
        with metrics.aggregate(new_root=True) as agg:
            for sample in itr:
                self.fairseq_trainer.valid_step(sample)
        stats = agg.get_smoothed_values()
        # fairseq all-reduces the loss over the ranks' shards of the validation set; rank 0's
        # value is broadcast anyway, so that the schedule sees the very same float everywhere.
        valid_loss = ranks.broadcast_from_main(float(stats["loss"]))
        return valid_loss, {"valid_nll_loss": _float(stats.get("nll_loss"))}

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, stop: StopRequest) -> dict:
        """result.json's evaluation fields: BLEU of the final model and of checkpoint_best.pt,
        each with its update and validation loss under ``checkpoints``; ``value``, ``bleu`` and
        ``{split}.hyp`` are those of the model ``eval.checkpoint`` names, the other's hypotheses
        go to ``{split}.last.hyp`` or ``{split}.best.hyp``. When the best validation was the
        last one the two are one model, scored once."""
        progress = self.progress
        last = {"update": self.updates, "valid_loss": progress["last_valid_loss"]}
        scored = {"last": self.bleu(stop)}  # first: the final model is the one in memory
        best = None
        if progress["best_valid_update"] is not None:
            best = {"update": progress["best_valid_update"],
                    "valid_loss": progress["best_valid_loss"]}  # fmt: skip
            if best["update"] == last["update"]:
                scored["best"] = scored["last"]
            else:
                with self._best_checkpoint_loaded():
                    scored["best"] = self.bleu(stop)
        headline = self.eval_cfg.checkpoint
        if headline not in scored:  # resumed from a checkpoint that predates checkpoint_best.pt
            log.warning("no checkpoint_best.pt of this run: value scores the last model")
            headline = "last"
        last["bleu"] = scored["last"][0]["bleu"]
        if best is not None:
            best["bleu"] = scored["best"][0]["bleu"]
        split = self.eval_cfg.split
        scores, hypotheses = scored[headline]
        _write_lines(self.recorder.dir / f"{split}.hyp", hypotheses)
        other = "last" if headline == "best" else "best"
        if other in scored and scored[other] is not scored[headline]:
            _write_lines(self.recorder.dir / f"{split}.{other}.hyp", scored[other][1])
        return {
            "value": scores["bleu"],
            **scores,
            "eval_checkpoint": headline,
            "checkpoints": {"last": last, "best": best},
        }

    @contextlib.contextmanager
    def _best_checkpoint_loaded(self):
        """checkpoint_best.pt's model and DSQ schedule (the formats in force after its
        validation, as the final model is scored with the formats in force at the end) in place
        of the final ones, which come back afterwards."""
        model = self.trained_model()
        final_model = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        final_schedule = self.quant.state_dict()
        best = load_checkpoint(self.recorder.best_checkpoint)
        model.load_state_dict(best["model"])
        self.quant.load_state_dict(best["dsq_schedule"])
        log.info("scoring checkpoint_best.pt (update %d)", best["num_updates"])
        try:
            yield
        finally:
            model.load_state_dict(final_model)
            self.quant.load_state_dict(final_schedule)

    def bleu(self, stop: StopRequest) -> tuple[dict, list[str]]:
        """Beam search on the eval split with the model in memory, detokenized, scored by
        sacrebleu against the raw references; the scores and the hypotheses."""
        import sacrebleu
        import sentencepiece as spm
        from fairseq import utils

        split = self.eval_cfg.split
        processor = spm.SentencePieceProcessor(model_file=str(self.data.spm_model))
        model = self.fairseq_trainer.get_model()
        model.eval()
        generator = self.task.build_generator([model], self.fs_cfg.generation)
        itr = self.task.get_batch_iterator(
            dataset=self.task.dataset(split),
            max_tokens=self.train_cfg.max_tokens,
            max_sentences=self.eval_cfg.max_sentences,
            max_positions=utils.resolve_max_positions(
                self.task.max_positions(), model.max_positions()
            ),
            ignore_invalid_inputs=True,
            seed=self.seed,
            num_workers=0,
        ).next_epoch_itr(shuffle=False)
        references = _read(self.data.raw(split, "tgt"))
        sources = _read(self.data.raw(split, "src"))
        hypotheses = [""] * len(references)  # a sentence skipped as too long scores as empty
        tgt_dict = self.task.target_dictionary
        batches = len(itr)
        with torch.no_grad():
            for number, sample in enumerate(itr, start=1):
                stop.check()
                self.progress_line.tick(f"beam search on {split}, batches", number, batches)
                if self.device == "cuda":
                    sample = utils.move_to_cuda(sample)
                outputs = self.task.inference_step(generator, [model], sample)
                for sample_id, hyps in zip(sample["id"].tolist(), outputs):
                    pieces = tgt_dict.string(hyps[0]["tokens"].int().cpu())
                    hypotheses[sample_id] = processor.decode(pieces.split())
        metric = sacrebleu.metrics.BLEU()
        score = metric.corpus_score(hypotheses, [references])
        copy_score = sacrebleu.metrics.BLEU().corpus_score(sources, [references])
        scores = {
            "bleu": round(score.score, 4),
            "bleu_signature": str(metric.get_signature()),
            "copy_source_bleu": round(copy_score.score, 4),
            "eval_split": split,
            "eval_sentences": len(references),
        }
        return scores, hypotheses


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _read(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]  # written by raw.write_lines


def _float(value):
    return None if value is None else float(value)
