#!/usr/bin/env bash
# trainkit's GPU verification bundle: runs on a machine with no Rust and no network.
# scripts/gpu-bundle.sh builds the bundle (target/gpu-bundle) and copies this script into
# it; the script finds everything else beside itself, so it runs from any directory:
#
#   bash target/gpu-bundle/run.sh                  # every phase, in order
#   bash target/gpu-bundle/run.sh tests bench      # some phases (in the order given)
#   bash target/gpu-bundle/run.sh tests sanitize   # the first call on a new GPU
#
# Phases:
#   tests      the library's own unit tests (the cuBLASLt descriptor check, the
#              library-loading order, ...), then the CUDA test binaries with output shown:
#              every kernel compiled by NVRTC,
#              every op against its CPU twin in both precisions, a training step, every
#              recompute policy, one host wait per step, out of memory beyond the device,
#              the default run's first 50 steps against the CPU
#   bench      the GPU benchmark (GPT-2 124M, seq 1024, FP32, mixed bf16 and mixed fp16),
#              then bf16 with the bias gradients in the cuBLASLt epilogue instead of
#              trainkit's own kernel, fp32 with TF32 products (--tf32), bf16 with and
#              without each product's algorithm timed, then bf16 with every kernel timed
#              by CUDA events (--kernels), then bf16 again with every op timed on the
#              device
#   kernels    LayerNorm and RMSNorm forward and backward and AdamW over GPT-2 124M's
#              parameters alone (kernel_bench), beside PyTorch's F.layer_norm, F.rms_norm
#              and fused AdamW (reference/norms_adamw.py): ms, GB/s, share of bandwidth
#   train      `trainkit train` on the bundle's token file (GPT-2 124M, bf16, batch 8)
#   reference  the PyTorch reference on the same token file and batch, eager then
#              torch.compile (needs python3 with torch and transformers)
#   llmc       llm.c's train_gpt2cu (when the bundle holds its source), built with nvcc
#              and run on the same token file and batch
#   xl         GPT-2 XL (1.5B), bf16: trainkit without recomputation and with full
#              recomputation, PyTorch eager and torch.compile without, eager with full
#   llama      a Llama 3.2 1B shape, bf16: trainkit, PyTorch eager and torch.compile, then
#              trainkit's kernels timed by CUDA events
#   offload    the optimizer on the host: the host's AdamW against its memory bandwidth
#              (host_adamw), the GPU's link to host memory, page-locked and pageable
#              (gpu_bench --host-link), then GPT-2 124M bf16 with and without
#              --optimizer-offload, after backward and inside it, and the offloaded step
#              op by op (the transfers' time over the host link)
#   stream     weights streamed from host memory: Llama 3.2 1B QLoRA and LoRA (rank 16 on
#              every projection, bf16, full recomputation, batch 2 × 2048), resident then
#              with --stream-weights, alternating; each streamed run prints what a step
#              copied and at what rate (the copy stream's bytes over the step's time)
#   nccl       data parallelism over NCCL (the machine's, from PyTorch's nvidia-nccl wheel
#              or $TRAINKIT_NCCL): a small model for 4 steps alone and as one NCCL rank
#              (--collective nccl), which must agree bit for bit (log and saved weights),
#              in f32 and bf16; then, with NCCL 2.30 or newer, two torchrun-style ranks on
#              the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) against one process accumulating
#              their two micro-batches apart, bit for bit, for DDP, ZeRO-1 and ZeRO-2,
#              updating after backward and (--grad-clip 0) inside it
#   sanitize   (only when named) compute-sanitizer over the CUDA op tests: memcheck (every
#              global access in bounds) on each op's parity test, racecheck (no shared-
#              memory race) on the fused attention's and the norms'
#   ncu        (only when named) Nsight Compute on one bf16 step of gpt2 124M: speed of
#              light, occupancy and launch statistics of trainkit's own kernels (the fused
#              attention, layer norm, GELU, cross-entropy, AdamW, ...), as CSV in logs/
#
# Every step's output is shown and kept in logs/; the report (report.txt, report.json:
# each step's name, command, status pass/fail/skipped, seconds and the figures read from
# its output) and every other file the run writes go to $OUT when it names a directory,
# else to a new temporary folder (mktemp -d), never beside the script; the steps run in
# that folder, and the run prints where it is at its start and its end. A failing step is
# recorded and the rest still run. Without a GPU the GPU steps are reported as skipped,
# with the reason. Exit status: 0 when no step failed, 1 otherwise.
#
# Settings (environment): STEPS (optimizer steps of the training runs, default 50),
# BATCH (rows of 1024 tokens, default 8), STEP_TIMEOUT (seconds a step may take before it
# is stopped and failed; default per step), TEST_THREADS (threads of the unit tests, default
# 2), TRAINKIT_CUDA_WHEELS (a pip --target folder
# holding nvidia/cu13 from the nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels), CUDA_HOME,
# PYTHON (the python with torch, default python3), NVRTC_CHECK (set: the tests phase
# compiles every kernel with NVRTC on a GPU machine too; without a GPU it always does).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
# PyTorch runs with the loader path it came with: the CUDA libraries found below for
# trainkit and llm.c go first on LD_LIBRARY_PATH, and could shadow the ones torch's
# wheels were built against.
orig_ld_path="${LD_LIBRARY_PATH:-}"
py() { LD_LIBRARY_PATH="$orig_ld_path" "$python" "$@"; }
steps="${STEPS:-50}"
batch="${BATCH:-8}"
seq=1024

all_phases=(tests bench attention kernels train decode reference llmc xl llama offload stream nccl)
# Run only when named: they cost device time and answer tuning questions, not pass/fail.
extra_phases=(sanitize ncu)
if [ "$#" -eq 0 ]; then
  phases=("${all_phases[@]}")
else
  phases=("$@")
  for p in "${phases[@]}"; do
    case " ${all_phases[*]} ${extra_phases[*]} " in
      *" $p "*) ;;
      *) echo "unknown phase '$p': use ${all_phases[*]} ${extra_phases[*]}" >&2; exit 2 ;;
    esac
  done
fi

# The paths given in the environment, made absolute: the steps run in the report folder.
absolute() {
  case "$1" in
    "" | /*) printf '%s' "$1" ;;
    *) if [ -d "$1" ]; then (cd "$1" && pwd); elif [ -e "$1" ]; then
         printf '%s/%s' "$(cd "$(dirname "$1")" && pwd)" "$(basename "$1")"
       else printf '%s' "$1"; fi ;;
  esac
}
[ -n "${CUDA_HOME:-}" ] && CUDA_HOME="$(absolute "$CUDA_HOME")"
[ -n "${CUDA_PATH:-}" ] && CUDA_PATH="$(absolute "$CUDA_PATH")"
[ -n "${TRAINKIT_CUDA_WHEELS:-}" ] && TRAINKIT_CUDA_WHEELS="$(absolute "$TRAINKIT_CUDA_WHEELS")"
[ -n "${TRAINKIT_CUDA_INCLUDE:-}" ] && TRAINKIT_CUDA_INCLUDE="$(absolute "$TRAINKIT_CUDA_INCLUDE")"
case "$python" in */*) python="$(absolute "$python")" ;; esac

# The report folder: $OUT when it is a directory, else a new temporary folder; never the
# bundle's folder or the current directory.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  report="$OUT"
else
  if [ -n "${OUT:-}" ]; then
    echo "note: OUT=$OUT is not a directory; the report goes to a new temporary folder" >&2
  fi
  report="$(mktemp -d "${TMPDIR:-/tmp}/trainkit-gpu-report.XXXXXX")"
fi
mkdir -p "$report/logs"
report="$(cd "$report" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/trainkit-gpu-bundle.XXXXXX")"
trap 'rm -rf "$work"' EXIT

say() { printf '%s\n' "$*"; }
section() { printf '\n==== %s\n' "$*"; }

# ---------------------------------------------------------------------------------------
# The report: one entry per step, in parallel arrays; written out after every step.
names=() commands=() statuses=() seconds=() figures=() notes=() logs=()

# record NAME COMMAND STATUS SECONDS FIGURES NOTE LOG: FIGURES is "key=value;key=value".
record() {
  names+=("$1") commands+=("$2") statuses+=("$3") seconds+=("$4") figures+=("$5")
  notes+=("$6") logs+=("$7")
  printf -- '---- %s: %s (%ss)%s\n' "$1" "$3" "$4" "${6:+: $6}"
  write_report
}

