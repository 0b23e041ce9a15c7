#!/usr/bin/env bash
# The GPU path on a CUDA machine, in a few minutes: the VRAM tests (synthetic and hf engines,
# services' caches in device memory, every transferred byte checked by digests and by
# --check-state), then `bench transfer --device cuda`: our READ VRAM to VRAM against raw NIXL on
# the same descriptors and a device-to-device copy, at nemotron-3-nano sizes, 2k-token prompts.
#
#   scripts/gpu-check.sh            (PYTHON=... to pick the interpreter; default .venv/bin/python)
#
# Exits 2 at once, saying why, where CUDA is not usable.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no usable CUDA device here (torch.cuda.is_available() is false); run it on a GPU machine" >&2
  exit 2
fi
"$python" -c 'import torch; print("gpu-check: on", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'

export PYTHONPATH=$PWD
echo "gpu-check: VRAM path, synthetic and hf engines"
timeout 240 "$python" -m pytest -q -p no:cacheprovider -m gpu tests/integration/gpu
echo "gpu-check: bench transfer, VRAM to VRAM (TP 1 -> 1: one GPU is enough)"
timeout 240 "$python" -c 'import sys; from hybridpd_tools.cli.main import main; sys.exit(main())' \
  bench transfer --device cuda --prompt-tokens 2048 --requests 10 --no-progress
echo "gpu-check: OK"
