#!/usr/bin/env bash
# Three runs with the same seed and data, side by side on one GPU (SmolLM2-135M is far too small to
# fill an H200): QeRL (NVFP4 + LoRA + AQN), NVFP4 LoRA without AQN, bf16 LoRA. Each measures greedy
# held-out accuracy before and after; the curves are overlaid with qerl.plot.
#   BF16_DIR=... NVFP4_DIR=... OUT=runs/compare STEPS=200 bash training/compare_smollm2.sh [extra qerl.train flags]
# Deliberate deviations from the 7B recipes, the same for all three runs: one LR (LR, default 5e-5) instead
# of 1e-5 / 5e-6, synthetic arithmetic data with the lenient last-number reward (a 135M model gets
# ~no tagged GSM8K answer right), short completions, truncated completions kept, no gradient checkpointing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
: "${BF16_DIR:?set BF16_DIR to the dense SmolLM2 directory}" "${NVFP4_DIR:?set NVFP4_DIR to its NVFP4 checkpoint}"
OUT=${OUT:-runs/compare}
PYTHON=${PYTHON:-python}
common=(--dataset arithmetic --num-samples 4000 --heldout 200 --heldout-max-tokens 96
        --rewards soft_format gsm8k last_number --lora-rank 16 --learning-rate "${LR:-5e-5}"
        --max-steps "${STEPS:-200}" --per-device-train-batch-size 16 --num-generations 8 --max-completion-length 96
        --mask-truncated-completions False --gradient-checkpointing False --optim adamw_torch
        --save-strategy no --report-to none --disable-tqdm True --seed 0 "$@")
mkdir -p "$OUT"
"$PYTHON" -m qerl.train --model-name "$NVFP4_DIR" --load nvfp4 --aqn True --output-dir "$OUT/qerl_nvfp4_aqn" "${common[@]}" > "$OUT/qerl_nvfp4_aqn.log" 2>&1 &
"$PYTHON" -m qerl.train --model-name "$NVFP4_DIR" --load nvfp4 --aqn False --output-dir "$OUT/nvfp4_lora" "${common[@]}" > "$OUT/nvfp4_lora.log" 2>&1 &
"$PYTHON" -m qerl.train --model-name "$BF16_DIR" --load bf16 --aqn False --output-dir "$OUT/bf16_lora" "${common[@]}" > "$OUT/bf16_lora.log" 2>&1 &
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
"$PYTHON" -m qerl.plot "$OUT/qerl_nvfp4_aqn" "$OUT/nvfp4_lora" "$OUT/bf16_lora" --out "$OUT/plots" || status=1
exit $status