# amend_last STATUS NOTE: changes the last step's status (a test binary that passed
# without reaching the GPU it should have used fails; one that could only say why it
# skipped is skipped), and rewrites the report.
amend_last() {
  statuses[-1]="$1"
  notes[-1]="$2"
  printf -- '---- %s: %s: %s\n' "${names[-1]}" "$1" "$2"
  write_report
}

skip() { record "$1" "$2" skipped 0 "" "$3" ""; }

# run_step NAME TIMEOUT FIGURE_FUNCTION COMMAND...: runs COMMAND with its output shown and
# kept in logs/NAME.log, then records it; FIGURE_FUNCTION (or "-") reads the figures from
# the log. A step still running after TIMEOUT seconds (or $STEP_TIMEOUT) is stopped.
run_step() {
  local name="$1" limit="${STEP_TIMEOUT:-$2}" parse="$3"
  shift 3
  local log="$report/logs/$name.log" rc start end status note="" figs=""
  section "$name: $*"
  start=$(date +%s.%N)
  set +e
  timeout --kill-after=30 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  end=$(date +%s.%N)
  if [ "$rc" -eq 0 ]; then
    status=pass
  else
    status=fail
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      note="stopped after ${limit}s (STEP_TIMEOUT)"
    else
      note="exit status $rc"
    fi
  fi
  if [ "$parse" != "-" ]; then
    figs="$("$parse" "$log" | tr -d '\n' || true)"
  fi
  record "$name" "$*" "$status" "$(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}')" \
    "$figs" "$note" "logs/$name.log"
}

json_str() {
  # A JSON string: backslashes, quotes and control characters escaped.
  local s="$1"
  s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//$'\n'/\\n}"; s="${s//$'\t'/\\t}"; s="${s//$'\r'/}"
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\010\013\014\016-\037')"
}

# json_number VALUE: VALUE as a JSON number, or null when it is empty.
json_number() {
  if [ -n "$1" ]; then json_value "$1"; else printf null; fi
}

