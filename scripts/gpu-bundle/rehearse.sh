#!/usr/bin/env bash
# Rehearses the GPU bundle's run.sh on this machine, which has no GPU, in two ways:
#
# 1. As it is: the GPU steps are skipped with their reason and the run passes (exit 0).
# 2. With fake-gpu/ first on PATH (an nvidia-smi that reports an H100; a compute-sanitizer
#    and an ncu that run their program): run.sh takes every branch that only a GPU machine
#    takes. No step that needs the GPU may pass (each fails saying the GPU was not used, or
#    is skipped with its reason: no torch with CUDA, no nvcc), and no shell error may occur.
#
#   bash scripts/gpu-bundle.sh && bash scripts/gpu-bundle/rehearse.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="$here/../../target/gpu-bundle"
if [ ! -x "$bundle/run.sh" ]; then
  echo "no bundle at $bundle: build it first with bash scripts/gpu-bundle.sh" >&2
  exit 1
fi
phases=(tests bench attention kernels train decode reference llmc xl llama offload stream nccl sanitize ncu)
out="$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-rehearsal.XXXXXX")"
mkdir -p "$out/plain" "$out/pretend"  # run.sh writes into $OUT only when it is a directory
clean_env=(env -u TRAINKIT_REQUIRE_NVRTC -u TRAINKIT_REQUIRE_EMULATOR -u TRAINKIT_REQUIRE_CUBLASLT STEPS=3)
status=0

echo "== 1. no GPU: $out/plain.log"
if ! "${clean_env[@]}" OUT="$out/plain" bash "$bundle/run.sh" "${phases[@]}" >"$out/plain.log" 2>&1; then
  echo "FAIL: run.sh failed without a GPU (see $out/plain/report.txt)"
  status=1
fi

echo "== 2. a pretended GPU: $out/pretend.log"
# The nccl phase opens the NCCL of CI's wheels when there is one (no torch here brings it).
nccl_lib="$here/../../target/cuda-wheels/nccl/nvidia/nccl/lib/libnccl.so.2"
[ -e "$nccl_lib" ] && clean_env+=(TRAINKIT_NCCL="$(cd "$(dirname "$nccl_lib")" && pwd)/libnccl.so.2")
"${clean_env[@]}" PATH="$here/fake-gpu:$PATH" OUT="$out/pretend" \
  bash "$bundle/run.sh" "${phases[@]}" >"$out/pretend.log" 2>&1 || true
if grep -n -E 'unbound variable|syntax error|command not found|bad substitution|integer expression expected' \
  "$out/plain.log" "$out/pretend.log"; then
  echo "FAIL: shell errors above"
  status=1
fi

python3 - "$out/plain/report.json" "$out/pretend/report.json" <<'PY' || status=1
import json, sys
plain, pretend = (json.load(open(p)) for p in sys.argv[1:])
bad = []
if plain["failed"]:
    bad.append(f"without a GPU, {plain['failed']} step(s) failed")
# Steps that need no GPU (the unit tests, the NVRTC compile check, the host AdamW) may pass with a
# pretended one; every other must not.
no_gpu_needed = {"unit_tests", "nvrtc_kernels", "host_adamw"}
for s in pretend["steps"]:
    if s["name"] in no_gpu_needed:
        continue
    if s["status"] == "pass":
        bad.append(f"pretended GPU: `{s['name']}` passed without using a GPU")
    elif not s["note"]:
        bad.append(f"pretended GPU: `{s['name']}` is {s['status']} without a reason")
for b in bad:
    print("FAIL:", b)
print(f"no GPU: {plain['passed']} passed, {plain['failed']} failed, {plain['skipped']} skipped; "
      f"pretended GPU: {len(pretend['steps'])} steps, none passed without a GPU"
      if not bad else "")
sys.exit(1 if bad else 0)
PY
[ "$status" -eq 0 ] && echo "rehearsal passed (reports in $out)" || echo "rehearsal FAILED (reports in $out)"
exit "$status"
