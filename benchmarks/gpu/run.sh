#!/usr/bin/env bash
# hasten on one GPU: parity against transformers, then decode / prefill speed on a Llama-3-8B-shaped model
# with random bf16 weights (benchmarks/gpu/bench.py). Needs nothing from the network; fits one 8-minute
# device call. Usage (repository root): bash benchmarks/gpu/run.sh   (results: $OUT/gpu_bench.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-$PWD}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m pytest -q tests/gpu -x -p no:cacheprovider 2>&1 | tail -5 || true
exec python3 benchmarks/gpu/bench.py
