#!/usr/bin/env bash
# Three runs with the same seed and data, side by side on one GPU (SmolLM2-135M is far too small to
# fill an H200): QeRL (NVFP4 + LoRA + AQN), NVFP4 LoRA without AQN, bf16 LoRA. Each measures greedy
# held-out accuracy before and after; the curves are overlaid with qerl.train.plot.
#   BF16_DIR=... NVFP4_DIR=... QERL_OUT=runs/compare STEPS=200 [RUN_TIMEOUT=seconds] bash training/compare_smollm2.sh [extra qerl.train flags]
# NUM_GPUS=N runs each run data-parallel over N GPUs (accelerate launch, training/accelerate/ddp.yaml) with the
# same per-step batch (16 completions = 2 prompts x 8, 16/N per GPU); RUNS="qerl_nvfp4_aqn ..." picks a subset.
# RUNS may also name the runs benchmarks/learning.py adds: dequant_lora (bf16 LoRA on DEQUANT_DIR, NVFP4_DIR's
# weights dequantized), best_lora and qerl_best_aqn (BEST_DIR: another quantization method's checkpoint,
# without and with AQN), and bf16_aqn (bf16 LoRA with AQN, for benchmarks/aqn.py); learning.py and aqn.py run this
# script once per seed (--seed S among the extra flags).
# Extra flags come after the common ones, so they override them (e.g. --heldout 20 --num-samples 200).
# RUN_TIMEOUT stops a run that outlives it (SIGINT) so that the plots and the table still get written
# from what it logged; such a run counts as failed. Exit status: nonzero if any run or the plotting failed.
# Results (OUT = $QERL_OUT, default runs/compare): OUT/results.json (per run: exit code, steps, held-out accuracy before/after, train runtime),
# OUT/plots/{reward,entropy,sigma,completion_length}.png + curves.csv, OUT/<run>.log, OUT/<run>/ (metrics.jsonl,
# summary.json, adapter/).
# Deliberate deviations from the 7B recipes, the same for all three runs: one LR (LR, default 5e-5) instead
# of 1e-5 / 5e-6, synthetic arithmetic data with the lenient last-number reward plus a shaped closeness reward, short completions,
# truncated completions kept, no gradient checkpointing.
# Data and reward, calibrated on CPU (40 questions x 4 samples at the trainer's temperature 1.0, 96 tokens,
# native engine, tag prompt): the original --arithmetic-level hard ("36 * 47 * 24") rewarded 1-2% of
# SmolLM2-135M's samples and left ~all groups all-zero, so GRPO had no gradient. easy (a + b or a - b,
# operands 1..20, answer >= 0; 610 distinct questions, all used) rewards 11% of samples, 30% of groups of 4
# mixed (~half of groups of 8 expected), greedy 35%: a signal, with headroom. soft_format and gsm8k are left
# out: no completion ever wrote the <think>/<answer> tags (0 of 7,760 on the H200, 0 of ~700 on CPU), and a rare
# tagged hit (3.2 vs 1.0) would only make one outlier group. The 11% above is the bf16 model; the NVFP4
# SmolLM2 (a re-quantized Q4_1 GGUF) answered 0 of 8 easy held-out sums greedily and earned no exact reward
# in 8 quickstart steps, so the shaped `closeness` reward (near misses score above far ones) is added to
# give its two runs a gradient too; `last_number` keeps exact answers worth most.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source training/_launch.sh
gpus=${NUM_GPUS:-1}
per_device=$(qerl_per_device_batch 16 "$gpus" NUM_GPUS) || exit 2
: "${BF16_DIR:?set BF16_DIR to the dense SmolLM2 directory}" "${NVFP4_DIR:?set NVFP4_DIR to its NVFP4 checkpoint}"
OUT=${QERL_OUT:-runs/compare}
source "$root/training/_python.sh"
qerl_python "$root"  # PYTHON, else the project's .venv
export PYTHONUNBUFFERED=1
limit=()
if [[ -n "${RUN_TIMEOUT:-}" ]]; then
  limit=(timeout --signal=INT --kill-after=30 "$RUN_TIMEOUT")
fi
# The reference's DAPO settings (bnpo, clip-higher 0.28, grad clip 0.2, cosine with 10% warmup, AdamW
# (0.9, 0.99), weight decay 0.1) come from the 7B recipe; the flags below override what differs.
common=(--config training/recipes/qerl_nvfp4.yaml --dataset arithmetic --arithmetic-level easy --num-samples 610 --heldout 200 --heldout-max-tokens 96
        --rewards last_number closeness --lora-rank 16 --learning-rate "${LR:-5e-5}"
        --max-steps "${STEPS:-200}" --per-device-train-batch-size "$per_device" --num-generations 8 --max-completion-length 96
        --mask-truncated-completions False --gradient-checkpointing False --optim adamw_torch
        --save-strategy no --report-to none --disable-tqdm True --seed 0 "$@")
