"""Language modelling with DSQ (``task=lm``; docs/lm.md): a ``transformers`` causal LM built from
a config (Llama-style or GPT-2, random init) trained on a character-level corpus, every Linear and
both attention products patched by the engine.

The recipe (nanoGPT's for Tiny Shakespeare, in this suite's loop):
* each update takes ``train.batch_size`` windows of ``model.seq_len + 1`` characters at offsets
  drawn from ``seed`` and the update number, so a resumed run repeats the uninterrupted one
  update for update; an epoch is as many updates as cover the training characters once;
* the loss is the mean next-character cross-entropy over every position of every window, the
  output layer and its loss taken ``train.loss_chunk_tokens`` tokens at a time
  (`dsq.engine.chunked_output`; 0: every token of the batch at once);
* AdamW (decoupled weight decay ``train.weight_decay``, none on norms, biases and embeddings),
  peak ``train.lr`` reached linearly over ``train.warmup_updates``, then cosine decay to a tenth
  of it at the end of the budget; gradient norm clipped at ``train.clip_norm``; dropout seeded
  from ``seed`` + update number.

Every ``train.validate_every`` updates the validation loss is taken over every non-overlapping
window of the validation characters: it steps the DSQ schedule, and with its perplexity goes to
metrics.jsonl. result.json's ``value`` is the perplexity of the best validation (``eval.checkpoint
=best``) or of the last; both are kept, under ``checkpoints``, with their losses.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from dsq.engine import QuantConfig
from dsq.engine.chunked_output import chunked_output_loss
from dsq_cli.data.lm import LMData
from dsq_cli.models.causal_lm import body_and_head, build_causal_lm, decoder_layers
from dsq_cli.run_config import RunConfig

from . import ranks
from .loop import PlainTrainer
from .recorder import RunRecorder
from .stop import StopRequest

log = logging.getLogger(__name__)

# the cosine decay ends at this fraction of the peak learning rate (nanoGPT's min_lr = lr / 10)
FINAL_LR_FRACTION = 0.1


class NextTokenLoss(nn.Module):
    """A causal LM whose forward returns the mean next-token loss of ``windows [B, T + 1]``:
    the body's hidden states of ``windows[:, :-1]``, then the output layer and the cross-entropy
    against ``windows[:, 1:]`` in chunks of ``chunk_tokens`` tokens. The model is this module's
    child, so the engine's hooks on the called module (``stash_scope=all``) hold here."""

    def __init__(self, lm: nn.Module, chunk_tokens: int):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        body, head = body_and_head(self.lm)
        inputs, targets = windows[:, :-1], windows[:, 1:]
        # no key/value cache: training needs none, and a checkpointed layer run again would find
        # its first run's keys in it
        hidden = body(input_ids=inputs, use_cache=False).last_hidden_state
        features = hidden.reshape(-1, hidden.shape[-1])
        total, = chunked_output_loss(features, head, _summed_cross_entropy, targets.reshape(-1),
                                     list(head.parameters()), self.chunk_tokens)  # fmt: skip
        return total / targets.numel()


def _summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target, reduction="sum")


