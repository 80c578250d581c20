#!/usr/bin/env bash
# Table 1 at CPU scale and its ablations (docs/results.md): every preset of dsq_cli/conf/quant/ on
# Multi30k (2 seeds) and SST-2 (1 seed) at each task's default budget, then `dsq` changed one
# factor at a time on Multi30k (2 seeds). `dsq sweep` skips the jobs that completed earlier and
# continues a run cut short (a session that ended mid-run) from its checkpoint, so this script
# continues an interrupted study; keep the argument order, it names the jobs.
# Usage: scripts/table1_cpu.sh [multi30k|sst2|ablations|all]   (from the repository root)
set -euo pipefail
# this checkout's packages (dsq, the library, and dsq_cli, the suite), also when the study runs
# in a clone beside an editable install of another checkout: both resolve to the working directory
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dsq() { "${PYTHON:-python}" -m dsq_cli.cli "$@"; }
data=${DSQ_SHARED_DATA:-../shared/data}
presets=fp32,dsq,fixed32,fixed16,bfp16,bfp8,bfp6,stash_fixed,stash_bfp
multi30k=(task=multi30k "data.raw_dir=$data/multi30k" model=transformer_tiny)
what=${1:-all}
if [[ $what == multi30k || $what == all ]]; then
    dsq sweep --resume-unfinished seed=1,2 "${multi30k[@]}" "quant=$presets" run.root=results/table1-cpu/multi30k
fi
if [[ $what == sst2 || $what == all ]]; then
    dsq sweep --resume-unfinished seed=1 task=sst2 "data.raw_dir=$data/glue/SST-2" model=minilm \
        "quant=$presets" run.root=results/table1-cpu/sst2
fi
if [[ $what == ablations || $what == all ]]; then
    ablate() {  # ablate NAME OVERRIDE...: dsq with the overrides, 2 seeds
        local name=$1
        shift
        dsq sweep --resume-unfinished seed=1,2 "${multi30k[@]}" quant=dsq "$@" run.root="results/ablations/$name"
    }
    ablate stochastic-stash quant.rounding.q1=stochastic
    ablate first-level-bfp3 "quant.q1={levels: [bfp3, bfp4, bfp6, bfp8], patience: 1, min_delta: 0}"
    ablate first-level-bfp4 "quant.q1={levels: [bfp4, bfp6, bfp8], patience: 1, min_delta: 0}"
    ablate patience-2 quant.q1.patience=2
    ablate validate-every-40 train.validate_every=40
fi
