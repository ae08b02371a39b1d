#!/usr/bin/env bash
# Pure bf16's update roundings against an f32 master copy, fine-tuning at a small learning
# rate, where rounding to nearest loses updates: tinyshakespeare in GPT-2 BPE, a GPT-2 of
# 2 layers of 128 (6.6M parameters, most of them the tied embedding), first trained 200
# steps from scratch (mixed bf16, lr 1e-3), then fine-tuned from there for STEPS steps at
# lr LR (constant) with each precision and three data orders (--shuffle --seed 1, 2, 3).
# Prints the final validation loss of each run and a markdown table of the means.
#
#   scripts/update-rounding-quality.sh [WORK_DIR]   (default: a new temporary folder)
#
# Settings (environment): STEPS (default 100), LR (default 2e-5), TEXT (default
# ../shared/data/tinyshakespeare.txt beside the repository).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
steps="${STEPS:-100}"
lr="${LR:-2e-5}"
text="${TEXT:-$root/../shared/data/tinyshakespeare.txt}"
bin="$root/target/release/trainkit"
[ -x "$bin" ] || (cd "$root" && cargo build --release --quiet)
common=(--tokenizer gpt2 --vocab-size 50257 --n-layer 2 --n-head 2 --n-embd 128
  --seq-len 64 --batch-size 8 --device cpu --eval-every 0 --lr-schedule constant
  --warmup-steps 0 --weight-decay 0)
"$bin" prepare --text "$text" --out "$work/shake" >/dev/null
if [ ! -f "$work/base/model.safetensors" ]; then
  "$bin" train --data "$work/shake" "${common[@]}" --steps 200 --lr 1e-3 --precision bf16 \
    --out "$work/base" >"$work/base.log"
fi
echo "base: $(grep -o 'final val loss [0-9.]*' "$work/base.log")"
variants=("f32 master:--precision bf16"
  "pure bf16, nearest:--precision bf16 --master-weights none --update-rounding nearest"
  "pure bf16, stochastic:--precision bf16 --master-weights none --update-rounding stochastic"
  "pure bf16, Kahan:--precision bf16 --master-weights none --update-rounding kahan")
table="| precision | seed 1 | seed 2 | seed 3 | mean |
| --- | --- | --- | --- | --- |"
for v in "${variants[@]}"; do
  name="${v%%:*}"
  read -r -a flags <<<"${v#*:}"
  row="| $name |"
  sum=0
  for seed in 1 2 3; do
    log="$work/$(echo "$name" | tr -c 'a-z0-9' '_')-$seed.log"
    "$bin" train --data "$work/shake" "${common[@]}" --init-from "$work/base" \
      --steps "$steps" --lr "$lr" --shuffle --seed "$seed" "${flags[@]}" >"$log"
    val="$(grep -o 'final val loss [0-9.]*' "$log" | awk '{print $4}')"
    echo "$name, seed $seed: val $val"
    row="$row $val |"
    sum="$(awk -v a="$sum" -v b="$val" 'BEGIN{printf "%.4f", a+b}')"
  done
  table="$table
$row $(awk -v s="$sum" 'BEGIN{printf "%.4f", s/3}') |"
done
echo
echo "$table"
