"""``DSQCallback`` in a ``transformers.Trainer``: the schedule steps on eval_loss, the loggers see
the bits in force, and a run resumed from a Trainer checkpoint continues at the same level."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

from dsq.engine import QuantConfig, Schedule  # noqa: E402
from dsq.integrations import quantize_model  # noqa: E402
from dsq.integrations.hf import CHECKPOINT_FILE, DSQCallback  # noqa: E402
from dsq_cli.run_result import RunResult  # noqa: E402

pytestmark = pytest.mark.slow  # trains (a few seconds)


class Pairs(torch.utils.data.Dataset):
    """Random token sequences labelled by whether token 1 appears: learnable, fixed by a seed."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, 50, (n, 12), generator=g)
        self.ids[: n // 2, 3] = 1
        self.labels = (self.ids == 1).any(1).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def config() -> QuantConfig:
    # min_delta far above any improvement: every evaluation after the first is "no better", so
    # with patience 1 the stash rises one level per evaluation from the second on
    ladder = Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"], patience=1, min_delta=1e9)
    return QuantConfig(q0="bfp8", q1=ladder, q2="bfp8", q3="fixed16")


def trainer(out, cfg, max_steps: int):
    torch.manual_seed(0)
    bert = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=50, num_labels=2, attn_implementation="eager",
    )  # fmt: skip
    model = quantize_model(
        transformers.BertForSequenceClassification(bert), cfg, exclude=["classifier"]
    )
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        logging_steps=1, report_to=[], seed=0, data_seed=0, use_cpu=True,
        learning_rate=1e-3, lr_scheduler_type="constant", disable_tqdm=True,
    )  # fmt: skip
    t = transformers.Trainer(
        model=model, args=args, train_dataset=Pairs(64, 0), eval_dataset=Pairs(16, 1)
    )
    return t, DSQCallback.attach(t, cfg)


class Logger(transformers.TrainerCallback):
    """Stands for a logging integration (wandb, TensorBoard): keeps what it is sent."""

    def __init__(self):
        self.lines = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.lines.append(dict(logs))


def test_the_schedule_rises_through_the_callback_and_the_logs_carry_the_bits(tmp_path):
    cfg = config()
    t, callback = trainer(tmp_path, cfg, max_steps=6)
    logger = Logger()
    t.add_callback(logger)
    t.train()
    # evaluations at steps 2, 4, 6: the second and third find no improvement
    assert [(c["update"], c["from"], c["to"]) for c in callback.changes] == [
        (4, "bfp2e8b16", "bfp3e8b16"),
        (6, "bfp3e8b16", "bfp4e8b16"),
    ]
    assert cfg.format("q1").spec == "bfp4e8b16"
    logged = [entry for entry in t.state.log_history if "loss" in entry]
    assert logged and all(entry["dsq/q0_bits"] == 8.5 for entry in logged)
    assert [e["dsq/q1_bits"] for e in logged if e["step"] in (1, 5)] == [2.5, 3.5]
    sent = [line for line in logger.lines if "loss" in line]
    assert len(sent) == len(logged) and all("dsq/q1_bits" in line for line in sent)
    assert logger.lines[-1]["dsq/level_changes"] == 2  # the run's closing line
    saved = torch.load(tmp_path / "checkpoint-4" / CHECKPOINT_FILE, weights_only=True)
    assert saved["history"]["changes"] == callback.changes[:1]  # as at step 4
    assert not list((tmp_path / "checkpoint-4").glob(f".{CHECKPOINT_FILE}.*"))  # no temp file
    # the run's result.json, priced like dsq train's: first step's GEMMs, steps per level
    assert len(callback.gemm_shapes) == 7 + 2  # 6 in the layer, the pooler, 2 products
    callback.write_result(tmp_path, task="pairs", preset="dsq", metric="accuracy", value=0.5,
                          valid_loss=0.69, model="bert-tiny", seed=0, wall_seconds=1.0)  # fmt: skip
    read = RunResult.read(tmp_path)
    assert read.updates == 6 and read.status == "completed"
    assert read.quant["modified"] is True  # min_delta differs from the dsq preset's
    assert 0 < read.cost["arith_ratio"] < 1 and 0 < read.cost["dram_ratio"] < 1
    assert read.stash_bits_mean == pytest.approx((2.5 * 4 + 3.5 * 2) / 6)  # bfp4: from step 6 on


def test_an_evaluation_outside_train_leaves_the_schedule_as_trained(tmp_path):
    """A closing trainer.evaluate() finds no improvement (min_delta), yet the stash stays where
    training left it, and the result says the stash the run trained with."""
    cfg = config()
    t, callback = trainer(tmp_path, cfg, max_steps=4)
    t.train()
    assert cfg.format("q1").spec == "bfp3e8b16" and len(callback.changes) == 1
    t.evaluate()
    assert cfg.format("q1").spec == "bfp3e8b16" and len(callback.changes) == 1
    record = callback.run_result(
        task="pairs", preset="dsq", metric="accuracy", value=0.5, valid_loss=0.69,
        model="bert-tiny", seed=0, wall_seconds=1.0,
    )  # fmt: skip
    assert record["bits_final"]["q1"] == "bfp3e8b16"


def test_resuming_from_a_trainer_checkpoint_continues_at_the_same_level(tmp_path):
    straight_cfg = config()
    straight, straight_callback = trainer(tmp_path / "straight", straight_cfg, max_steps=6)
    straight.train()

    first_cfg = config()
    first, _ = trainer(tmp_path / "stopped", first_cfg, max_steps=4)
    first.train()  # "interrupted" after step 4, its checkpoint saved
    assert first_cfg.format("q1").spec == "bfp3e8b16"

    resumed_cfg = config()  # a fresh process: the schedule starts at bfp2 until restored
    resumed, resumed_callback = trainer(tmp_path / "stopped", resumed_cfg, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    assert resumed_callback.changes == straight_callback.changes
    assert resumed_cfg.state_dict() == straight_cfg.state_dict()
    assert resumed_callback.segments == straight_callback.segments  # steps per level
    assert [n for _, n in straight_callback.segments] == [4, 2]  # bfp2 to step 4, then bfp3


def test_resuming_without_the_schedule_is_refused(tmp_path):
    first, _ = trainer(tmp_path, config(), max_steps=2)
    first.train()
    (tmp_path / "checkpoint-2" / CHECKPOINT_FILE).unlink()
    again, _ = trainer(tmp_path, config(), max_steps=4)
    with pytest.raises(FileNotFoundError, match="without the DSQ schedule"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_a_train_that_raises_leaves_later_evaluations_outside_training(tmp_path):
    """A train() that raises never reaches on_train_end: the callback ends its training itself,
    so a trainer.evaluate() afterwards leaves the schedule as it is."""
    cfg = config()
    t, callback = trainer(tmp_path, cfg, max_steps=4)

    class Failing(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("a step failed")

    t.add_callback(Failing())
    with pytest.raises(RuntimeError, match="a step failed"):
        t.train()
    level, changes = cfg.format("q1").spec, len(callback.changes)
    t.evaluate()
    assert (cfg.format("q1").spec, len(callback.changes)) == (level, changes)