class LMTrainer(PlainTrainer):
    """One language-modelling run: `train` to the budget, `evaluate` reports the perplexity of
    the best (or the last) validation."""

    @classmethod
    def from_run_config(cls, cfg: RunConfig, quant, data, recorder, device, rank):
        return cls(cfg, quant, data, recorder, device, rank)

    def __init__(self, cfg: RunConfig, quant: QuantConfig, data: LMData, recorder: RunRecorder,
                 device: str, rank: ranks.Rank = ranks.SINGLE):  # fmt: skip
        super().__init__(cfg.train, quant, recorder, device, rank)
        train, model = cfg.train, cfg.model
        self.seed, self.headline = cfg.seed, cfg.eval.checkpoint
        self.seq_len = int(model["seq_len"])
        torch.manual_seed(self.seed)  # the initialisation
        lm = build_causal_lm(
            model["kind"], vocab=len(data.vocabulary), layers=model["layers"],
            width=model["width"], heads=model["heads"], kv_heads=model.get("kv_heads"),
            seq_len=self.seq_len, dropout=model.get("dropout", 0.0),
            intermediate=model.get("intermediate"),
        )  # fmt: skip
        self.model = NextTokenLoss(lm, train.loss_chunk_tokens).to(device)
        parameters = sum(p.numel() for p in self.model.parameters())
        log.info("model %s (%s): %.2fM parameters, vocabulary %d characters", model["name"],
                 model["kind"], parameters / 1e6, len(data.vocabulary))  # fmt: skip
        self.patch(self.model)
        self.train_ids, self.valid_ids = data.train.to(device), data.valid.to(device)
        self.batch_size = self.train_cfg.batch_size
        per_update = self.batch_size * self.seq_len
        self.updates_per_epoch = max(1, math.ceil(len(data.train) / per_update))
        self.plan(self.updates_per_epoch)
        self.optimizer = torch.optim.AdamW(
            self._parameter_groups(self.train_cfg.weight_decay),
            lr=self.train_cfg.lr,
            betas=tuple(self.train_cfg.adam_betas),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._updates = 0
        self.progress.update(best_valid=None, last_valid=None)

    def checkpointed_layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder's transformer blocks (``train.activation_checkpointing``)."""
        return decoder_layers(model.lm)

    def _parameter_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on the matrices of the blocks and the output layer only."""
        embeddings = {id(p) for m in self.model.modules() if isinstance(m, nn.Embedding)
                      for p in m.parameters(False)}  # fmt: skip
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                plain = param.dim() < 2 or id(param) in embeddings
                (no_decay if plain else decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def _lr_factor(self, update: int) -> float:
        """Linear warmup to 1 over train.warmup_updates, then cosine decay to
        `FINAL_LR_FRACTION` at the end of the budget."""
        warmup, total = self.budget.warmup_updates, self.budget.total_updates
        if update < warmup:
            return (update + 1) / warmup
        done = min(1.0, (update - warmup) / max(1, total - warmup))
        return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * done))

    @property
    def epoch(self) -> int:
        return self._updates // self.updates_per_epoch + 1

    # -- state --------------------------------------------------------------------------------
    def own_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict()}  # fmt: skip

    def load_own_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self._updates = state["num_updates"]

    # -- the update ---------------------------------------------------------------------------
    def batches(self):
        """The window offsets of each update, drawn from seed and update number."""
        last_start = len(self.train_ids) - self.seq_len - 1
        while self.budget_left():
            update = self._updates + 1
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + update)
            starts = torch.randint(0, last_start + 1, (self.batch_size,), generator=generator)
            yield starts, update % self.updates_per_epoch == 0

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.seq_len + 1, device=ids.device)
        return ids[starts.to(ids.device)[:, None] + offsets]

    def train_step(self, starts: torch.Tensor) -> tuple[float, dict]:
        self.model.train()
        torch.manual_seed(self.seed + self.updates)  # dropout, as the other trainers seed it
        loss = self.model(self._windows(self.train_ids, starts))
        return self.step_on(loss), {}

    # -- validation and evaluation --------------------------------------------------------------
    def valid_loss(self) -> float:
        """The mean next-character loss over every non-overlapping validation window."""
        self.model.eval()
        count = (len(self.valid_ids) - 1) // self.seq_len
        starts = torch.arange(count) * self.seq_len
        total, tokens = 0.0, 0
        with torch.no_grad():
            for first in range(0, count, self.batch_size):
                chunk = starts[first : first + self.batch_size]
                total += float(self.model(self._windows(self.valid_ids, chunk))) * len(chunk)
                tokens += len(chunk)
        self.model.train()
        return total / tokens

    def validation_loss(self) -> tuple[float, dict]:
        loss = self.valid_loss()
        perplexity = math.exp(loss)
        self.progress["last_valid"] = {"update": self.updates, "valid_loss": loss,
                                       "perplexity": perplexity}  # fmt: skip
        best = self.progress["best_valid"]
        if best is None or loss < best["valid_loss"]:
            self.progress["best_valid"] = self.progress["last_valid"]
        return loss, {"valid_perplexity": perplexity}

    def evaluate(self, stop: StopRequest) -> dict:
        """result.json's evaluation fields: ``value`` is the perplexity of the validation
        ``eval.checkpoint`` names (best: the lowest validation loss; last: the final model's),
        and both validations under ``checkpoints`` with their updates and losses. Nothing is
        scored again: the validations scored both models."""
        best, last = self.progress["best_valid"], self.progress["last_valid"]
        chosen = best if self.headline == "best" else last
        return {
            "value": chosen["perplexity"],
            "best_update": best["update"],
            "eval_split": "valid",
            "eval_tokens": (len(self.valid_ids) - 1) // self.seq_len * self.seq_len,
            "eval_checkpoint": self.headline,
            "checkpoints": {"last": dict(last), "best": dict(best)},
        }
