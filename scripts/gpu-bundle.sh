#!/usr/bin/env bash
# Builds trainkit's GPU verification bundle in target/gpu-bundle: everything the GPU
# checks need on a machine with an NVIDIA GPU but no Rust toolchain and no network.
#
#   scripts/gpu-bundle.sh            # build it (release), then print its size
#   bash target/gpu-bundle/run.sh    # run it, here or on the GPU machine (see run.sh)
#
# The bundle holds:
#   bin/            the library's own unit tests (unit_tests: the cuBLASLt descriptor check,
#                   the library-loading order, the emulator's fallbacks, ...), the CUDA
#                   test binaries (tests/nvrtc_kernels.rs, tests/cuda_backend.rs,
#                   tests/custom_op.rs: user kernels, an op node and Lion, on the GPU;
#                   tests/offset_norm.rs: a fused op of a downstream crate, loaded through
#                   CudaBackend::load_kernels),
#                   the GPU benchmark (examples/gpu_bench.rs) and the trainkit binary,
#                   release builds, stripped and gzipped (run.sh unpacks them); the
#                   kernels are embedded in them
#   data/           tinyshakespeare as GPT-2 tokens in llm.c's format (train and _val
#                   files), written by `trainkit prepare`
#   gpt2-124m.toml  the config of `trainkit train`'s GPT-2 124M run
#   reference/      the PyTorch reference (benches/reference/pytorch_gpt2.py)
#   llmc/           what llm.c's train_gpt2cu needs to build, when its source is in
#                   third_party/llm.c (git-ignored, never committed; LLMC_DIR overrides)
#   run.sh          the runner (scripts/gpu-bundle/run.sh)
#   nccl-ranks.sh, same_training.py
#                   the nccl phase's launcher of torchrun-style ranks and its check that
#                   two runs trained bit for bit the same
#   MANIFEST.txt    commit, toolchain, and every file with its size and SHA-256
#
# The text comes from ../shared/data/tinyshakespeare.txt (TEXT overrides). To rehearse
# here, NVRTC and the CUDA headers come from the pip wheels in target/cuda-wheels (as in
# .ci/run), installed when missing. The bundle must stay under 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

bundle="$root/target/gpu-bundle"
text="${TEXT:-$root/../shared/data/tinyshakespeare.txt}"
llmc="${LLMC_DIR:-$root/third_party/llm.c}"
limit=$((60 << 20))

for tool in cargo python3 strip; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "$tool is missing: the bundle is built with cargo, python3 (to read cargo's" \
      "JSON) and strip" >&2
    exit 1
  fi
done
if [ ! -f "$text" ]; then
  echo "no text at $text: set TEXT to a UTF-8 text file (tinyshakespeare)" >&2
  exit 1
fi

# executables JSON_FILE: the executables cargo's --message-format=json lines announce,
# one "target-name path" a line; the library's unit tests are named "unit_tests".
executables() {
  python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        name = "unit_tests" if "lib" in t["kind"] else t["name"]
        print(name, m["executable"])
EOF
}

echo "== building the release binaries (tests, benchmark, trainkit)"
messages="$(mktemp)"
trap 'rm -f "$messages"' EXIT
cargo test --release --locked --no-run --lib --test cuda_backend --test nvrtc_kernels \
  --test custom_op --test offset_norm \
  --message-format=json >"$messages"
cargo build --release --locked --bin trainkit --example gpu_bench --example host_adamw \
  --example attention_bench --example kernel_bench \
  --message-format=json >>"$messages"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/data" "$bundle/reference"
for name in unit_tests cuda_backend nvrtc_kernels custom_op offset_norm gpu_bench host_adamw \
  attention_bench kernel_bench \
  trainkit; do
  path="$(executables "$messages" | awk -v n="$name" '$1 == n { print $2 }' | tail -n1)"
  if [ -z "$path" ] || [ ! -x "$path" ]; then
    echo "cargo announced no executable for $name" >&2
    exit 1
  fi
  cp "$path" "$bundle/bin/$name"
  strip "$bundle/bin/$name"
