#!/usr/bin/env bash
# qerl in a few minutes on a laptop CPU: quantize the embedded default model (SmolLM2-135M-Instruct) to
# NVFP4, run a short QeRL training (LoRA + trained norms + AQN) on synthetic arithmetic, evaluate the
# adapter on the held-out questions, and print where the logs and plots are.
# Environment: QERL_OUT (run dir, default runs/quickstart), QMODEL (quantized model dir), PYTHON (default: the
# project's .venv made by setup_env.sh; see training/_python.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source "$root/training/_python.sh"
qerl_python "$root"
QMODEL=${QMODEL:-qmodel/smollm2-135m-NVFP4A16}
OUT=${QERL_OUT:-runs/quickstart}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if [[ ! -f $QMODEL/config.json ]]; then
    echo "== quantizing smollm2-135m to NVFP4 -> $QMODEL"
    "$PYTHON" llm-compressor/quantize_nvfp4.py --model smollm2-135m --output "$QMODEL" --skip_generation
fi

echo "== training (recipe training/recipes/quickstart.yaml) -> $OUT"
"$PYTHON" -m qerl.train --config training/recipes/quickstart.yaml --model-name "$QMODEL" --output-dir "$OUT"

echo "== evaluating the adapter on the held-out questions"
"$PYTHON" -m eval.gsm8k --model "$QMODEL" --lora "$OUT/adapter" --data "$OUT/heldout.jsonl" --limit 8 \
    --max-new-tokens 96 --temperature 0 --batch-size 8 --output "$OUT/eval/heldout.jsonl"

cat <<MSG
== done
run summary (held-out accuracy before/after): $OUT/summary.json
per-step metrics:    $OUT/metrics.jsonl   (tensorboard --logdir $OUT)
curves (PNG + CSV):  $OUT/plots/          (redraw: python -m qerl.plot $OUT)
adapter (peft):      $OUT/adapter/
evaluation:          $OUT/eval/heldout.jsonl
MSG
