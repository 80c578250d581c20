"""A small GPT-2 trained from scratch with DSQ through Hugging Face's ``Trainer`` (docs/hf.md).

    python examples/hf_causal_lm.py [--out runs/hf-causal-lm] [--quant dsq] [--steps 600]

The corpus is a small generated language (`sentences`: a few English word lists in one sentence
pattern with optional parts, deterministic and offline), one sentence per sequence, characters
as tokens: which word comes next is a draw from a list, but once a word has begun most of its
characters follow from the ones before, so the loss has far to fall. The model is GPT-2
(2 layers, 128 wide, SDPA attention) with every ``Conv1D`` and both attention products patched
by ``quantize_model`` (the LM head excluded, as dsq's trainers keep the output layer);
``DSQCallback`` steps the stash schedule on each evaluation's loss. It prints the training loss
of the first step and of the last logged step, and writes the Trainer's output and a
``result.json`` that ``dsq table OUT`` reads (metric: validation perplexity).

It imports dsq, torch and transformers only.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
import transformers

from dsq import QuantConfig, quantize_model
from dsq.integrations.hf import DSQCallback, quiet_logs

PAD, EOS = 0, 1
DETERMINERS = ("the", "a", "every", "no", "one", "some")
ADJECTIVES = ("red", "small", "quiet", "old", "bright", "green", "heavy", "quick", "cold", "tall")
NOUNS = ("cat", "river", "teacher", "stone", "garden", "engine", "bird", "window", "farmer",
         "cloud", "letter", "horse", "city", "lamp", "boat", "child")  # fmt: skip
VERBS = ("sees", "follows", "carries", "finds", "paints", "likes", "pushes", "watches", "builds")
PREPOSITIONS = ("near", "under", "behind", "above", "beside", "inside")
SPLIT_SEEDS = {"train": 1, "valid": 2}  # the corpus is fixed: the same on every machine and run


def sentences(split: str, count: int) -> list[str]:
    """``count`` sentences of ``split``: ``DET [ADJ] NOUN VERB DET [ADJ] NOUN [PREP DET [ADJ]
    NOUN].``, the same on every call."""
    rng = random.Random(SPLIT_SEEDS[split])

    def noun_phrase() -> list[str]:
        adjective = [rng.choice(ADJECTIVES)] if rng.random() < 0.5 else []
        return [rng.choice(DETERMINERS), *adjective, rng.choice(NOUNS)]

    out = []
    for _ in range(count):
        words = [*noun_phrase(), rng.choice(VERBS), *noun_phrase()]
        if rng.random() < 0.4:
            words += [rng.choice(PREPOSITIONS), *noun_phrase()]
        out.append(" ".join(words) + ".")
    return out


class Sentences(torch.utils.data.Dataset):
    """Character ids of each sentence and an end token, padded to the longest (labels -100
    there)."""

    def __init__(self, text: list[str], vocab: dict[str, int]) -> None:
        rows = [[vocab.get(c, PAD) for c in s] + [EOS] for s in text]
        width = max(map(len, rows))
        self.ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, row in enumerate(rows):
            self.ids[i, : len(row)] = torch.tensor(row)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        mask = (ids != PAD).long()
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf-causal-lm", help="output directory")
    parser.add_argument("--quant", default="dsq", help="a preset of dsq.presets")
    parser.add_argument("--steps", type=int, default=600, help="training steps (the budget)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    quiet_logs()
    torch.manual_seed(args.seed)

    train_text, valid_text = sentences("train", 6000), sentences("valid", 300)
    characters = sorted({c for s in train_text for c in s})
    vocab = {c: i + 2 for i, c in enumerate(characters)}  # 0: padding, 1: end of sentence
    train, valid = Sentences(train_text, vocab), Sentences(valid_text, vocab)

    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=train.ids.shape[1] + 8,
        vocab_size=len(vocab) + 2, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
        attn_implementation="sdpa",
    )  # fmt: skip
    cfg = QuantConfig.from_preset(args.quant, seed=args.seed)
    model = quantize_model(transformers.GPT2LMHeadModel(config), cfg, exclude=["lm_head"])
    print(model.dsq_report.summary())

    out = Path(args.out)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=32,
        learning_rate=1e-3, warmup_steps=args.steps // 10, weight_decay=0.01,
        eval_strategy="steps", eval_steps=args.eval_every, per_device_eval_batch_size=100,
        logging_steps=10, logging_first_step=True, save_strategy="no", report_to=[],
        seed=args.seed, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=train, eval_dataset=valid
    )
    callback = DSQCallback.attach(trainer, cfg)
    started = time.time()
    trainer.train()
    final = trainer.evaluate()  # its loss steps the schedule once more, after the last step
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    first, last = losses[0], losses[-1]
    perplexity = math.exp(final["eval_loss"])
    print(f"training loss: first step {first:.3f}, last logged {last:.3f} ({last / first:.2f}x); "
          f"validation loss {final['eval_loss']:.3f}, perplexity {perplexity:.2f}; "
          f"stash {cfg.current()['q1']}, {len(callback.changes)} level change(s)")  # fmt: skip
    path = callback.write_result(
        out, task="toy-lm", preset=args.quant, metric="perplexity", value=perplexity,
        valid_loss=final["eval_loss"], model="gpt2-2x128", seed=args.seed,
        wall_seconds=time.time() - started,
        evaluation={"first_train_loss": first, "last_train_loss": last},
    )  # fmt: skip
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
