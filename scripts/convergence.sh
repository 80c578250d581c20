#!/usr/bin/env bash
# The convergence study (docs/results.md, "Training to the stall"): Multi30k on its first 7,000
# training pairs, transformer_tiny, every row trained for the budget at which fp32's validation
# loss stalls, in two settings: de->en (the study's first setting) and en->de (the same pairs in
# the other direction, with a budget of its own); and the same design on a language model
# (task=lm, Tiny Shakespeare, llama_lm). `dsq sweep` skips the jobs that completed
# earlier and continues a run cut short from its checkpoint, so this script continues an
# interrupted study. Run it in a clone of its own, pinned to one commit, from that clone's root
# (its packages are the ones imported: PYTHONPATH below).
#
# Usage: scripts/convergence.sh [STAGE...]   (default: all)
#   budget        de->en: fp32, seed 1, train.stop_patience=3 under a cap of 2,000 updates; the
#                 update at which it stopped is the setting's budget (read back from result.json)
#   seed1, seed2  de->en: the study's first nine rows on one seed
#   controls      de->en: the static-stash controls on seeds 1 and 2
#   en-de-budget  en->de: its budget, found as for de->en
#   more-seeds    de->en seeds 3-5 of the eight rows compared by seed, and en->de seeds 1-3 of
#                 its six rows, interleaved
#   clean-control dsq's clean control, dsq_stash_bfp2 (dsq's points, the stash static at bfp2):
#                 de->en seeds 1-5 and en->de seeds 1-3 (docs/results.md, "Protocol")
#   dsq-rerun     dsq trained again at the clean control's commit, in roots of its own
#                 (results/convergence-dsq-rerun/seedN, results/convergence-en-de-dsq-rerun/seedN),
#                 so that dsq minus its control measures the schedule, not the code between two
#                 commits (docs/results.md, the protocol's amendment)
#   lm-budget     the language-model study's budget: fp32, seed 1, task=lm on Tiny Shakespeare,
#                 train.stop_patience=3 under a cap of 5,000 updates
#   lm            the language-model study's eight rows on seeds 1-5, each trained for that budget,
#                 or for the cap where fp32 did not stall within it (docs/results.md, "Protocol":
#                 the rising stash on a language model)
#   lm-stash-all  the rows whose memory docs/benchmarks.md sets against autocast with
#                 checkpointing, trained on the language model for 300 updates, seed 1:
#                 amp_bf16 without and with checkpointing, dsq with stash_scope gemm and all, and
#                 all with checkpointing holding the layer inputs in bfp8, and all with SiLU
#                 holding 3-bit derivative codes (results/lm-stash-all)
#   lm-derivative3  all with 3-bit derivative codes, the row holding least without
#                 checkpointing, on seeds 1-3 for the language-model budget
#                 (results/lm-stash-all-derivative3/seedN, set against results/lm/seedN)
#   lm-held-sliced  the checkpointed row holding least: all, each checkpointed layer's input
#                 held in bfp8, the MLPs in slices, with checkpointing, on seeds 1-3 for the
#                 language-model budget (results/lm-held-sliced/seedN, set against results/lm/seedN)
#   lm-held-sdpa  lm-held-sliced with the attention in torch's fused kernel in bf16 on q0's Q, K
#                 and V (quant.attention=sdpa_bf16), on seeds 1-3 for the language-model budget
#                 (results/lm-held-sdpa/seedN, set against results/lm/seedN)
#   all           every stage above, in that order
#
# STUDY_LANES (default 2) runs the stages in that many processes at once, one thread each
# (OMP_NUM_THREADS=1): each lane walks the same stages, and a sweep leaves a job another lane has
# claimed to it, so the lanes share the jobs out. A lane skips the en->de rows until the
# en->de budget run has completed; a last pass after the lanes catches what they left. One
# thread a run: two PyTorch processes of two threads each on two cores slow each other down
# several times over (docs/benchmarks.md).
set -euo pipefail
# this checkout's packages (dsq, the library, and dsq_cli, the suite), also when the study runs
# in a clone beside an editable install of another checkout: both resolve to the working directory
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A sweep with a failed job exits 1 after running the rest; the study goes on to its next sweep
# and exits 1 at the end, so that one crashed run never stops the others.
failed=0
dsq() { "${PYTHON:-python}" -m dsq_cli.cli "$@" || failed=1; }
data=${DSQ_SHARED_DATA:-../shared/data}
task=(task=multi30k "data.raw_dir=$data/multi30k" data.subset=7000 model=transformer_tiny)
en_de=(task.src=en task.tgt=de)
# the rows compared seed by seed: fp32, DSQ, the static formats around it, the rising stashes and
# their static controls
paired_rows=fp32,dsq,stash_bfp,bfp6,bfp6_rising_stash,bfp6_stash_bfp3,bfp6_stash_bfp4,dsq_stash_bfp3
en_de_rows=fp32,dsq,bfp6,bfp6_rising_stash,bfp6_stash_bfp3,bfp6_stash_bfp4
controls=bfp6_stash_bfp3,bfp6_stash_bfp4,dsq_stash_bfp3
# the language-model study (docs/results.md, "Protocol"): the character-level task on Tiny
# Shakespeare with its default Llama-style model; each rising row beside its static control
lm_task=(task=lm "data.raw_dir=$data/tinyshakespeare")
lm_rows=fp32,amp_bf16,dsq,dsq_stash_bfp2,bfp6_rising_stash,bfp6_stash_bfp3,nvfp4_dsq
lm_rows+=,nvfp4_dsq_stash_nvfp4