json_value() {
  if [[ "$1" =~ ^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then printf '%s' "$1"; else json_str "$1"; fi
}

# write_report: report.txt and report.json from the steps recorded so far (rewritten after
# every step, so that a run stopped from outside still leaves its report). Sets $failed.
# fig STEP KEY: the figure KEY of step STEP (nothing when the step or the figure is absent).
fig() {
  local i kv kvs
  for i in "${!names[@]}"; do
    [ "${names[$i]}" = "$1" ] || continue
    IFS=';' read -r -a kvs <<<"${figures[$i]}"
    for kv in "${kvs[@]}"; do
      if [ "${kv%%=*}" = "$2" ]; then printf '%s' "${kv#*=}"; return 0; fi
    done
  done
  return 0
}

# comparisons: one line per model, "label|trainkit tokens/s|references as name=tokens/s,...|
# ratio to the fastest reference", for the report (nothing for a model with no figures).
comparisons() {
  local label tk refs best ratio r value spec step key ref_steps
  for spec in "GPT-2 124M bf16|gpu_bench|bf16|pytorch_eager pytorch_compile llmc_train" \
    "GPT-2 XL bf16, no recompute|gpu_bench_gpt2_xl_none|bf16|pytorch_eager_gpt2_xl_none pytorch_compile_gpt2_xl_none" \
    "GPT-2 XL bf16, full recompute|gpu_bench_gpt2_xl_full|bf16|pytorch_eager_gpt2_xl_full" \
    "Llama 3.2 1B bf16|gpu_bench_llama_3_2_1b_none|bf16|pytorch_eager_llama_3_2_1b_none pytorch_compile_llama_3_2_1b_none"; do
    IFS='|' read -r label step key ref_steps <<<"$spec"
    tk="$(fig "$step" "${key}_tokens_per_s_median")"
    refs="" best=""
    for r in $ref_steps; do
      value="$(fig "$r" tokens_per_s_median)"
      [ -n "$value" ] || continue
      refs+="${refs:+,}$r=$value"
      if [ -z "$best" ] || awk -v a="$value" -v b="$best" 'BEGIN { exit !(a > b) }'; then
        best="$value"
      fi
    done
    [ -n "$tk" ] || [ -n "$refs" ] || continue
    ratio=""
    if [ -n "$tk" ] && [ -n "$best" ]; then
      ratio="$(awk -v a="$tk" -v b="$best" 'BEGIN { printf "%.3f", a / b }')"
    fi
    printf '%s|%s|%s|%s\n' "$label" "$tk" "$refs" "$ratio"
  done
}

write_report() {
  local passed=0 skipped=0 verdict s i p sep kv pairs now
  failed=0
  for s in "${statuses[@]}"; do
    case "$s" in
      pass) passed=$((passed + 1)) ;;
      fail) failed=$((failed + 1)) ;;
      *) skipped=$((skipped + 1)) ;;
    esac
  done
  verdict=PASS
  [ "$failed" -gt 0 ] && verdict=FAIL
  now="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

  {
    say "trainkit GPU bundle report, $now"
    sed '/^$/q' "$here/MANIFEST.txt" 2>/dev/null || true
    say "host: $(uname -n), $(nproc) cores; GPU: ${gpu:-none ($no_gpu)}"
    say "NVRTC: ${found[libnvrtc.so.13]:-not found}; cuBLAS: ${found[libcublas.so.13]:-not found};" \
      "cuBLASLt: ${found[libcublasLt.so.13]:-not found}"
    say "CUDA headers: ${header:-not found}; nvcc: ${nvcc:-not found}; $python_torch"
    say "phases: ${phases[*]}"
    say ""
    for i in "${!names[@]}"; do
      printf '%-28s %-8s %8ss  %s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${notes[$i]}"
      printf '    command: %s\n' "${commands[$i]}"
      if [ -n "${figures[$i]}" ]; then
        tr ';' '\n' <<<"${figures[$i]}" | sed '/^$/d; s/^/    /; s/=/: /'
      fi
    done
    local rows
    rows="$(comparisons)"
    if [ -n "$rows" ]; then
      say ""
      say "side by side (median tokens/s; trainkit from gpu_bench; target: at least 1.1x the fastest reference on GPT-2 124M):"
      while IFS='|' read -r label tk refs ratio; do
        say "  $label: trainkit ${tk:-none}; ${refs:-no reference}; trainkit / fastest reference: ${ratio:-n/a}"
      done <<<"$rows"
    fi
    say ""
    say "$verdict: $passed passed, $failed failed, $skipped skipped"
    if [ -n "$no_gpu" ]; then say "GPU checks skipped: $no_gpu"; fi
  } >"$report/report.txt"

  {
    printf '{\n  "verdict": %s,\n  "passed": %d,\n  "failed": %d,\n  "skipped": %d,\n' \
      "$(json_str "$verdict")" "$passed" "$failed" "$skipped"
    printf '  "date": %s,\n  "host": %s,\n  "gpu": %s,\n  "no_gpu_reason": %s,\n' \
      "$(json_str "$now")" "$(json_str "$(uname -n)")" "$(json_str "$gpu")" "$(json_str "$no_gpu")"
    printf '  "bundle": %s,\n' "$(json_str "$(sed '/^$/q' "$here/MANIFEST.txt" 2>/dev/null || true)")"
    printf '  "libraries": {"nvrtc": %s, "cublas": %s, "cublaslt": %s, ' \
      "$(json_str "${found[libnvrtc.so.13]}")" "$(json_str "${found[libcublas.so.13]}")" \
      "$(json_str "${found[libcublasLt.so.13]}")"
    printf '"cuda_include": %s, "nvcc": %s, "python": %s},\n' \
      "$(json_str "$header")" "$(json_str "$nvcc")" "$(json_str "$python_torch")"
    printf '  "phases": ['
    sep=""
    for p in "${phases[@]}"; do printf '%s%s' "$sep" "$(json_str "$p")"; sep=", "; done
    printf '],\n  "comparisons": ['
    sep=""
    while IFS='|' read -r label tk refs ratio; do
      [ -n "$label" ] || continue
      printf '%s\n    {"model": %s, "trainkit_tokens_per_s": %s, "references": %s, "ratio_to_fastest": %s}' \
        "$sep" "$(json_str "$label")" "$(json_number "$tk")" "$(json_str "$refs")" \
        "$(json_number "$ratio")"
      sep=","
    done <<<"$(comparisons)"
    printf '\n  ],\n  "steps": [\n'
    for i in "${!names[@]}"; do
      printf '    {"name": %s, "command": %s, "status": %s, ' "$(json_str "${names[$i]}")" \
        "$(json_str "${commands[$i]}")" "$(json_str "${statuses[$i]}")"
      printf '"seconds": %s, "note": %s, "log": %s, "figures": {' "${seconds[$i]}" \
        "$(json_str "${notes[$i]}")" "$(json_str "${logs[$i]}")"
      sep=""
      IFS=';' read -r -a pairs <<<"${figures[$i]}"
      for kv in "${pairs[@]}"; do
        [ -n "$kv" ] || continue
        printf '%s%s: %s' "$sep" "$(json_str "${kv%%=*}")" "$(json_value "${kv#*=}")"
        sep=", "
      done
      if [ "$i" -lt $((${#names[@]} - 1)) ]; then printf '}},\n'; else printf '}}\n'; fi
    done
    printf '  ]\n}\n'
  } >"$report/report.json"
}

# ---------------------------------------------------------------------------------------
# Figures read from the logs (each prints key=value;key=value).

figures_cargo_test() {
  # libtest's summary line and the lines saying what was skipped.
  awk '/^test result:/ {
         for (i = 1; i <= NF; i++) {
           if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i
         }
       }
       /SKIPPED|skipped:/ { s++ }
       END { printf "passed=%d;failed=%d;lines_saying_skipped=%d", p, f, s }' "$1"
  local found
  found="$(grep -m1 -o -E 'GPU checks run on .*|NVRTC [0-9]+\.[0-9]+, headers from .*' "$1" || true)"
  [ -n "$found" ] && printf ';found=%s' "$(tr ';=' ',:' <<<"$found")"
  return 0
}

figures_gpu_bench() {
  # "bf16 mixed: gpt2, batch 8 × 1024, recompute none: median N tokens/s, best N tokens/s;
  # ledger peak X, pool peak Y; K of the timed steps skipped, loss scale S; model T TFLOP/s,
  # MFU P%"
  local pattern='^(fp32[^:]*|bf16 mixed|fp16 mixed): .*median ([0-9]+) tokens/s, best ([0-9]+) tokens/s;'
  pattern+=' ledger peak ([^,]+), pool peak ([^;]+)(;.*)?$'
  sed -n -E "s#$pattern#\\1|\\2|\\3|\\4|\\5|\\6#p" "$1" |
    while IFS='|' read -r what median best ledger pool rest; do
      key="$(tr -c 'a-z0-9\n' '_' <<<"${what%% *}")"
      printf '%s_tokens_per_s_median=%s;%s_tokens_per_s_best=%s;%s_ledger_peak=%s;%s_pool_peak=%s;' \
        "$key" "$median" "$key" "$best" "$key" "$ledger" "$key" "$pool"
      tflops="$(sed -n -E 's#.*model ([0-9.]+) TFLOP/s.*#\1#p' <<<"$rest")"
      mfu="$(sed -n -E 's#.*MFU ([0-9.]+)%.*#\1#p' <<<"$rest")"
      [ -n "$tflops" ] && printf '%s_model_tflops=%s;' "$key" "$tflops"
      [ -n "$mfu" ] && printf '%s_mfu_percent=%s;' "$key" "$mfu"
    done
  # "bf16 mixed: host waits per step 1 (most), uploads per step 5.0, upload ring 4.0 MiB"
  pattern='^(fp32[^:]*|bf16 mixed|fp16 mixed): host waits per step ([0-9]+) \(most\), uploads per step ([0-9.]+), upload ring (.*)$'
  sed -n -E "s#$pattern#\\1|\\2|\\3|\\4#p" "$1" |
    while IFS='|' read -r what waits uploads ring; do
      key="$(tr -c 'a-z0-9\n' '_' <<<"${what%% *}")"
      printf '%s_host_waits_per_step=%s;%s_uploads_per_step=%s;%s_upload_ring=%s;' \
        "$key" "$waits" "$key" "$uploads" "$key" "$ring"
    done
  # "products: 14 shapes, 12 timed, 0 saved by an earlier run, 2 untimed; 5 run another
  # algorithm than the heuristic's first"
  pattern='^products: ([0-9]+) shapes, ([0-9]+) timed, ([0-9]+) saved by an earlier run, ([0-9]+) untimed; ([0-9]+) run .*$'
  sed -n -E "s#$pattern#products_shapes=\1;products_timed=\2;products_saved=\3;products_untimed=\4;products_not_first=\5;#p" "$1" |
    head -n1
  # "libraries: NVIDIA H100 80GB HBM3 (sm_90; NVRTC 13.0 /…/libnvrtc.so.13, …)"
  local libs
  libs="$(sed -n -E 's#^libraries: (.*)$#\1#p' "$1" | head -n1)"
  [ -n "$libs" ] && printf 'libraries=%s;' "$(tr ';=' ',:' <<<"$libs")"
  return 0
}

figures_gpu_ops() {
  # "    flash_attention_backward      12.3%     45.6 ms     36 calls   123456.7 GFLOP/s": the
  # ten ops that took the most device time, as op_<name>_pct and op_<name>_gflops.
  sed -n -E 's#^    ([a-z0-9_]+) +([0-9.]+)% +([0-9.]+) ms +([0-9]+) calls +([0-9.]+) GFLOP/s$#\1|\2|\5#p' "$1" |
    head -n 10 |
    while IFS='|' read -r op pct gflops; do
      printf 'op_%s_pct=%s;op_%s_gflops=%s;' "$op" "$pct" "$op" "$gflops"
    done
  return 0
}

figures_gpu_kernels() {
  # "bf16 mixed: kernels, device time per step 33.10 ms of 35.20 ms wall (61 kinds)", then
  # rows "NAME   ms/step  calls/step  us/call  share%": the device time per step, and the
  # twelve kernels that took the most, as kernel_<name>_ms and kernel_<name>_us_per_call.
  sed -n -E 's#^[^:]+: kernels, device time per step ([0-9.]+) ms of ([0-9.]+) ms wall.*#kernels_ms_per_step=\1;wall_ms_per_step=\2;#p' "$1"
  sed -n -E 's#^(.*[^ ]) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)%$#\1|\2|\4#p' "$1" |
    grep -v '^kernel|' | head -n 12 |
    while IFS='|' read -r name ms us; do
      key="$(tr -c 'a-z0-9\n' '_' <<<"$(tr 'A-Z' 'a-z' <<<"$name")")"
      printf 'kernel_%s_ms=%s;kernel_%s_us_per_call=%s;' "$key" "$ms" "$key" "$us"
    done
  return 0
}

figures_host_adamw() {
  # "memory bandwidth: copy 26.7 GB/s ..., in place 34.1 GB/s ..." and "host AdamW: 988 M
  # params/s (median 970), 33.6 GB/s of state traffic ...".
  sed -n -E 's#^memory bandwidth: copy ([0-9.]+) GB/s.* in place ([0-9.]+) GB/s.*#copy_gbs=\1;in_place_gbs=\2;#p' "$1"
  sed -n -E 's#^host AdamW: ([0-9.]+) M params/s.*, ([0-9.]+) GB/s of state traffic.*#adamw_mparams_per_s=\1;adamw_gbs=\2;#p' "$1"
  return 0
}

figures_decode() {
  # sample's last line: `sampled N tokens after a prompt of P in S s: R tokens/s ...`.
  sed -n -E 's/^sampled ([0-9]+) tokens after a prompt of ([0-9]+) in .*: ([0-9.]+) tokens\/s.*/new_tokens=\1;prompt_tokens=\2;tokens_per_s=\3;/p' "$1" | tail -n1
  return 0
}

figures_trainkit_train() {
  # The --log-json file: the first and last steps' losses, the median tokens/s after the
  # first 3 steps.
  local json="$work/train-log.jsonl" m
  [ -s "$json" ] || return 0
  m="$(sed -n -E '4,$s/.*"tokens_per_s":([-0-9.eE+]+).*/\1/p' "$json" | median)"
  [ -n "$m" ] && printf 'tokens_per_s_median=%.0f;' "$m"
  sed -n -E '1s/.*"loss":([-0-9.eE+]+).*/loss_first=\1;/p; $s/.*"loss":([-0-9.eE+]+).*/loss_last=\1;/p' "$json"
  tail -n1 "$json" | sed -n -E 's/.*"step":([0-9]+).*/steps=\1;/p'
  # The highest peaks of any step: the ledger's, and the device pool's.
  sed -n -E 's/.*"memory_peak_total":([0-9]+).*/\1/p' "$json" | sort -n | tail -n1 |
    sed 's/^/ledger_peak_bytes=/; s/$/;/'
  sed -n -E 's/.*"pool_reserved_peak":([0-9]+).*/\1/p' "$json" | sort -n | tail -n1 |
    sed 's/^/pool_peak_bytes=/; s/$/;/'
  return 0
}

figures_pytorch() {
  # The RESULT line's JSON, flattened (numbers and short strings only).
  local line
  line="$(grep -m1 '^RESULT ' "$1" | cut -c8- || true)"
  [ -n "$line" ] || return 0
  python3 - "$line" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
keys = ["tokens_per_s_median", "tokens_per_s_best", "ms_per_step_median",
        "peak_allocated_bytes", "peak_reserved_bytes", "loss_first", "loss_last", "steps",
        "first_step_s", "attention", "torch"]
out = []
for k in keys:
    if k in r:
        v = r[k]
        v = f"{v:.6g}" if isinstance(v, float) else str(v)
        out.append(k + "=" + v.replace(";", ",").replace("=", ":"))
print(";".join(out))
EOF
}

figures_llmc() {
  # llm.c's step lines: "step   50/50 | loss 7.1 (+0.00z)| norm ... | 123.45 ms | 45.6% bf16 MFU | 98765 tok/s"
  local lines="$work/llmc-steps" m
  grep -E '^step +[0-9]+/[0-9]+ \| loss' "$1" >"$lines" || return 0
  awk 'NR == 1 { printf "loss_first=%s;", $5 } END { printf "steps=%d;loss_last=%s;", NR, $5 }' "$lines"
  awk '{ for (i = 2; i <= NF; i++) if ($i == "tok/s") t = $(i-1) } END { printf "tokens_per_s_ema=%s;", t }' "$lines"
  m="$(awk 'NR > 3 { for (i = 2; i <= NF; i++) if ($i == "ms") print $(i-1) }' "$lines" | median)"
  if [ -n "$m" ]; then
    printf 'ms_per_step_median=%s;tokens_per_s_median=%.0f;' "$m" \
      "$(awk -v ms="$m" -v n="$((batch * seq))" 'BEGIN { print n / (ms / 1000) }')"
  fi
  return 0
}

# median: the median of the numbers on standard input (nothing when there are none).
median() {
  sort -g | awk '{ a[NR] = $1 } END { if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}

# ---------------------------------------------------------------------------------------
# The machine: the GPU, and where NVRTC, cuBLAS and the CUDA headers are.

section "bundle"
sed '/^$/q' "$here/MANIFEST.txt" 2>/dev/null || say "(no MANIFEST.txt)"
say "report folder: $report"
libc="$(ldd --version 2>&1 | head -n1 || true)"
say "this machine: $(uname -sm), ${libc:-glibc unknown}"

section "GPU"
gpu="" peak_tflops=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$work/gpus" 2>&1 && grep -q '^GPU ' "$work/gpus"; then
  gpu="$(head -n1 "$work/gpus")"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
  no_gpu=""
  # Dense bf16 peak for the MFU figures: H100 SXM (80GB HBM3) and H200 989 TFLOP/s, H100
  # PCIe 756, A100 312; otherwise none (tokens/s and model TFLOP/s only). PEAK_TFLOPS sets it.
  case "$gpu" in
    *H200*|*"H100 80GB HBM3"*|*"H100 SXM"*) peak_tflops=989 ;;
    *"H100 PCIe"*) peak_tflops=756 ;;
    *A100*) peak_tflops=312 ;;
    *) peak_tflops="" ;;
  esac
  peak_tflops="${PEAK_TFLOPS:-$peak_tflops}"
  say "bf16 dense peak for MFU: ${peak_tflops:-unknown} TFLOP/s"
