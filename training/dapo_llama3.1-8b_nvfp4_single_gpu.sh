#!/usr/bin/env bash
# Llama-3.1-8B-Instruct, NVFP4 + LoRA + AQN (QeRL), single GPU: batch 2 (= generations per prompt),
# rollout memory share 0.30 (vLLM engine only), default data gsm8k -- the settings of the Qwen2.5-7B script.
# Extra flags are passed on to `python -m qerl.train`; MODEL_PATH replaces the default model (a local path or hub id).
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu_model llama3.1-8b meta-llama/Llama-3.1-8B-Instruct nvfp4 2 0.30 gsm8k "$@"
