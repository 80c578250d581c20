#!/usr/bin/env bash
# Bit-exactness and bandwidth check of the Triton path on a CUDA machine (see gpu_check.py).
# On a machine without CUDA it runs the exactness part on tiny CPU tensors (TRITON_INTERPRET=1).
# Installs nothing: uses the repository's .venv when present, else python3 from PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
if [[ ! -x "$PY" ]]; then
    PY=python3
fi
"$PY" scripts/gpu_check.py "$@"
# The trainer's CUDA path end to end: a short demo run (dsq and fp32), no network, no wandb.
# (skipped, with a line, where the suite's packages are missing: the check itself needs none)
if ! "$PY" -c "import fairseq, hydra" 2>/dev/null; then
    echo "train (cuda): skipped, fairseq or hydra-core is not installed here"
elif "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    out=$(mktemp -d)
    for quant in fp32 dsq; do
        "$PY" -m dsq_cli.cli train task=demo quant=$quant logger=none train.device=cuda \
            data.cache_dir="$out/cache" run.root="$out/runs" train.max_updates=100 2>/dev/null \
            | tail -1 | sed "s/^/train $quant (cuda, 100 updates): /"
    done
fi