else
  if command -v nvidia-smi >/dev/null 2>&1; then
    no_gpu="no NVIDIA GPU answers here (nvidia-smi: $(head -c 200 "$work/gpus" | tr '\n' ' '))"
  else
    no_gpu="no NVIDIA GPU answers here (nvidia-smi not found)"
  fi
  say "$no_gpu"
fi

section "CUDA libraries"
# Each library from the first place that has it: the toolkit (CUDA_HOME, CUDA_PATH,
# /usr/local/cuda, /usr/local/cuda-13*), then pip wheels (TRAINKIT_CUDA_WHEELS,
# target/cuda-wheels beside the bundle, python3's site-packages: nvidia/cu13 and
# nvidia/*). Only CUDA 13 libraries (.so.13) fit trainkit's bindings.
lib_dirs=() inc_dirs=()
mapfile -t versioned < <(printf '%s\n' /usr/local/cuda-13* | sort -rV)
for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda "${versioned[@]}"; do
  if [ -z "$root" ] || [ ! -d "$root" ]; then continue; fi
  lib_dirs+=("$root/lib64" "$root/targets/x86_64-linux/lib" "$root/lib")
  inc_dirs+=("$root/include" "$root/targets/x86_64-linux/include")
done
wheel_roots=()
[ -n "${TRAINKIT_CUDA_WHEELS:-}" ] && wheel_roots+=("$TRAINKIT_CUDA_WHEELS")
[ -d "$here/../cuda-wheels" ] && wheel_roots+=("$(cd "$here/../cuda-wheels" && pwd)")
if command -v "$python" >/dev/null 2>&1; then
  while IFS= read -r site; do
    [ -n "$site" ] && [ -d "$site" ] && wheel_roots+=("$site")
  done < <(py -c 'import site
print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)
fi
for w in "${wheel_roots[@]}"; do
  lib_dirs+=("$w/nvidia/cu13/lib")
  inc_dirs+=("$w/nvidia/cu13/include")
  for d in "$w"/nvidia/*/lib; do lib_dirs+=("$d"); done
  for d in "$w"/nvidia/*/include; do inc_dirs+=("$d"); done
done

# Each existing directory once, in order.
dedupe() { awk '!seen[$0]++'; }
existing() { while IFS= read -r d; do if [ -d "$d" ]; then printf '%s\n' "$d"; fi; done; }
mapfile -t lib_dirs < <(printf '%s\n' "${lib_dirs[@]}" | existing | dedupe)
mapfile -t inc_dirs < <(printf '%s\n' "${inc_dirs[@]}" | existing | dedupe)

# find_lib PATTERN: the first lib dir holding a file matching PATTERN (prints "dir file").
find_lib() {
  local d f
  for d in "${lib_dirs[@]}"; do
    for f in "$d"/$1; do
      [ -e "$f" ] && { printf '%s %s\n' "$d" "$f"; return 0; }
    done
  done
  return 1
}

found_dirs=()
declare -A found=()
for lib in libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
  if hit="$(find_lib "$lib*")"; then
    found[$lib]="${hit#* }"
    found_dirs+=("${hit%% *}")
    say "$lib: ${hit#* }"
  else
    found[$lib]=""
    say "$lib: NOT FOUND (looked in: ${lib_dirs[*]:-nothing})"
  fi
done
header=""
for d in "${TRAINKIT_CUDA_INCLUDE:-}" "${inc_dirs[@]}"; do
  if [ -n "$d" ] && [ -f "$d/cuda_bf16.h" ]; then header="$d"; break; fi
done
if [ -n "$header" ]; then
  say "cuda_bf16.h: $header"
  export TRAINKIT_CUDA_INCLUDE="$header"
else
  say "cuda_bf16.h: NOT FOUND (looked in: ${inc_dirs[*]:-nothing})"
fi
# The CUDA driver library comes with the driver, from the loader's usual places; where it
# is only informs (the loader finds it without ldconfig). ldconfig is often in /sbin, which
# a user's PATH may lack.
ldconfig_bin="$(command -v ldconfig 2>/dev/null || true)"
for l in /sbin/ldconfig /usr/sbin/ldconfig; do
  if [ -z "$ldconfig_bin" ] && [ -x "$l" ]; then ldconfig_bin="$l"; fi
