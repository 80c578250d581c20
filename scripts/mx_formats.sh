#!/usr/bin/env bash
# DSQ on the formats hardware runs (docs/results.md, "DSQ on MX and NVFP4"): Multi30k de->en at
# its default budget, transformer_tiny, seeds 1 and 2, rows mxfp8 (static MXFP8 everywhere),
# mx_dsq and nvfp4_dsq. Their fp32 and dsq rows are Table 1's, at the same task, model, budget
# and seeds (results/table1-cpu/multi30k). `dsq sweep` skips the jobs that completed earlier and
# continues one cut short from its checkpoint, so this script continues an interrupted study.
# Run it in a clone of its own, pinned to one commit, from that clone's root.
# Usage: scripts/mx_formats.sh
set -euo pipefail
# this checkout's packages, also beside an editable install of another checkout
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one thread a run: the study shares the cores with other runs (docs/benchmarks.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
data=${DSQ_SHARED_DATA:-../shared/data}
"${PYTHON:-python}" -m dsq_cli.cli sweep --resume-unfinished seed=1,2 task=multi30k \
    "data.raw_dir=$data/multi30k" model=transformer_tiny quant=mxfp8,mx_dsq,nvfp4_dsq \
    run.root=results/mx-formats-multi30k