done

echo "== token file (trainkit prepare, GPT-2 BPE, llm.c's format)"
"$bundle/bin/trainkit" prepare --text "$text" --out "$bundle/data/tinyshakespeare.bin"

# The newest glibc symbol the binaries need, for MANIFEST.txt; then gzipped, they take
# about a third of their size (run.sh unpacks them).
glibc="$(objdump -T "$bundle"/bin/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n1)"
for f in "$bundle"/bin/*; do
  gzip -9 -n "$f"
done

cp examples/configs/gpt2-124m.toml "$bundle/gpt2-124m.toml"
cp benches/reference/pytorch_gpt2.py benches/reference/attention_sdpa.py \
  benches/reference/norms_adamw.py "$bundle/reference/"
cp scripts/gpu-bundle/run.sh "$bundle/run.sh"
cp scripts/gpu-bundle/nccl-ranks.sh scripts/gpu-bundle/same_training.py "$bundle/"
chmod +x "$bundle/run.sh" "$bundle/nccl-ranks.sh"

if [ -f "$llmc/train_gpt2.cu" ] && [ -d "$llmc/llmc" ]; then
  echo "== llm.c source from $llmc (train_gpt2.cu, llmc/, LICENSE)"
  mkdir -p "$bundle/llmc"
  cp "$llmc/train_gpt2.cu" "$bundle/llmc/"
  cp -r "$llmc/llmc" "$bundle/llmc/llmc"
  [ -f "$llmc/LICENSE" ] && cp "$llmc/LICENSE" "$bundle/llmc/"
  if git -C "$llmc" rev-parse HEAD >/dev/null 2>&1; then
    git -C "$llmc" rev-parse HEAD >"$bundle/llmc/COMMIT"
  fi
else
  echo "== no llm.c source in $llmc: the bundle's llmc phase will say skipped"
fi

echo "== MANIFEST.txt"
{
  commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'of no known commit')"
  if git rev-parse HEAD >/dev/null 2>&1 && ! git diff --quiet HEAD -- . 2>/dev/null; then
    commit="$commit (with uncommitted changes)"
  fi
  echo "trainkit $commit, bundle built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "$(rustc --version), $(uname -sm); the binaries need glibc ${glibc#GLIBC_} or newer"
  echo "token file: $(basename "$text") -> data/tinyshakespeare.bin, data/tinyshakespeare_val.bin"
  if [ -f "$bundle/llmc/COMMIT" ]; then
    echo "llm.c: $(cat "$bundle/llmc/COMMIT")"
  else
    echo "llm.c: not included"
  fi
  echo
  (cd "$bundle" && find . -type f ! -name MANIFEST.txt | sort | while read -r f; do
    printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "${f#./}"
  done)
} >"$bundle/MANIFEST.txt"

# NVRTC and the headers from the pip wheels, so that run.sh can compile the kernels here.
wheels="$root/target/cuda-wheels"
cu13="$wheels/nvidia/cu13"
if [ ! -e "$cu13/lib/libnvrtc.so.13" ] || [ ! -f "$cu13/include/cuda_bf16.h" ]; then
  echo "== NVRTC 13.0 and the CUDA headers (pip wheels) into $wheels, for a rehearsal here"
  if ! python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$wheels" \
    'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'; then
    echo "(the wheels could not be installed: run.sh will say NVRTC was not found)"
  fi
fi

size="$(du -sb "$bundle" | cut -f1)"
files="$(find "$bundle" -type f | wc -l)"
echo "== $bundle: $(numfmt --to=iec-i --suffix=B "$size") ($size bytes) in $files files"
du -sh "$bundle"/* | sort -h
if [ "$size" -gt "$limit" ]; then
  echo "the bundle is over 60 MiB: too large to carry to the GPU machine" >&2
  exit 1
fi
echo "run it with: bash target/gpu-bundle/run.sh   (OUT=DIR for the report's folder)"