done
if [ -n "$ldconfig_bin" ]; then
  driver_lib="$("$ldconfig_bin" -p 2>/dev/null | awk '!f && /libcuda\.so\.1 / { print $NF; f = 1 }' || true)"
  say "libcuda.so.1 (driver): ${driver_lib:-not in the loader cache}"
else
  driver_lib=""
  say "libcuda.so.1 (driver): not looked up (no ldconfig on PATH, in /sbin or /usr/sbin)"
fi
path=""
for d in "${found_dirs[@]}"; do
  case ":$path:" in *":$d:"*) ;; *) path="${path:+$path:}$d" ;; esac
done
if [ -n "$path" ]; then
  export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
say "TRAINKIT_CUDA_INCLUDE=${TRAINKIT_CUDA_INCLUDE:-}"
nvcc=""
for n in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc $(command -v nvcc 2>/dev/null || true); do
  if [ -n "$n" ] && [ -x "$n" ]; then nvcc="$n"; break; fi
done
say "nvcc: ${nvcc:-not found}${nvcc:+ ($("$nvcc" --version | grep -o 'release [0-9.]*' | head -n1))}"
python_torch="$(py -c 'import torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available:",
      f"{torch.cuda.is_available()}), transformers {transformers.__version__}")' 2>&1 |
  tail -n1 || true)"
say "$python: $(py --version 2>&1 || echo missing); $python_torch"
cxx_found="$(command -v "${CXX:-c++}" 2>/dev/null || true)"
say "C++ compiler for the CUDA emulator: ${cxx_found:-none (the emulator checks are skipped)}"

