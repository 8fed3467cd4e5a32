#!/usr/bin/env bash
# Shared body of the dapo_qwen2.5-*_single_gpu.sh scripts: the reference's single-GPU settings
# (qerl_method.md §6.2) mapped onto `python -m qerl.train`. Sourced, then called as
#   qerl_single_gpu SIZE PRECISION BATCH VLLM_MEM DEFAULT_DATA [--num-gpus N] [extra qerl.train flags...]
# --num-gpus N (default 1): data-parallel over N GPUs with `accelerate launch` (training/accelerate/ddp.yaml),
# the same per-step batch as on one GPU (BATCH completions of one prompt; each GPU samples and trains on
# BATCH / N of them; N must divide BATCH). The native or hf engine only (vLLM runs on one GPU).
# Environment overrides: MODEL_PATH, DATA_NAME, DATA_PATH, OUTPUT_DIR, ENGINE (native|vllm|hf), OPTIM, LR,
# MAIN_PORT (the DDP rendezvous port, default 29500), PYTHON (default: the project's .venv; see _python.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"

qerl_single_gpu() {
    local size=$1 precision=$2 batch=$3 vllm_mem=$4 default_data=$5
    shift 5
    local gpus=1 rest=()
    while (( $# )); do
        case $1 in
            --num-gpus|--num_gpus) gpus=${2-}; shift $(( $# > 1 ? 2 : 1 )) ;;
            --num-gpus=*|--num_gpus=*) gpus=${1#*=}; shift ;;
            *) rest+=("$1"); shift ;;
        esac
    done
    local per_device
    per_device=$(qerl_per_device_batch "$batch" "$gpus") || exit 2
    local hub="Qwen/Qwen2.5-${size^^}-Instruct" recipe model
    if [[ $precision == nvfp4 ]]; then
        recipe=qerl_nvfp4.yaml
        # Quantize once: python llm-compressor/quantize_nvfp4.py --model $hub --output qmodel/Qwen2.5-${size^^}-Instruct-NVFP4A16
        model=${MODEL_PATH:-qmodel/Qwen2.5-${size^^}-Instruct-NVFP4A16}
    else
        recipe=lora_bf16.yaml
        model=${MODEL_PATH:-$hub}
    fi
    local data=${DATA_NAME:-$default_data} prompt completion
    case $data in  # the reference's length presets by data set
        gsm8k) prompt=256; completion=2048 ;;
        bigmath|bigmath_hard) prompt=1024; completion=4096 ;;
        *) prompt=1024; completion=8192 ;;
    esac
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    local run="qwen2.5-${size}_${precision}_${data}_b${batch}_r16"
    (( gpus > 1 )) && run+="_g${gpus}"  # its own output dir: never resume a run made with another layout
    local args=(
        --config "$root/training/recipes/$recipe"
        --model-name "$model" --load "$precision"
        --dataset "$data"
        --per-device-train-batch-size "$per_device" --num-generations "$batch" --gradient-accumulation-steps 1
        --max-prompt-length "$prompt" --max-completion-length "$completion"
        --vllm-gpu-memory-utilization "$vllm_mem"
        --rollout-engine "${ENGINE:-native}"
        --optim "${OPTIM:-adamw_8bit}"
        --output-dir "${OUTPUT_DIR:-$root/runs/$run}" --run-name "$run"
    )
    [[ -n ${DATA_PATH:-} ]] && args+=(--dataset-path "$DATA_PATH")
    [[ -n ${LR:-} ]] && args+=(--learning-rate "$LR")
    cd "$root"
    qerl_python "$root"
    qerl_launcher "$gpus" "${MAIN_PORT:-29500}" "$PYTHON"
    exec "${launcher[@]}" "${args[@]}" "${rest[@]}"
}