read -r -a runs <<< "${RUNS:-qerl_nvfp4_aqn nvfp4_lora bf16_lora}"
own_flags() {  # sets own=(...) for run $1; fails in one line, before any run starts, on an unknown run or a missing dir
  case $1 in
    qerl_nvfp4_aqn) own=(--model-name "$NVFP4_DIR" --load nvfp4 --aqn True) ;;
    nvfp4_lora) own=(--model-name "$NVFP4_DIR" --load nvfp4 --aqn False) ;;
    bf16_lora) own=(--model-name "$BF16_DIR" --load bf16 --aqn False) ;;
    bf16_aqn) own=(--model-name "$BF16_DIR" --load bf16 --aqn True) ;;
    dequant_lora) own=(--model-name "${DEQUANT_DIR:?set DEQUANT_DIR for dequant_lora}" --load bf16 --aqn False) ;;
    best_lora) own=(--model-name "${BEST_DIR:?set BEST_DIR for best_lora}" --load nvfp4 --aqn False) ;;
    qerl_best_aqn) own=(--model-name "${BEST_DIR:?set BEST_DIR for qerl_best_aqn}" --load nvfp4 --aqn True) ;;
    *) echo "error: RUNS: unknown run '$1' (expected qerl_nvfp4_aqn, nvfp4_lora, bf16_lora, bf16_aqn, dequant_lora, best_lora or qerl_best_aqn)" >&2
       exit 2 ;;
  esac
}
for run in "${runs[@]}"; do own_flags "$run"; done
mkdir -p "$OUT"
declare -A pids
port=29500
for run in "${runs[@]}"; do
  own_flags "$run"
  qerl_launcher "$gpus" $(( port++ )) "$PYTHON"  # concurrent DDP runs each need their own rendezvous port
  "${limit[@]}" "${launcher[@]}" "${own[@]}" --output-dir "$OUT/$run" "${common[@]}" > "$OUT/$run.log" 2>&1 &
  pids[$run]=$!
done
status=0
exits=()  # run=exit code, for the table
for run in "${runs[@]}"; do
  code=0
  wait "${pids[$run]}" || code=$?
  exits+=("$run=$code")
  if (( code != 0 )); then status=1; echo "run $run failed (exit $code): see $OUT/$run.log" >&2; fi
done
plotted=()
for run in "${runs[@]}"; do [[ -s "$OUT/$run/metrics.jsonl" ]] && plotted+=("$OUT/$run"); done
if (( ${#plotted[@]} )); then
  "$PYTHON" -m qerl.plot "${plotted[@]}" --out "$OUT/plots" > /dev/null || status=1
else
  status=1
fi
# One table of the three runs: their summary.json, or for a run cut short what its log and metrics say.
"$PYTHON" - "$OUT" "${exits[@]}" <<'PY' || status=1
import json, re, sys
from pathlib import Path
from qerl.fsutil import atomic_write_text
out, codes = Path(sys.argv[1]), dict(arg.rsplit("=", 1) for arg in sys.argv[2:])
rows = []
for name in codes:
    run = out / name
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
    before = re.findall(r"held-out accuracy before training: ([0-9.]+)", log)
    steps = [json.loads(l).get("step") for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()] if (run / "metrics.jsonl").exists() else []
    rows.append({"run": name, "exit_code": int(codes[name]), "steps": summary.get("global_step", max(steps, default=0)),
                 "heldout_rows": summary.get("heldout_rows"),
                 "heldout_accuracy_before": summary.get("heldout_accuracy_before", float(before[0]) if before else None),
                 "heldout_accuracy_after": summary.get("heldout_accuracy_after"),
                 "train_runtime_s": summary.get("train_runtime_s")})
atomic_write_text(out / "results.json", json.dumps(rows, indent=1))
print(f"{'run':16s} {'exit':>4s} {'steps':>5s} {'acc before':>10s} {'acc after':>10s} {'train s':>8s}")
fmt = lambda v, f: ("-" if v is None else format(v, f)).rjust(int(f.split(".")[0]))
for r in rows:
    print(f"{r['run']:16s} {r['exit_code']:4d} {r['steps']:5d} {fmt(r['heldout_accuracy_before'], '10.4f')} "
          f"{fmt(r['heldout_accuracy_after'], '10.4f')} {fmt(r['train_runtime_s'], '8.1f')}")
PY
echo "results: $OUT/results.json; curves: $OUT/plots/ (reward.png, entropy.png, sigma.png, completion_length.png, curves.csv); logs: $OUT/<run>.log; runs: $OUT/<run>/"
exit $status
