#!/usr/bin/env bash
# qerl in a few minutes on a laptop CPU: quantize the embedded default model (SmolLM2-135M-Instruct) to
# NVFP4, run a short QeRL training (LoRA + trained norms + AQN) on synthetic arithmetic that scores the
# held-out questions before and after, and print what happened, what to expect and where the files are.
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
# It scores the held-out questions greedily before and after training (summary.json): the adapter's evaluation.
"$PYTHON" -m qerl.train --config training/recipes/quickstart.yaml --model-name "$QMODEL" --output-dir "$OUT"

echo "== done"
"$PYTHON" -m qerl.train.progress "$OUT"
cat <<MSG
what to expect: 8 steps of a 135M model on a CPU check that every part runs (quantize, rollouts, rewards,
  gradients, checkpoints, scoring); they are too few to teach it arithmetic, so held-out accuracy stays near 0
  and the reward moves by noise. Learning takes ~200 steps, a GPU's work: on an H200 QeRL (NVFP4 gptq + LoRA +
  AQN) on this model went from 0.28 to 0.62 held-out accuracy, its mean reward from 0.52 (first 10 steps) to
  1.19 (last 10), in 333-344 s a run (benchmarks/results/learning.json, 3 seeds); run it with
  python -m benchmarks.learning --out runs/learning --seeds 0
files:
  $OUT/summary.json    the numbers above
  $OUT/metrics.jsonl   every metric of every step (tensorboard --logdir $OUT)
  $OUT/plots/          curves, PNG + CSV (redraw: python -m qerl.plot $OUT)
  $OUT/adapter/        the peft adapter; score it again with
    python -m eval.gsm8k --model $QMODEL --lora $OUT/adapter --data $OUT/heldout.jsonl --max-new-tokens 96 --temperature 0
MSG