# A cache of compiled kernels of this run's own, so every run compiles them afresh.
export TRAINKIT_CACHE_DIR="$work/kernel-cache"
export TRAINKIT_EMU_DIR="$work/emu"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The binaries travel gzipped (the bundle must fit what one call carries): unpacked into
# this run's own folder.
bin="$work/bin"
mkdir -p "$bin"
for f in "$here"/bin/*; do
  case "$f" in
    *.gz) gzip -dc "$f" >"$bin/$(basename "$f" .gz)" && chmod +x "$bin/$(basename "$f" .gz)" ;;
    *) ln -sf "$f" "$bin/$(basename "$f")" ;;
  esac
done
data="$here/data/tinyshakespeare.bin"
val="$here/data/tinyshakespeare_val.bin"

# ---------------------------------------------------------------------------------------
phase_tests() {
  # The library's own unit tests; where cuBLASLt was found, its descriptor check must run.
  if [ -n "${found[libcublasLt.so.13]}" ]; then
    TRAINKIT_REQUIRE_CUBLASLT=1 run_step unit_tests 420 figures_cargo_test "$bin/unit_tests" \
      --test-threads="${TEST_THREADS:-2}"
  else
    run_step unit_tests 420 figures_cargo_test "$bin/unit_tests" --test-threads="${TEST_THREADS:-2}"
  fi
  if [ -n "$gpu" ] && [ -z "${NVRTC_CHECK:-}" ]; then
    # Compiling every kernel for two architectures takes minutes of the device's time;
    # CI's test suite does it on every change, and the kernels a run uses compile (once,
    # into the kernel cache) as the GPU steps start.
    skip nvrtc_kernels "$bin/nvrtc_kernels --nocapture --test-threads=1" \
      "every kernel compiles for sm_90 and sm_80 in CI's test suite; NVRTC_CHECK=1 compiles them here too"
  elif [ -n "$header" ] && [ -n "${found[libnvrtc.so.13]}" ]; then
    # A kernel that does not compile fails, rather than skips.
    TRAINKIT_REQUIRE_NVRTC=1 run_step nvrtc_kernels 600 figures_cargo_test \
      "$bin/nvrtc_kernels" --nocapture --test-threads=1
  else
    # The binary says what it misses; without a GPU that is a skip, with one a failure.
    run_step nvrtc_kernels 600 figures_cargo_test "$bin/nvrtc_kernels" --nocapture --test-threads=1
    local why="NVRTC 13 or cuda_bf16.h not found (see \"CUDA libraries\" above)"
    if [ "${statuses[-1]}" = pass ]; then
      if [ -n "$gpu" ]; then amend_last fail "$why"; else amend_last skipped "$why"; fi
    fi
  fi
  local name=cuda_backend
  [ -z "$gpu" ] && name=cuda_backend_emulator_only
  run_step "$name" 480 figures_cargo_test "$bin/cuda_backend" --nocapture --test-threads=1
  if [ -n "$gpu" ] && grep -q 'GPU checks SKIPPED' "$report/logs/$name.log"; then
    local reason
    reason="$(grep -m1 -o 'GPU checks SKIPPED.*' "$report/logs/$name.log")"
    amend_last fail "a GPU is here, but the tests did not use it: $reason"
  fi
  if [ -n "$no_gpu" ]; then
    skip cuda_backend_gpu "$bin/cuda_backend --nocapture --test-threads=1" \
      "GPU checks skipped: $no_gpu (the run above covered the CPU emulator only)"
  fi
  # Kernels written outside trainkit (an op node and Lion's update): NVRTC at run time.
  name=custom_kernels
  [ -z "$gpu" ] && name=custom_kernels_emulator_only
  run_step "$name" 300 figures_cargo_test "$bin/custom_op" --nocapture --test-threads=1
  if [ -n "$gpu" ] && grep -q 'GPU checks SKIPPED' "$report/logs/$name.log"; then
    amend_last fail "a GPU is here, but the user-kernel tests did not use it"
  fi
  # A fused op written outside trainkit through the kernel door (examples/offset_norm):
  # its kernel file loaded by CudaBackend::load_kernels, bitwise against its CPU twin.
  name=downstream_fused_op
  [ -z "$gpu" ] && name=downstream_fused_op_emulator_only
  run_step "$name" 300 figures_cargo_test "$bin/offset_norm" --nocapture --test-threads=1
  if [ -n "$gpu" ] && grep -q 'GPU checks SKIPPED' "$report/logs/$name.log"; then
    amend_last fail "a GPU is here, but the downstream-op tests did not use it"
  fi
}

# gpu_bench_step NAME TIMEOUT FIGURE_FUNCTION ARGS...: gpu_bench with ARGS as step NAME.
# gpu_bench says it needs a GPU and exits 0 where none answers; here a GPU is, so that
# fails the step.
gpu_bench_step() {
  local name="$1" limit="$2" figures_fn="$3"
  shift 3
  run_step "$name" "$limit" "$figures_fn" "$bin/gpu_bench" "$@"
  if grep -q 'gpu_bench needs a GPU' "$report/logs/$name.log"; then
    amend_last fail "a GPU is here, but $(grep -m1 -o 'gpu_bench needs a GPU.*' "$report/logs/$name.log")"
  fi
}

phase_bench() {
  if [ -n "$no_gpu" ]; then
    skip gpu_bench "$bin/gpu_bench" "GPU checks skipped: $no_gpu"
    return 0
  fi
  gpu_bench_step gpu_bench 420 figures_gpu_bench --batch "$batch" \
    ${peak_tflops:+--peak-tflops "$peak_tflops"}
  # The bias gradients in the weight gradients' cuBLASLt epilogue instead of trainkit's own
  # kernel, to compare.
  gpu_bench_step gpu_bench_bias_grad_epilogue 300 figures_gpu_bench --batch "$batch" \
    --precision bf16 --bias-grad-epilogue ${peak_tflops:+--peak-tflops "$peak_tflops"}
  # fp32 with its products on TF32 tensor cores (`train --tf32`), beside the first run's
  # plain fp32.
  gpu_bench_step gpu_bench_fp32_tf32 300 figures_gpu_bench --batch "$batch" \
    --precision fp32 --tf32 --warmup 3 --steps 10
  # Each product's cuBLASLt algorithm chosen by timing (the default; the first run above
  # timed them and saved the choices in this run's cache) against the heuristic's first
  # choice untimed, alternating.
  local round
  for round in 1 2; do
    gpu_bench_step "gpu_bench_tuned_products_$round" 300 figures_gpu_bench --batch "$batch" \
      --precision bf16 --warmup 3 --steps 10 ${peak_tflops:+--peak-tflops "$peak_tflops"}
    gpu_bench_step "gpu_bench_untuned_products_$round" 300 figures_gpu_bench \
      --batch "$batch" --precision bf16 --warmup 3 --steps 10 --untuned-products \
      ${peak_tflops:+--peak-tflops "$peak_tflops"}
  done
  # Every kernel's own device time (CUDA events around each launch and product, queued
  # as in a plain run).
  gpu_bench_step gpu_bench_kernels 300 figures_gpu_kernels --batch "$batch" \
    --precision bf16 --kernels --warmup 2 --steps 5
  # Where the device's time goes, op by op (every op waits for the GPU: slower steps).
  gpu_bench_step gpu_bench_ops 300 figures_gpu_ops --batch "$batch" \
    --precision bf16 --ops --warmup 2 --steps 3
}

# The fused attention: its parity tests on the GPU (every kernel against the CPU, the
# tensor-core kernels' head sizes among them), then the attention alone at the models'
# shapes (GPT-2 124M, Llama 3.2 1B and 3.1 8B) on trainkit's tensor-core kernels in both
# tilings (wide, the default, and narrow) and its tiled kernels and on PyTorch's SDPA
# backends (JSON lines in the logs), then whole GPT-2 124M bf16 steps in each tiling,
# alternating, and the default run op by op.
phase_attention() {
  if [ -n "$no_gpu" ]; then
    skip attention_parity "$bin/cuda_backend flash_attention" "GPU checks skipped: $no_gpu"
    skip attention_bench "$bin/attention_bench" "GPU checks skipped: $no_gpu"
    skip attention_sdpa "$python reference/attention_sdpa.py" "GPU checks skipped: $no_gpu"
    return 0
  fi
  # On the GPU alone (the emulator's run of these is CI's).
  run_step attention_parity 300 figures_cargo_test env CXX=false "$bin/cuda_backend" \
    flash_attention document_masking --nocapture --test-threads=1
  if grep -q 'GPU checks SKIPPED' "$report/logs/attention_parity.log"; then
    amend_last fail "a GPU is here, but the attention tests did not use it"
  fi
  run_step attention_bench 300 - "$bin/attention_bench" --iters "${ATTENTION_ITERS:-10}" \
    --json "$report/logs/attention_bench.jsonl"
  if grep -q 'attention_bench needs a GPU' "$report/logs/attention_bench.log"; then
    amend_last fail "a GPU is here, but $(grep -m1 -o 'attention_bench needs a GPU.*' "$report/logs/attention_bench.log")"
  fi
  if py -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    run_step attention_sdpa 300 - env LD_LIBRARY_PATH="$orig_ld_path" "$python" \
      "$here/reference/attention_sdpa.py" --iters "${ATTENTION_ITERS:-10}" \
      --json "$report/logs/attention_sdpa.jsonl"
  else
    skip attention_sdpa "$python reference/attention_sdpa.py" \
      "$python with torch (CUDA available) is missing: $python_torch"
  fi
  local round
  for round in 1 2; do
    gpu_bench_step "gpu_bench_tensor_core_attention_$round" 300 figures_gpu_bench \
      --batch "$batch" --precision bf16 --warmup 3 --steps 10 \
      ${peak_tflops:+--peak-tflops "$peak_tflops"}
    gpu_bench_step "gpu_bench_narrow_attention_$round" 300 figures_gpu_bench \
      --batch "$batch" --precision bf16 --warmup 3 --steps 10 --narrow-attention \
      ${peak_tflops:+--peak-tflops "$peak_tflops"}
  done
  gpu_bench_step gpu_bench_tensor_core_attention_ops 300 figures_gpu_ops --batch "$batch" \
    --precision bf16 --ops --warmup 2 --steps 3
}

# The memory-bound kernels alone (LayerNorm and RMSNorm forward and backward, AdamW over
# GPT-2 124M's parameters) beside PyTorch's F.layer_norm, F.rms_norm and fused AdamW at the
# same shapes: milliseconds, GB/s and the share of the device's bandwidth (BANDWIDTH_GBS,
# else known from the GPU's name), JSON lines in the logs.
phase_kernels() {
  if [ -n "$no_gpu" ]; then
    skip kernel_bench "$bin/kernel_bench" "GPU checks skipped: $no_gpu"
    skip norms_adamw "$python reference/norms_adamw.py" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local bw="${BANDWIDTH_GBS:-}"
  if [ -z "$bw" ]; then
    case "$gpu" in
      *H200*) bw=4800 ;;
      *H100*PCIe*) bw=2000 ;;
      *H100*) bw=3350 ;;
      *A100*) bw=2039 ;;
      *) bw=3350 ;;
    esac
  fi
  run_step kernel_bench 300 - "$bin/kernel_bench" --iters "${ATTENTION_ITERS:-10}" \
    --bandwidth "$bw" --json "$report/logs/kernel_bench.jsonl"
  if grep -q 'kernel_bench needs a GPU' "$report/logs/kernel_bench.log"; then
    amend_last fail "a GPU is here, but $(grep -m1 -o 'kernel_bench needs a GPU.*' "$report/logs/kernel_bench.log")"
  fi
  if py -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    run_step norms_adamw 300 - env LD_LIBRARY_PATH="$orig_ld_path" "$python" \
      "$here/reference/norms_adamw.py" --iters "${ATTENTION_ITERS:-10}" --bandwidth "$bw" \
      --json "$report/logs/norms_adamw.jsonl"
  else
    skip norms_adamw "$python reference/norms_adamw.py" \
      "$python with torch (CUDA available) is missing: $python_torch"
  fi
}

phase_train() {
  if [ -n "$no_gpu" ]; then
    skip trainkit_train_gpu "$bin/trainkit train --device cuda ..." "GPU checks skipped: $no_gpu"
    # The binary and the token file, on the CPU: two steps of a small model.
    run_step trainkit_train_cpu_smoke 300 - "$bin/trainkit" train --data "$data" \
      --vocab-size 50257 --n-layer 2 --n-head 2 --n-embd 64 --batch-size 2 --seq-len 64 \
      --steps 2 --device cpu
    return 0
  fi
  # The reference runs' settings: GPT-2 124M from scratch, batch × 1024 tokens a step, bf16,
  # no recomputation, AdamW lr 6e-4 constant, weight decay 0.1, clipping at 1.0.
  rm -f "$work/train-log.jsonl"
  run_step trainkit_train_gpu 420 figures_trainkit_train "$bin/trainkit" train \
    --config "$here/gpt2-124m.toml" --data "$data" --steps "$steps" --batch-size "$batch" \
    --seq-len "$seq" --grad-accum 1 --recompute none --precision bf16 \
    --lr-schedule constant --warmup-steps 0 --eval-every 0 --save-every 0 \
    --device cuda --log-json "$work/train-log.jsonl" \
    ${peak_tflops:+--peak-tflops "$peak_tflops"}
  cp "$work/train-log.jsonl" "$report/logs/trainkit_train_gpu.jsonl" 2>/dev/null || true
}

# Sampling through the key/value cache against rerunning the whole context (--no-cache):
# GPT-2 124M as initialised, greedy, a prompt of about 400 tokens; the tokens/s of each.
phase_decode() {
  if [ -n "$no_gpu" ]; then
    skip trainkit_decode "$bin/trainkit sample --device cuda ..." "GPU checks skipped: $no_gpu"
    return 0
  fi
  local model="$work/decode-gpt2" prompt
  prompt="$(for _ in $(seq 40); do printf 'the quick brown fox jumps over the lazy dog. '; done)"
  run_step trainkit_decode_init 300 - "$bin/trainkit" train --model gpt2 --steps 0 \
    --device cuda --out "$model"
  run_step trainkit_decode_cached 300 figures_decode "$bin/trainkit" sample --model "$model" \
    --tokenizer gpt2 --prompt "$prompt" --max-new-tokens 256 --temperature 0 --device cuda
  run_step trainkit_decode_uncached 300 figures_decode "$bin/trainkit" sample \
    --model "$model" --tokenizer gpt2 --prompt "$prompt" --max-new-tokens 64 \
    --temperature 0 --device cuda --no-cache
}

phase_reference() {
  local script="$here/reference/pytorch_gpt2.py" why=""
  if [ -n "$no_gpu" ]; then
    why="GPU checks skipped: $no_gpu"
  elif ! py -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    why="$python with torch (CUDA available) and transformers is missing: $python_torch"
  fi
  for mode in eager compile; do
    if [ -n "$why" ]; then
      skip "pytorch_$mode" "$python $script --mode $mode" "$why"
      continue
    fi
    run_step "pytorch_$mode" 480 figures_pytorch env LD_LIBRARY_PATH="$orig_ld_path" \
      "$python" "$script" --data "$data" \
      --mode "$mode" --batch "$batch" --seq "$seq" --steps "$steps" \
      --json "$report/logs/pytorch_$mode.json"
  done
}

phase_llmc() {
  local src="$here/llmc" why=""
  if [ ! -f "$src/train_gpt2.cu" ]; then
    why="the bundle holds no llm.c source (scripts/gpu-bundle.sh copies it from third_party/llm.c)"
  elif [ -n "$no_gpu" ]; then
    why="GPU checks skipped: $no_gpu"
  elif [ -z "$nvcc" ]; then
    why="nvcc not found (CUDA_HOME, /usr/local/cuda/bin, PATH)"
  fi
  if [ -n "$why" ]; then
    skip llmc_build "nvcc ... train_gpt2.cu -o train_gpt2cu" "$why"
    skip llmc_train "train_gpt2cu -i $data -j $val -e d12 ..." "$why"
    return 0
  fi
  # Built in a copy of its own, with two adaptations made to that copy: CUDA 13 takes a
  # cudaMemLocation where CUDA 12 took a device id in cudaMemAdvise (llm.c's fallback to
  # managed memory), so that call is adapted for CUDA 13 compilers; and NVML, which llm.c
  # uses only to print GPU telemetry, is left out, so that its header and library don't
  # matter. The flags are llm.c's Makefile's for a bf16 build without cuDNN, MPI or NCCL.
  local build="$work/llmc" cc major
  cp -r "$src" "$build"
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')"
  major="$("$nvcc" --version | sed -n -E 's/.*release ([0-9]+)\..*/\1/p' | head -n1)"
  if [ "${major:-0}" -ge 13 ]; then
    local call='cudaMemAdvise(\*out, bytes, cudaMemAdviseSetPreferredLocation'
    sed -i "s/$call, cudaCpuDeviceId)/$call, cudaMemLocation{cudaMemLocationTypeHost, 0})/" \
      "$build/llmc/cuda_utils.cuh"
    grep -q 'cudaMemLocationTypeHost' "$build/llmc/cuda_utils.cuh" ||
      say "note: llm.c's cudaMemAdvise call was not found to adapt for CUDA $major"
  fi
  sed -i 's/^#if __has_include(<nvml.h>)$/#if 0 \/\/ NVML left out by run.sh/' "$build/llmc/mfu.h"
  run_step llmc_build 420 - "$nvcc" --threads=0 -t=0 --use_fast_math -std=c++17 -O3 \
    "--generate-code=arch=compute_$cc,code=[compute_$cc,sm_$cc]" -DENABLE_BF16 \
    "$build/train_gpt2.cu" -I"$build" -lcublas -lcublasLt -o "$build/train_gpt2cu"
  if [ "${statuses[-1]}" != pass ]; then
    skip llmc_train "train_gpt2cu ..." "the build failed"
    return 0
  fi
  # GPT-2 124M from scratch (-e d12), batch × 1024 tokens a step, lr 6e-4 constant, weight
  # decay 0.1, no sampling; validation only at the first and last step.
  run_step llmc_train 300 figures_llmc "$build/train_gpt2cu" -i "$data" -j "$val" \
    -e d12 -b "$batch" -t "$seq" -d "$((batch * seq))" -x "$steps" -l 0.0006 -u 0 -q 1.0 \
    -c 0.1 -v 1000 -m 4 -s 0 -h 0 -y 0
}

