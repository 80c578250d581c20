#!/usr/bin/env bash
# What DSQ's users run instead, trained where Table 1 trains (docs/results.md, "DSQ against
# autocast and checkpointing"): Multi30k de->en at its default budget, transformer_tiny, seed 1,
# rows amp_bf16 (torch.autocast to bf16) and dsq with per-layer activation checkpointing. Their
# fp32 and dsq rows are Table 1's, at the same task, model, budget and seed
# (results/table1-cpu/multi30k). `dsq sweep` skips the jobs that completed earlier and continues
# one cut short from its checkpoint, so this script continues an interrupted study.
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
        "data.raw_dir=$data/multi30k" model=transformer_tiny run.root=results/baselines-multi30k "$@"
}
sweep quant=amp_bf16
sweep quant=dsq train.activation_checkpointing=true
