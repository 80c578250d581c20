"""GLUE fine-tuning with DSQ: a pretrained encoder (MiniLM, RoBERTa-base) or roberta_tiny from
scratch, its sentence-classification head, every Linear and both attention products patched by
the engine, trained with the standard recipe.

The recipe (RoBERTa's GLUE fine-tuning, Liu et al. 2019, Table 10; docs/glue.md):
* AdamW (decoupled weight decay ``train.weight_decay``, none on biases and LayerNorm weights,
  betas ``train.adam_betas``, eps 1e-6), peak ``train.lr`` reached linearly over
  ``train.warmup_updates``, then linear decay to 0 at the end of the budget;
* ``train.batch_size`` examples per update, each batch padded to its longest example (at most
  ``model.max_length`` tokens); cross-entropy, or mean squared error for STS-B;
* dropout seeded from ``seed`` + update number (as fairseq does), and batch order from ``seed`` +
  epoch, so that a resumed run repeats the uninterrupted one update for update.

Every ``train.validate_every`` updates (0: each epoch) the dev set is scored: its loss steps the
DSQ schedule (docs/spec.md §3) and its GLUE metrics go to metrics.jsonl. result.json's ``value``
is the best dev value over the validations (the usual GLUE dev reporting) or, with
``eval.checkpoint=last``, the final one; both are kept, under ``checkpoints``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from dsq.engine import QuantConfig
from dsq_cli.data.glue import GlueData
from dsq_cli.models.encoders import build_encoder, quantize_exclude
from dsq_cli.run_config import ModelConfig, RunConfig, TrainConfig

from . import ranks
from .glue_metrics import compute_metrics
from .loop import PlainTrainer
from .recorder import RunRecorder
from .stop import StopRequest

log = logging.getLogger(__name__)

# Parameters that get no weight decay, as in RoBERTa/BERT fine-tuning.
_NO_DECAY = ("bias", "layer_norm", "layernorm", "LayerNorm")


class GlueTrainer(PlainTrainer):
    """One GLUE run: `train` to the budget, `evaluate` reports the best (or the last) dev
    metric."""

    @classmethod
    def from_run_config(cls, cfg: RunConfig, quant, data, recorder, device, rank):
        return cls(cfg.train, cfg.model, cfg.seed, quant, data, recorder, device, rank,
                   cfg.eval.checkpoint)  # fmt: skip

    def __init__(
        self,
        train: TrainConfig,
        model: ModelConfig,
        seed: int,
        quant: QuantConfig,
        data: GlueData,
        recorder: RunRecorder,
        device: str,
        rank: ranks.Rank = ranks.SINGLE,
        checkpoint: str = "best",
    ):
        super().__init__(train, quant, recorder, device, rank)
        self.seed = seed
        self.headline = checkpoint  # eval.checkpoint: which validation's scores are `value`
        self.data, self.task = data, data.task
        self.regression = self.task.labels is None
        torch.manual_seed(self.seed)  # roberta_tiny's initialisation and the new head
        encoder = build_encoder(model, num_classes=self.task.num_classes)
        log.info("model %s: %s", model["name"], encoder.description)
        self.model = encoder.model.to(device)
        self.head_name = encoder.head_name
        # The classification head is quantized like the encoder unless model.quantize_head=false.
        self.patch(self.model, exclude=quantize_exclude(model))

        max_length = model["max_length"]
        tokenizer = encoder.tokenizer
        self.pad_index = tokenizer.pad_index
        self.train_set = [(tokenizer.encode(e.text_a, e.text_b, max_length), e.label)
                          for e in data.train]  # fmt: skip
        self.dev_set = [(tokenizer.encode(e.text_a, e.text_b, max_length), e.label)
                        for e in data.dev]  # fmt: skip
        self.batch_size = self.train_cfg.batch_size
        self.batches_per_epoch = math.ceil(len(self.train_set) / self.batch_size)

        self.plan(self.batches_per_epoch)
        self.optimizer = torch.optim.AdamW(
            self._parameter_groups(self.train_cfg.weight_decay),
            lr=self.train_cfg.lr,
            betas=tuple(self.train_cfg.adam_betas),
            eps=1e-6,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._updates = 0
        self._epoch = 1
        self.position = 0  # batches of this epoch already trained
        self.progress.update(best_dev=None, last_dev=None)

    def _parameter_groups(self, weight_decay: float) -> list[dict]:
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                (no_decay if any(k in name for k in _NO_DECAY) else decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def _lr_factor(self, update: int) -> float:
        """Linear warmup to 1 over train.warmup_updates, then linear decay to 0 at the end."""
        warmup = self.budget.warmup_updates
        if update < warmup:
            return (update + 1) / warmup
        total = self.budget.total_updates
        return max(0.0, (total - update) / max(1, total - warmup))

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- state --------------------------------------------------------------------------------
    def own_state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "epoch": self._epoch,
            "position": self.position,
        }

    def load_own_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self._updates = state["num_updates"]
        self._epoch, self.position = state["epoch"], state["position"]

    # -- the update ---------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train_set), generator=generator).tolist()

    def batches(self):
        """``train.batch_size`` examples per update, in an order drawn from seed and epoch."""
        order = self._epoch_order(self._epoch)
        while self.budget_left():
            if self.position >= self.batches_per_epoch:
                self._epoch, self.position = self._epoch + 1, 0
                order = self._epoch_order(self._epoch)
            start = self.position * self.batch_size
            self.position += 1
            yield order[start : start + self.batch_size], self.position >= self.batches_per_epoch

    def _collate(self, examples: list, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded token ids (B x longest) and the labels of ``indices``."""
        rows = [examples[i][0] for i in indices]
        tokens = torch.full((len(rows), max(map(len, rows))), self.pad_index, dtype=torch.long)
        for row, ids in enumerate(rows):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        label_dtype = torch.float32 if self.regression else torch.long
        labels = torch.tensor([examples[i][1] for i in indices], dtype=label_dtype)
        return tokens.to(self.device), labels.to(self.device)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
        if self.regression:
            return F.mse_loss(logits.squeeze(-1).float(), labels, reduction=reduction)
        return F.cross_entropy(logits.float(), labels, reduction=reduction)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, _ = self.model(tokens, features_only=True, classification_head_name=self.head_name)
        return logits

    def train_step(self, batch: list[int]) -> tuple[float, dict]:
        self.model.train()
        torch.manual_seed(self.seed + self.updates)  # dropout, as fairseq seeds it
        tokens, labels = self._collate(self.train_set, batch)
        loss = self._loss(self._forward(tokens), labels)
        return self.step_on(loss), {}

    # -- validation and evaluation --------------------------------------------------------------
    def dev_scores(self) -> tuple[float, dict]:
        """The dev loss (per example) and GLUE metrics of the model as it is now."""
        self.model.eval()
        total, predictions, labels = 0.0, [], []
        size = 2 * self.batch_size
        with torch.no_grad():
            for start in range(0, len(self.dev_set), size):
                indices = list(range(start, min(start + size, len(self.dev_set))))
                tokens, batch_labels = self._collate(self.dev_set, indices)
                logits = self._forward(tokens)
                total += float(self._loss(logits, batch_labels, reduction="sum"))
                if self.regression:
                    predictions += logits.squeeze(-1).float().cpu().tolist()
                else:
                    predictions += logits.argmax(-1).cpu().tolist()
                labels += batch_labels.cpu().tolist()
        self.model.train()
        return total / max(1, len(self.dev_set)), compute_metrics(self.task, predictions, labels)

    def validation_loss(self) -> tuple[float, dict]:
        valid_loss, scores = self.dev_scores()
        self.progress["last_dev"] = {"update": self.updates, "valid_loss": valid_loss, **scores}
        best = self.progress["best_dev"]
        if best is None or scores["value"] > best["value"]:  # every GLUE metric: higher is better
            self.progress["best_dev"] = self.progress["last_dev"]
        return valid_loss, {f"dev_{name}": value for name, value in scores.items()}

    def evaluate(self, stop: StopRequest) -> dict:
        """result.json's evaluation fields: the dev scores of the validation ``eval.checkpoint``
        names (``value`` is the task's GLUE metric there; best: the best dev metric's, last: the
        final model's), the best one's update, the final model's dev scores, and both under
        ``checkpoints`` with their updates and dev losses. Nothing is scored again: the
        validations already scored both models."""
        best, last = self.progress["best_dev"], self.progress["last_dev"]
        chosen = best if self.headline == "best" else last
        return {
            **_scores(chosen),
            "best_update": best["update"],
            "final_dev": _scores(last),
            "eval_split": "dev",
            "eval_examples": len(self.dev_set),
            "eval_checkpoint": self.headline,
            "checkpoints": {"last": _checkpoint(last), "best": _checkpoint(best)},
        }


def _scores(dev: dict) -> dict:
    """A validation's GLUE scores, without its update and dev loss."""
    return {name: v for name, v in dev.items() if name not in ("update", "valid_loss")}


def _checkpoint(dev: dict) -> dict:
    """result.json's entry of one validation under ``checkpoints``: update, dev loss (None for a
    validation booked by a checkpoint that predates it) and the task's metrics."""
    metrics = {name: v for name, v in _scores(dev).items() if name != "value"}
    return {"update": dev["update"], "valid_loss": dev.get("valid_loss"), **metrics}
