#!/usr/bin/env bash
# The convergence study (docs/results.md, "Training to the stall"): Multi30k de->en on its first
# 7,000 training pairs, transformer_tiny, every row trained for the budget at which fp32's
# validation loss stalls, 2 seeds. `dsq sweep` skips the jobs that completed earlier and
# continues a run cut short from its checkpoint, so this script continues an interrupted study.
# Usage: scripts/convergence.sh [budget|seed1|seed2|all]   (from the repository root)
#   budget: fp32, seed 1, with train.stop_patience=3 under a cap of 2,000 updates; the update at
#           which it stopped is the study's budget (read back from its result.json)
#   seed1, seed2: every row at that budget, one seed (seed 1 first: a complete table early)
set -euo pipefail
# this checkout's packages (dsq, the library, and dsq_cli, the suite), also when the study runs
# in a clone beside an editable install of another checkout: both resolve to the working directory
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dsq() { "${PYTHON:-python}" -m dsq_cli.cli "$@"; }
data=${DSQ_SHARED_DATA:-../shared/data}
task=(task=multi30k "data.raw_dir=$data/multi30k" data.subset=7000 model=transformer_tiny)
budget_root=results/convergence-budget
what=${1:-all}

if [[ $what == budget || $what == all ]]; then
    dsq sweep --resume-unfinished seed=1 "${task[@]}" quant=fp32 train.max_updates=2000 \
        train.stop_patience=3 run.root=$budget_root
fi
budget=$("${PYTHON:-python}" - "$budget_root" <<'PY'
import json, pathlib, sys
results = sorted(pathlib.Path(sys.argv[1]).glob("*/result.json"))
if not results:
    sys.exit("no budget run yet: run scripts/convergence.sh budget first")
result = json.loads(results[0].read_text())
stopped = (result.get("budget") or {}).get("stopped_early")
if result.get("status") != "completed" or not stopped:
    sys.exit(f"{results[0]}: fp32 did not stop at a stall within its cap; raise the cap")
print(stopped["update"])
PY
)
echo "convergence study: every row trains for $budget updates (fp32's stall)"

rows() {  # rows SEED: every row of the study (a root per seed: a sweep names jobs by what varies)
    local seed=$1
    local common=("${task[@]}" "train.max_updates=$budget" "run.root=results/convergence/seed$seed")
    dsq sweep --resume-unfinished "seed=$seed" "${common[@]}" \
        quant=fp32,dsq,bfp6,bfp6_rising_stash,dsq_bfp3,stash_bfp,bf16
    dsq sweep --resume-unfinished "seed=$seed" "${common[@]}" quant=dsq \
        quant.q1.policy=cyclic,pfq
}
if [[ $what == seed1 || $what == all ]]; then rows 1; fi
if [[ $what == seed2 || $what == all ]]; then rows 2; fi
