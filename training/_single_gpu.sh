#!/usr/bin/env bash
# Shared body of the dapo_*_single_gpu.sh scripts: the reference's single-GPU settings
# (the reference's run scripts) mapped onto `python -m qerl.train`. Sourced, then called as
#   qerl_single_gpu SIZE PRECISION BATCH VLLM_MEM DEFAULT_DATA [--num-gpus N] [extra qerl.train flags...]
# for Qwen2.5-SIZE-Instruct, or, for any other model (Qwen3, Llama 3.1: the same options), as
#   qerl_single_gpu_model TAG HUB_ID PRECISION BATCH VLLM_MEM DEFAULT_DATA [...]
# where TAG names the run (runs/TAG_PRECISION_DATA_bBATCH_r16) and HUB_ID is the default bf16 model;
# the NVFP4 default is qmodel/<HUB_ID's name>-NVFP4A16 (quantize_nvfp4.py's default output). MODEL_PATH
# (a local directory or another hub id) replaces either default.
# --num-gpus N (default 1): data-parallel over N GPUs with `accelerate launch` (training/accelerate/ddp.yaml),
# the same per-step batch as on one GPU (BATCH completions of one prompt; each GPU samples and trains on
# BATCH / N of them; N must divide BATCH). The native or hf engine only (vLLM runs on one GPU).
# Environment overrides: MODEL_PATH, DATA_NAME, DATA_PATH, OUTPUT_DIR, ENGINE (native|vllm|hf), OPTIM, LR,
# MAIN_PORT (the DDP rendezvous port, default 29500), PYTHON (default: the project's .venv; see _python.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"

qerl_single_gpu() {
    local size=$1
    shift
    qerl_single_gpu_model "qwen2.5-${size}" "Qwen/Qwen2.5-${size^^}-Instruct" "$@"
}

qerl_single_gpu_model() {
    local tag=$1 hub=$2 precision=$3 batch=$4 vllm_mem=$5 default_data=$6
    shift 6
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
    local recipe model
    if [[ $precision == nvfp4 ]]; then
        recipe=qerl_nvfp4.yaml
        # Quantize once: python llm-compressor/quantize_nvfp4.py --model $hub --output qmodel/${hub##*/}-NVFP4A16
        model=${MODEL_PATH:-qmodel/${hub##*/}-NVFP4A16}
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
    local run="${tag}_${precision}_${data}_b${batch}_r16"
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