# large_step MODEL RECOMPUTE MODES...: gpu_bench (bf16) on MODEL, then the PyTorch
# reference in each of MODES (eager, compile; none for trainkit alone), all on batch × 1024
# tokens a step. Step names end in the model and the recompute policy.
large_step() {
  local model="$1" recompute="$2" mode name
  shift 2
  name="$(tr -c 'a-z0-9\n' '_' <<<"$model")_$recompute"
  if [ -n "$no_gpu" ]; then
    skip "gpu_bench_$name" "$bin/gpu_bench --model $model" "GPU checks skipped: $no_gpu"
  else
    gpu_bench_step "gpu_bench_$name" 300 figures_gpu_bench --model "$model" \
      --precision bf16 --recompute "$recompute" --batch "$batch" --warmup 2 --steps 5 \
      ${peak_tflops:+--peak-tflops "$peak_tflops"}
  fi
  local script="$here/reference/pytorch_gpt2.py" why=""
  if [ -n "$no_gpu" ]; then
    why="GPU checks skipped: $no_gpu"
  elif ! py -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    why="$python with torch (CUDA available) and transformers is missing: $python_torch"
  fi
  for mode in "$@"; do
    if [ -n "$why" ]; then
      skip "pytorch_${mode}_$name" "$python $script --model $model --mode $mode" "$why"
      continue
    fi
    run_step "pytorch_${mode}_$name" 420 figures_pytorch env LD_LIBRARY_PATH="$orig_ld_path" \
      "$python" "$script" --data "$data" --model "$model" --recompute "$recompute" \
      --mode "$mode" --batch "$batch" --seq "$seq" --steps 10 --warmup 3 \
      --json "$report/logs/pytorch_${mode}_$name.json"
  done
}

phase_xl() {
  large_step gpt2-xl none eager compile
  large_step gpt2-xl full eager
}

phase_llama() {
  large_step llama-3.2-1b none eager compile
  if [ -z "$no_gpu" ]; then
    gpu_bench_step gpu_bench_llama_3_2_1b_kernels 300 figures_gpu_kernels \
      --model llama-3.2-1b --precision bf16 --batch "$batch" --kernels --warmup 2 --steps 3
  fi
}

phase_offload() {
  run_step host_adamw 300 figures_host_adamw "$bin/host_adamw"
  if [ -n "$no_gpu" ]; then
    skip gpu_bench_offload "$bin/gpu_bench --optimizer-offload" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local common=(--batch "$batch" --precision bf16 --warmup 2 --steps 5)
  gpu_bench_step gpu_bench_host_link 120 - --host-link
  gpu_bench_step gpu_bench_offload 300 figures_gpu_bench "${common[@]}" --optimizer-offload
  gpu_bench_step gpu_bench_in_backward 300 figures_gpu_bench "${common[@]}" \
    --optimizer-in-backward
  gpu_bench_step gpu_bench_offload_in_backward 300 figures_gpu_bench "${common[@]}" \
    --optimizer-in-backward --optimizer-offload
  gpu_bench_step gpu_bench_offload_ops 300 figures_gpu_ops --batch "$batch" \
    --precision bf16 --optimizer-offload --ops --warmup 1 --steps 2
}

phase_stream() {
  if [ -n "$no_gpu" ]; then
    skip gpu_bench_stream "$bin/gpu_bench --stream-weights" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local common=(--model llama-3.2-1b --batch 2 --seq 2048 --precision bf16 --recompute full
    --warmup 2 --steps 5)
  local adapter
  for adapter in qlora lora; do
    gpu_bench_step "gpu_bench_${adapter}_resident" 300 figures_gpu_bench "${common[@]}" \
      "--$adapter" 16
    gpu_bench_step "gpu_bench_${adapter}_streamed" 300 figures_gpu_bench "${common[@]}" \
      "--$adapter" 16 --stream-weights
    gpu_bench_step "gpu_bench_${adapter}_resident_again" 300 figures_gpu_bench "${common[@]}" \
      "--$adapter" 16
  done
}

# The NCCL library PyTorch's wheel brings (or $TRAINKIT_NCCL), and its version code.
find_nccl() {
  if [ -n "${TRAINKIT_NCCL:-}" ]; then
    printf '%s' "$TRAINKIT_NCCL"
    return 0
  fi
  py - <<'PY' 2>/dev/null || true
import glob, os, nvidia.nccl as n
for d in n.__path__:
    for f in glob.glob(os.path.join(d, "lib", "libnccl.so*")):
        print(f)
        raise SystemExit
PY
}

nccl_version() {
  py - "$1" <<'PY' 2>/dev/null || true
import ctypes, sys
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print(v.value)
PY
}

