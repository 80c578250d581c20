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
exec "$PY" scripts/gpu_check.py "$@"
