"""The library without the suite (`make check-library`, in a venv made from `pip install .[hf]`):
quantize a small transformers GPT-2, train it a step under DSQ's preset, step its ladder; train
another through a transformers.Trainer with DSQCallback (evaluations step the schedule, its
checkpoint holds the schedule, its result.json is priced); and show that nothing of the suite or
of fairseq, Hydra or wandb was loaded."""

from __future__ import annotations

import json
import sys

import torch
import transformers

import dsq
from dsq.integrations.hf import CHECKPOINT_FILE, DSQCallback

SUITE = {"dsq_cli", "fairseq", "hydra", "omegaconf", "wandb", "submitit"}


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    cfg = dsq.QuantConfig.from_preset("dsq")
    dsq.quantize_model(model, cfg, exclude=["lm_head"], strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with dsq.record_gemms() as recorded:
        loss = model(tokens, labels=tokens).loss
        loss.backward()
    optimizer.step()
    cfg.step(loss.item(), update=1)
    cfg.step(loss.item() + 1, update=2)  # a stall: the stash moves up one level
    changes, saved, priced = trainer_run()
    print(f"Trainer with DSQCallback: {len(changes)} level change(s); checkpoint {saved}; "
          f"result.json's arith ratio {priced}")  # fmt: skip
    loaded = sorted({m.split(".")[0] for m in sys.modules} & SUITE)
    print(model.dsq_report.summary())
    q1 = cfg.current()["q1"]
    print(f"loss {loss.item():.4f}; {len(recorded.gemms)} quantized GEMMs; q1 now {q1}")
    print(f"suite modules loaded: {loaded or 'none'}")
    failed = not recorded.gemms or len(changes) != 1 or not saved or not priced
    if loaded or q1 != "bfp3e8b16" or failed:
        sys.exit("library check failed")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_run() -> tuple[list[dict], bool, float | None]:
    """Four steps of a Trainer, evaluated and saved every two; a min_delta no loss can beat makes
    every evaluation a stall, so the stash rises at each. Returns the changes, whether the last
    checkpoint holds them, and the arithmetic ratio its result.json records."""
    import tempfile

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ladder = dsq.Schedule(["bfp2", "bfp3", "bfp4"], patience=1, min_delta=1e9)
    cfg = dsq.QuantConfig(q0="bfp8", q1=ladder, q2="bfp8", q3="fixed16")
    dsq.quantize_model(model, cfg, exclude=["lm_head"])
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=2,
            per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=2,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(16),
                                       eval_dataset=Tokens(8))  # fmt: skip
        callback = DSQCallback.attach(trainer, cfg)
        trainer.train()
        path = f"{out}/checkpoint-4/{CHECKPOINT_FILE}"
        saved = torch.load(path, weights_only=True)["history"]["changes"] == callback.changes
        result = callback.write_result(out, task="tokens", preset="dsq", metric="perplexity",
                                       value=None, valid_loss=None, model="gpt2-1x32", seed=0,
                                       wall_seconds=0.0)  # fmt: skip
        priced = json.loads(result.read_text())["cost"]["arith_ratio"]
    return callback.changes, saved, priced


if __name__ == "__main__":
    main()
