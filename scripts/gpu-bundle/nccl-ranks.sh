#!/usr/bin/env bash
# nccl-ranks.sh N COMMAND...: runs COMMAND as N torchrun-style ranks on this machine's
# first GPU (RANK, WORLD_SIZE, LOCAL_RANK 0, MASTER_ADDR/PORT; NCCL 2.30's
# NCCL_MULTI_RANK_GPU_ENABLE=1 lets them share it), rank 0's output shown, each rank's
# kept in $RANK_LOGS/rank-R.log (the current directory by default); fails when any rank
# fails, and ends the others when one does.
set -uo pipefail
n="$1"
shift
export WORLD_SIZE="$n" LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
export MASTER_PORT="${MASTER_PORT:-$((29500 + RANDOM % 1000))}"
export NCCL_MULTI_RANK_GPU_ENABLE=1
logs="${RANK_LOGS:-.}"
mkdir -p "$logs"
pids=()
for r in $(seq 1 $((n - 1))); do
  RANK="$r" "$@" >"$logs/rank-$r.log" 2>&1 &
  pids+=("$!")
done
RANK=0 "$@" 2>&1 | tee "$logs/rank-0.log"
status=${PIPESTATUS[0]}
for p in "${pids[@]}"; do
  if [ "$status" -ne 0 ]; then kill "$p" 2>/dev/null; fi
  wait "$p" || status=1
done
for r in $(seq 1 $((n - 1))); do
  if grep -q "error" "$logs/rank-$r.log"; then sed "s/^/rank $r: /" "$logs/rank-$r.log" | tail -20; fi
done
exit "$status"
