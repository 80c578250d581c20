#!/usr/bin/env bash
# The convergence study (docs/results.md, "Training to the stall"): Multi30k on its first 7,000
# training pairs, transformer_tiny, every row trained for the budget at which fp32's validation
# loss stalls, in two settings: de->en (the study's first setting) and en->de (the same pairs in
# the other direction, with a budget of its own). `dsq sweep` skips the jobs that completed
# earlier and continues a run cut short from its checkpoint, so this script continues an
# interrupted study; run it in a clone of its own, pinned to one commit.
# Usage: scripts/convergence.sh [STAGE...]   (from the repository root; default: all)
#   budget        de->en: fp32, seed 1, train.stop_patience=3 under a cap of 2,000 updates; the
#                 update at which it stopped is the setting's budget (read back from result.json)
#   seed1, seed2  de->en: the study's first nine rows on one seed
#   controls      de->en: the static-stash controls on seeds 1 and 2, each seed run as its other
#                 rows ran (seed 1 one run at a time on both cores, seed 2 two at a time)
#   en-de-budget  en->de: its budget, found as for de->en
#   more-seeds    de->en seeds 3-5 of the eight rows compared by seed, and en->de seeds 1-3 of its
#                 six rows, interleaved (two runs at a time, one thread each)
#   all           every stage above, in that order
set -euo pipefail
# this checkout's packages (dsq, the library, and dsq_cli, the suite), also when the study runs
# in a clone beside an editable install of another checkout: both resolve to the working directory
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A sweep with a failed job exits 1 after running the rest; the study goes on to its next sweep
# and exits 1 at the end, so that one crashed run never stops the others.
failed=0
dsq() { "${PYTHON:-python}" -m dsq_cli.cli "$@" || failed=1; }
data=${DSQ_SHARED_DATA:-../shared/data}
task=(task=multi30k "data.raw_dir=$data/multi30k" data.subset=7000 model=transformer_tiny)
en_de=(task.src=en task.tgt=de)
two_at_a_time=(launcher=joblib launcher.n_jobs=2)
# the rows compared seed by seed: fp32, DSQ, the static formats around it, the rising stashes and
# their static controls
paired_rows=fp32,dsq,stash_bfp,bfp6,bfp6_rising_stash,bfp6_stash_bfp3,bfp6_stash_bfp4,dsq_stash_bfp3
en_de_rows=fp32,dsq,bfp6,bfp6_rising_stash,bfp6_stash_bfp3,bfp6_stash_bfp4

find_budget() {  # find_budget ROOT [OVERRIDES...]: fp32 trained until its validation loss stalls
    local root=$1
    shift
    dsq sweep --resume-unfinished seed=1 "${task[@]}" "$@" quant=fp32 train.max_updates=2000 \
        train.stop_patience=3 "run.root=$root"
}
budget_of() {  # budget_of ROOT: the update at which that budget run stopped
    "${PYTHON:-python}" - "$1" <<'PY'
import json, pathlib, sys
results = sorted(pathlib.Path(sys.argv[1]).glob("*/result.json"))
if not results:
    sys.exit(f"no budget run in {sys.argv[1]} yet: run its budget stage first")
result = json.loads(results[0].read_text())
stopped = (result.get("budget") or {}).get("stopped_early")
if result.get("status") != "completed" or not stopped:
    sys.exit(f"{results[0]}: fp32 did not stop at a stall within its cap; raise the cap")
print(stopped["update"])
PY
}
de_en() {  # de_en SEED QUANTS [SWEEP OVERRIDES...]: rows of the de->en setting on one seed
    local seed=$1 quants=$2
    shift 2
    local budget
    budget=$(budget_of results/convergence-budget)
    dsq sweep --resume-unfinished "seed=$seed" "${task[@]}" "train.max_updates=$budget" \
        "run.root=results/convergence/seed$seed" "quant=$quants" "$@"
}
en_de_rows_of() {  # en_de_rows_of SEED: the en->de setting's rows on one seed
    local budget
    budget=$(budget_of results/convergence-en-de-budget)
    dsq sweep --resume-unfinished "seed=$1" "${task[@]}" "${en_de[@]}" \
        "train.max_updates=$budget" "run.root=results/convergence-en-de/seed$1" \
        "quant=$en_de_rows" "${two_at_a_time[@]}"
}
first_rows() {  # first_rows SEED: the study's first nine rows
    de_en "$1" fp32,dsq,bfp6,bfp6_rising_stash,dsq_bfp3,stash_bfp,bf16
    de_en "$1" dsq quant.q1.policy=cyclic,pfq
}

stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(all)
for stage in "${stages[@]}"; do
    case $stage in
    budget | seed1 | seed2 | controls | en-de-budget | more-seeds | all) ;;
    *)
        echo "convergence.sh: unknown stage '$stage'; choose budget, seed1, seed2, controls," \
            "en-de-budget, more-seeds or all" >&2
        exit 2
        ;;
    esac
done
wants() {
    local stage
    for stage in "${stages[@]}"; do [[ $stage == "$1" || $stage == all ]] && return 0; done
    return 1
}

if wants budget; then find_budget results/convergence-budget; fi
if wants seed1; then first_rows 1; fi
if wants seed2; then first_rows 2; fi
if wants controls; then
    de_en 1 bfp6_stash_bfp3,bfp6_stash_bfp4,dsq_stash_bfp3
    de_en 2 bfp6_stash_bfp3,bfp6_stash_bfp4,dsq_stash_bfp3 "${two_at_a_time[@]}"
fi
if wants en-de-budget; then find_budget results/convergence-en-de-budget "${en_de[@]}"; fi
if wants more-seeds; then
    for seed in 3 4 5; do
        en_de_rows_of $((seed - 2))
        de_en "$seed" "$paired_rows" "${two_at_a_time[@]}"
    done
fi
exit $failed