find_budget() {  # find_budget ROOT CAP TASK_OVERRIDES...: fp32 trained until its validation loss stalls
    local root=$1 cap=$2
    shift 2
    dsq sweep --resume-unfinished seed=1 "$@" quant=fp32 "train.max_updates=$cap" \
        train.stop_patience=3 "run.root=$root"
}
budget_of() {  # budget_of ROOT [cap]: the update at which that budget run stopped; fails without
    # one. With "cap": a budget run that completed its cap without a stall gives the cap (the
    # language-model study's rule, docs/results.md, "Protocol")
    "${PYTHON:-python}" - "$1" "${2:-}" <<'PY'
import json, pathlib, sys
results = sorted(pathlib.Path(sys.argv[1]).glob("*/result.json"))
if not results:
    sys.exit(f"no budget run in {sys.argv[1]} yet: run its budget stage first")
result = json.loads(results[0].read_text())
stopped = (result.get("budget") or {}).get("stopped_early")
if result.get("status") == "completed" and not stopped and sys.argv[2] == "cap":
    print(result["updates"])
    sys.exit(0)
if result.get("status") != "completed" or not stopped:
    sys.exit(f"{results[0]}: fp32 has not stopped at a stall within its cap (yet)")
print(stopped["update"])
PY
}
de_en() {  # de_en SEED QUANTS [OVERRIDES...]: rows of the de->en setting on one seed
    local seed=$1 quants=$2 budget
    shift 2
    budget=$(budget_of results/convergence-budget)
    dsq sweep --resume-unfinished "seed=$seed" "${task[@]}" "train.max_updates=$budget" \
        "run.root=results/convergence/seed$seed" "quant=$quants" "$@"
}
en_de_rows_of() {  # en_de_rows_of SEED [ROWS [ROOT]]: en->de rows on one seed, once its budget is known
    local budget rows=${2:-$en_de_rows} root=${3:-results/convergence-en-de/seed$1}
    if ! budget=$(budget_of results/convergence-en-de-budget 2>/dev/null); then
        echo "convergence.sh: en->de seed $1 waits for the en->de budget run" >&2
        return 0
    fi
    dsq sweep --resume-unfinished "seed=$1" "${task[@]}" "${en_de[@]}" \
        "train.max_updates=$budget" "run.root=$root" "quant=$rows"
}
lm_for_budget() {  # lm_for_budget SEED ROOT ARG...: a language-model sweep for the budget, once known
    local budget seed=$1 root=$2
    shift 2
    if ! budget=$(budget_of results/lm-budget cap 2>/dev/null); then
        echo "convergence.sh: the language-model seed $seed ($root) waits for its budget run" >&2
        return 0
    fi
    dsq sweep --resume-unfinished "seed=$seed" "${lm_task[@]}" "train.max_updates=$budget" \
        "run.root=$root/seed$seed" "$@"
}
first_rows() {  # first_rows SEED: the study's first nine rows
    de_en "$1" fp32,dsq,bfp6,bfp6_rising_stash,dsq_bfp3,stash_bfp,bf16
    de_en "$1" dsq quant.q1.policy=cyclic,pfq
}

stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(all)
for stage in "${stages[@]}"; do
    case $stage in
    budget | seed1 | seed2 | controls | en-de-budget | more-seeds | clean-control | dsq-rerun | \
        lm-budget | lm | lm-stash-all | lm-derivative3 | lm-held-sliced | lm-held-sdpa | all) ;;
    *)
        echo "convergence.sh: unknown stage '$stage'; choose budget, seed1, seed2, controls," \
            "en-de-budget, more-seeds, clean-control, dsq-rerun, lm-budget, lm, lm-stash-all," \
            "lm-derivative3, lm-held-sliced, lm-held-sdpa or all" >&2
        exit 2
        ;;
    esac
