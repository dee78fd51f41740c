#!/usr/bin/env bash
# Installs everything, then serves the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
exec hasten serve "$@"
