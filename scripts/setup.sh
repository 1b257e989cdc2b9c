#!/usr/bin/env bash
# Creates .venv with the project and its test/train extras. Idempotent: it reinstalls only
# when pyproject.toml changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
stamp="$venv/.installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
python3 -m venv "$venv"
if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    # No GPU: pin the release whose CPU build this machine keeps on local disk, so resolving the
    # project's torch range keeps it instead of pulling a multi-GB CUDA build.
    "$venv/bin/pip" install --quiet "torch==2.13.0"
fi
"$venv/bin/pip" install --quiet -e ".[test,train]"
touch "$stamp"
