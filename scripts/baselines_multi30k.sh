#!/usr/bin/env bash
# What DSQ's users run instead, trained where Table 1 trains (docs/results.md, "DSQ against
# autocast and checkpointing"): Multi30k de->en at its default budget, transformer_tiny, seed 1.
# results/baselines-multi30k: amp_bf16 (torch.autocast to bf16) and dsq; results/
# checkpointed-multi30k: both with every layer's activations checkpointed. Table 1's fp32 and dsq
# rows (results/table1-cpu/multi30k) ran at the same task, model, budget and seed.
# `dsq sweep` skips the jobs that completed earlier and continues one cut short from its
# checkpoint, so this script continues an interrupted study.
# Run it in a clone of its own, pinned to one commit, from that clone's root.
# Usage: scripts/baselines_multi30k.sh
set -euo pipefail
# this checkout's packages, also beside an editable install of another checkout
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one thread a run: the study shares the cores with other runs (docs/benchmarks.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
data=${DSQ_SHARED_DATA:-../shared/data}
sweep() {
    "${PYTHON:-python}" -m dsq_cli.cli sweep --resume-unfinished seed=1 task=multi30k \
        "data.raw_dir=$data/multi30k" model=transformer_tiny "$@"
}
sweep quant=dsq,amp_bf16 train.activation_checkpointing=true run.root=results/checkpointed-multi30k
sweep quant=amp_bf16,dsq run.root=results/baselines-multi30k
