#!/usr/bin/env bash
# The CUDA backend's GPU checks in one command, on a machine with an NVIDIA GPU (driver
# 580 or newer, for CUDA 13.0): builds trainkit, runs the CUDA tests (every op against its
# CPU twin, a training step in both precisions, the recompute policies, the default run's
# first 50 steps) with their output shown, then the GPU benchmark.
#
#   scripts/gpu-check.sh            # tests, then the benchmark
#   scripts/gpu-check.sh --no-bench # tests only
#
# NVRTC and the CUDA headers come from a CUDA toolkit (CUDA_HOME, /usr/local/cuda) or, as
# in CI, from the pip wheels nvidia-cuda-nvrtc==13.0.* and nvidia-cuda-runtime==13.0.*,
# installed into target/cuda-wheels when no toolkit is found. cuBLAS comes with the
# toolkit or the driver's CUDA libraries.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (rustup) first" >&2
  exit 1
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no NVIDIA GPU answers here (nvidia-smi): these checks need one" >&2
  exit 1
fi
nvidia-smi -L

toolkit="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
if [ ! -f "$toolkit/include/cuda_bf16.h" ] || ! compgen -G "$toolkit/lib64/libnvrtc.so*" >/dev/null; then
  wheels="$PWD/target/cuda-wheels"
  cu13="$wheels/nvidia/cu13"
  if [ ! -e "$cu13/lib/libnvrtc.so.13" ] || [ ! -f "$cu13/include/cuda_bf16.h" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$wheels" \
      'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'
  fi
  export LD_LIBRARY_PATH="$cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TRAINKIT_CUDA_INCLUDE="$cu13/include"
else
  export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export TRAINKIT_REQUIRE_NVRTC=1

echo "== CUDA tests (GPU and emulator)"
cargo test --release --test cuda_backend --test nvrtc_kernels -- --nocapture --test-threads=1
if [ "${1:-}" != "--no-bench" ]; then
  echo "== GPU benchmark (GPT-2 124M, seq 1024)"
  cargo run --release --example gpu_bench
fi
