#!/usr/bin/env bash
# Install a real Triton Inference Server (2.51, CPU, Python backend) for trtllm-lite's Triton
# model repositories, in a prefix of its own (nothing in the calling venv changes).
#
#   bash tools/setup_triton.sh [PREFIX]   # default: $TRTLLM_LITE_TRITON_HOME or ~/.cache/trtllm-lite/triton
#
# Run it with the venv that has trtllm-lite installed active (or PYTHON=/path/to/venv/bin/python):
# the Python-backend stub runs model.py with that venv's packages. What it installs and why:
# trtllm_lite/triton/install.py and docs/triton.md. Idempotent; prints PREFIX.
set -euo pipefail
exec "${PYTHON:-python3}" -m trtllm_lite.triton.install "$@"
