#!/usr/bin/env bash
# Qwen3-32B, NVFP4 + LoRA + AQN (QeRL), single GPU: batch 8 (= generations per prompt),
# rollout memory share 0.40 (vLLM engine only), default data gsm8k -- the settings of the Qwen2.5-32B script.
# Extra flags are passed on to `python -m qerl.train`; MODEL_PATH replaces the default model (a local path or hub id).
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu_model qwen3-32b Qwen/Qwen3-32B nvfp4 8 0.40 gsm8k "$@"
