"""The library without the suite (`make check-library`, in a venv made from `pip install .[hf]`):
quantize a small transformers GPT-2, train it a step under DSQ's preset, step its ladder, and
show that nothing of the suite or of fairseq, Hydra or wandb was loaded."""

from __future__ import annotations

import sys

import torch
import transformers

import dsq

SUITE = {"dsq_cli", "fairseq", "hydra", "omegaconf", "wandb", "submitit"}


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    cfg = dsq.QuantConfig(q0="bfp8", q1=dsq.Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"]),
                          q2="bfp8", q3="fixed16")  # fmt: skip
    dsq.quantize_model(model, cfg, exclude=["lm_head"], strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with dsq.record_gemms() as recorded:
        loss = model(tokens, labels=tokens).loss
        loss.backward()
    optimizer.step()
    cfg.step(loss.item(), update=1)
    cfg.step(loss.item() + 1, update=2)  # a stall: the stash moves up one level
    loaded = sorted({m.split(".")[0] for m in sys.modules} & SUITE)
    print(model.dsq_report.summary())
    q1 = cfg.current()["q1"]
    print(f"loss {loss.item():.4f}; {len(recorded.gemms)} quantized GEMMs; q1 now {q1}")
    print(f"suite modules loaded: {loaded or 'none'}")
    if loaded or q1 != "bfp3e8b16" or not recorded.gemms:
        sys.exit("library check failed")


if __name__ == "__main__":
    main()