phase_nccl() {
  if [ -n "$no_gpu" ]; then
    skip nccl "$bin/trainkit train --collective nccl" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local lib version
  lib="$(find_nccl)"
  if [ -z "$lib" ]; then
    skip nccl "$bin/trainkit train --collective nccl" \
      "no NCCL: PyTorch's nvidia-nccl wheel is not installed and TRAINKIT_NCCL is unset"
    return 0
  fi
  version="$(nccl_version "$lib")"
  say "NCCL: $lib (version code ${version:-unknown})"
  export TRAINKIT_NCCL="$lib"
  local small=(--steps 4 --seq-len 64 --eval-every 0 --warmup-steps 1 --save-every 0
    --device cuda)
  local precision dir
  for precision in fp32 bf16; do
    dir="$work/nccl-$precision"
    rm -rf "$dir" && mkdir -p "$dir/alone" "$dir/nccl"
    run_step "nccl_${precision}_alone" 300 - "$bin/trainkit" train "${small[@]}" \
      --precision "$precision" --out "$dir/alone/model" --log-json "$dir/alone/log.jsonl"
    run_step "nccl_${precision}_one_rank" 300 - "$bin/trainkit" train "${small[@]}" \
      --precision "$precision" --collective nccl --out "$dir/nccl/model" \
      --log-json "$dir/nccl/log.jsonl"
    run_step "nccl_${precision}_world1_bitwise" 60 - env LD_LIBRARY_PATH="$orig_ld_path" \
      "$python" "$here/same_training.py" "$dir/alone" "$dir/nccl"
  done
  if [ -z "$version" ] || [ "$version" -lt 23000 ]; then
    skip nccl_two_ranks "two ranks on one GPU" \
      "NCCL ${version:-of unknown version} is older than 2.30: two ranks cannot share one GPU"
    return 0
  fi
  local zero
  dir="$work/nccl-ranks"
  rm -rf "$dir" && mkdir -p "$dir/one"
  run_step nccl_one_process_accumulating 300 - "$bin/trainkit" train "${small[@]}" \
    --precision fp32 --batch-size 2 --grad-accum 2 --separate-accumulation \
    --out "$dir/one/model" --log-json "$dir/one/log.jsonl"
  for zero in 0 1 2; do
    mkdir -p "$dir/zero$zero"
    run_step "nccl_two_ranks_zero$zero" 300 - env RANK_LOGS="$report/logs/nccl_ranks_zero$zero" \
      "$here/nccl-ranks.sh" 2 "$bin/trainkit" train \
      "${small[@]}" --precision fp32 --batch-size 2 --zero "$zero" \
      --out "$dir/zero$zero/model" --log-json "$dir/zero$zero/log.jsonl"
    run_step "nccl_two_ranks_zero${zero}_bitwise" 60 - env LD_LIBRARY_PATH="$orig_ld_path" \
      "$python" "$here/same_training.py" "$dir/one" "$dir/zero$zero"
  done
  # The update inside backward (no clipping): each bucket's gradients updated by their
  # owners as the next bucket is summed, against one process accumulating apart.
  mkdir -p "$dir/one-noclip"
  run_step nccl_one_process_accumulating_noclip 300 - "$bin/trainkit" train "${small[@]}" \
    --precision fp32 --batch-size 2 --grad-accum 2 --separate-accumulation --grad-clip 0 \
    --out "$dir/one-noclip/model" --log-json "$dir/one-noclip/log.jsonl"
  for zero in 0 1 2; do
    mkdir -p "$dir/inside$zero"
    run_step "nccl_two_ranks_inside_backward_zero$zero" 300 - \
      env RANK_LOGS="$report/logs/nccl_ranks_inside_zero$zero" \
      "$here/nccl-ranks.sh" 2 "$bin/trainkit" train \
      "${small[@]}" --precision fp32 --batch-size 2 --zero "$zero" --grad-clip 0 \
      --optimizer-in-backward --bucket-size 64KiB \
      --out "$dir/inside$zero/model" --log-json "$dir/inside$zero/log.jsonl"
    run_step "nccl_two_ranks_inside_backward_zero${zero}_bitwise" 60 - \
      env LD_LIBRARY_PATH="$orig_ld_path" \
      "$python" "$here/same_training.py" "$dir/one-noclip" "$dir/inside$zero" --norm-rtol 1e-5
  done
}

phase_sanitize() {
  if [ -n "$no_gpu" ]; then
    skip sanitize_memcheck "compute-sanitizer ... cuda_backend" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n1 || true)"
  if [ -z "$sanitizer" ]; then
    skip sanitize_memcheck "compute-sanitizer ... cuda_backend" "compute-sanitizer was not found"
    return 0
  fi
  # The op-by-op parity tests (small shapes; the training runs would take too long under
  # the tools). A report of any error fails the step.
  local ops=(matmul_matches_the_cpu_in_every_layout layernorm_and_gelu_match_the_cpu
    attention_matches_the_cpu flash_attention_matches_the_cpu
    cross_entropy_and_adamw_match_the_cpu adamw8bit_matches_the_cpu_bit_for_bit
    elementwise_ops_match_the_cpu bias_backward_and_embeddings_match_the_cpu
    weight_and_bias_gradients_match_the_cpu the_fused_bias_and_gelu_product_matches_the_cpu
    the_fused_loss_in_chunks_matches_the_cpu the_gradient_guard_matches_the_cpu
    llama_ops_match_the_cpu copy_rows_matches_the_cpu
    adamw_over_many_tensors_matches_the_cpu_bit_for_bit qk_norm_and_geglu_match_the_cpu
    lora_dropout_matches_the_cpu_bit_for_bit decoding_attention_matches_the_cpu_bit_for_bit)
  run_step sanitize_memcheck 540 figures_cargo_test "$sanitizer" --tool memcheck \
    --error-exitcode 99 --print-limit 20 "$bin/cuda_backend" --test-threads=1 --exact "${ops[@]}"
  used_the_gpu sanitize_memcheck
  run_step sanitize_racecheck 540 figures_cargo_test "$sanitizer" --tool racecheck \
    --error-exitcode 99 --print-limit 20 "$bin/cuda_backend" --test-threads=1 --exact \
    flash_attention_matches_the_cpu layernorm_and_gelu_match_the_cpu llama_ops_match_the_cpu \
    qk_norm_and_geglu_match_the_cpu decoding_attention_matches_the_cpu_bit_for_bit
  used_the_gpu sanitize_racecheck
}

# used_the_gpu NAME: fails step NAME (the last one) when its tests skipped the GPU.
used_the_gpu() {
  if grep -q 'GPU checks SKIPPED' "$report/logs/$1.log"; then
    amend_last fail "a GPU is here, but the tests did not use it: $(grep -m1 -o 'GPU checks SKIPPED.*' "$report/logs/$1.log")"
  fi
}

phase_ncu() {
  if [ -n "$no_gpu" ]; then
    skip ncu "ncu ... gpu_bench" "GPU checks skipped: $no_gpu"
    return 0
  fi
  local ncu
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n1 || true)"
  if [ -z "$ncu" ]; then
    skip ncu "ncu ... gpu_bench" "Nsight Compute (ncu) was not found"
    return 0
  fi
  # trainkit's own kernels (cuBLASLt's products are NVIDIA's): the first 120 launches
  # whose names match, from the first step's forward into its backward; the clocks are
  # left as the GPU sets them. NCU_LAUNCHES and NCU_KERNELS change the count and the names.
  run_step ncu 540 - "$ncu" --clock-control none --csv --page details \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    -k "regex:^(${NCU_KERNELS:-flash_attention|layernorm|gelu|cross_entropy|embedding|bias_backward|adamw})" \
    --launch-count "${NCU_LAUNCHES:-120}" \
    "$bin/gpu_bench" --batch "$batch" --precision bf16 --warmup 0 --steps 1
  if grep -q 'gpu_bench needs a GPU' "$report/logs/ncu.log"; then
    amend_last fail "a GPU is here, but $(grep -m1 -o 'gpu_bench needs a GPU.*' "$report/logs/ncu.log")"
  fi
}

# The steps run in the report folder, so that anything they write lands there.
cd "$report"
for p in "${phases[@]}"; do
  section "phase: $p"
  "phase_$p"
done

write_report
section "report ($report/report.txt, report.json)"
cat "$report/report.txt"
say "report written to $report (report.txt, report.json, logs/)"
[ "$failed" -eq 0 ]
