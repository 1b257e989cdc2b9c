#!/usr/bin/env bash
# Creates .venv with the project and its test/train/video extras. Idempotent: it reinstalls only
# when pyproject.toml changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
stamp="$venv/.installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
# pip runs quietly (its progress is pages of lines), so say what the minutes go to.
if [ -d "$venv" ]; then
    echo "setup: updating $venv to pyproject.toml (under a minute when its dependencies are installed already)"
else
    echo "setup: installing the project and its dependencies (PyTorch, Ray Serve, diffusers, transformers) into $venv;"
    echo "setup: about 2-3 minutes on a fresh machine, longer with a GPU (pip fetches PyTorch's CUDA build)"
fi
python3 -m venv "$venv"
if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    # No GPU: pin the release whose CPU build this machine keeps on local disk, so resolving the
    # project's torch range keeps it instead of pulling a multi-GB CUDA build.
    echo "setup: no GPU here: torch 2.13.0, CPU build"
    "$venv/bin/pip" install --quiet "torch==2.13.0"
fi
echo "setup: the project (editable) with its test, training and video extras"
"$venv/bin/pip" install --quiet -e ".[test,train,video]"
touch "$stamp"
echo "setup: $venv is ready (${SECONDS} s); it is reinstalled only when pyproject.toml changes"
