#!/usr/bin/env bash
# The CUDA backend's GPU checks in one command, on a machine with an NVIDIA GPU (driver
# 580 or newer, for CUDA 13.0) and a Rust toolchain: builds the GPU bundle
# (scripts/gpu-bundle.sh) and runs it (target/gpu-bundle/run.sh): the CUDA tests (every op
# against its CPU twin, a training step in both precisions, the recompute policies, the
# default run's first 50 steps) with their output shown, the GPU benchmark and a GPT-2
# 124M training run, then the PyTorch and llm.c references where they can run.
#
#   scripts/gpu-check.sh                 # everything
#   scripts/gpu-check.sh --no-bench      # the CUDA tests only
#   scripts/gpu-check.sh tests bench     # the bundle's phases named (see run.sh)
#
# Where the GPU has no Rust toolchain, build the bundle elsewhere and carry
# target/gpu-bundle over: run.sh needs no Rust and no network. The report goes to $OUT
# when set, else to a folder run.sh names.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no NVIDIA GPU answers here (nvidia-smi): these checks need one" >&2
  exit 1
fi
phases=("$@")
if [ "${1:-}" = "--no-bench" ]; then
  phases=(tests)
fi
scripts/gpu-bundle.sh
exec bash target/gpu-bundle/run.sh "${phases[@]}"