done
wants() {
    local stage
    for stage in "${stages[@]}"; do [[ $stage == "$1" || $stage == all ]] && return 0; done
    return 1
}
lane() {  # every stage asked for, in order
    if wants budget; then find_budget results/convergence-budget 2000 "${task[@]}"; fi
    if wants seed1; then first_rows 1; fi
    if wants seed2; then first_rows 2; fi
    if wants controls; then
        de_en 1 "$controls"
        de_en 2 "$controls"
    fi
    if wants en-de-budget; then
        find_budget results/convergence-en-de-budget 2000 "${task[@]}" "${en_de[@]}"
    fi
    if wants more-seeds; then
        for seed in 3 4 5; do
            en_de_rows_of $((seed - 2))
            de_en "$seed" "$paired_rows"
        done
    fi
    if wants clean-control; then
        # swept beside dsq, which each seed's folder holds finished (the sweep skips it), so that
        # the control's folder is named for its preset, quant-dsq_stash_bfp2
        for seed in 1 2 3 4 5; do
            de_en "$seed" dsq,dsq_stash_bfp2
            if ((seed <= 3)); then en_de_rows_of "$seed" dsq,dsq_stash_bfp2; fi
        done
    fi
    if wants dsq-rerun; then
        # choice(dsq): a sweep of one row, its folder named quant-dsq as in the study's roots; the
        # later run.root is the one the sweep takes
        for seed in 1 2 3 4 5; do
            de_en "$seed" "choice(dsq)" "run.root=results/convergence-dsq-rerun/seed$seed"
            if ((seed <= 3)); then
                en_de_rows_of "$seed" "choice(dsq)" "results/convergence-en-de-dsq-rerun/seed$seed"
            fi
        done
    fi
    if wants lm-budget; then find_budget results/lm-budget 5000 "${lm_task[@]}"; fi
    if wants lm; then
        for seed in 1 2 3 4 5; do lm_for_budget "$seed" results/lm "quant=$lm_rows"; done
    fi
    if wants lm-stash-all; then
        local short=(seed=1 "${lm_task[@]}" train.max_updates=300 run.root=results/lm-stash-all)
        # choice(...): a key of one value still names the folders (quant-dsq_quant.stash_scope-all)
        dsq sweep --resume-unfinished "${short[@]}" "quant=choice(amp_bf16)" \
            train.activation_checkpointing=false,true
        dsq sweep --resume-unfinished "${short[@]}" "quant=choice(dsq)" quant.stash_scope=gemm,all
        dsq sweep --resume-unfinished "${short[@]}" "quant=choice(dsq)" \
            "quant.stash_scope=choice(all)" "quant.saved.checkpoint=choice(bfp8)" \
            "train.activation_checkpointing=choice(true)"
        dsq sweep --resume-unfinished "${short[@]}" "quant=choice(dsq)" \
            "quant.stash_scope=choice(all)" "quant.saved.activation=choice(derivative3)"
    fi
    if wants lm-derivative3; then
        # all with 3-bit derivative codes, the row holding least without checkpointing
        for seed in 1 2 3; do
            lm_for_budget "$seed" results/lm-stash-all-derivative3 "quant=choice(dsq)" \
                "quant.stash_scope=choice(all)" "quant.saved.activation=choice(derivative3)"
        done
    fi
    if wants lm-held-sliced; then
        for seed in 1 2 3; do
            lm_for_budget "$seed" results/lm-held-sliced "quant=choice(dsq)" \
                "quant.stash_scope=choice(all)" "quant.saved.checkpoint=choice(bfp8)" \
                "quant.mlp=choice(sliced)" "train.activation_checkpointing=choice(true)"
        done
    fi
    if wants lm-held-sdpa; then
        for seed in 1 2 3; do
            lm_for_budget "$seed" results/lm-held-sdpa "quant=choice(dsq)" \
                "quant.stash_scope=choice(all)" "quant.saved.checkpoint=choice(bfp8)" \
                "quant.mlp=choice(sliced)" "quant.attention=choice(sdpa_bf16)" \
                "train.activation_checkpointing=choice(true)"
        done
    fi
    return $failed
}

lanes=${STUDY_LANES:-2}
pids=()
for ((i = 1; i < lanes; i++)); do
    lane &
    pids+=($!)
    sleep 60 # the next lane starts once this one has claimed its first job
done
lane || failed=1
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
# what the lanes left: a job one of them found claimed, the en->de rows before their budget
lane || failed=1
exit $failed
