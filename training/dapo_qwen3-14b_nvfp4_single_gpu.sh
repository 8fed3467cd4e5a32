#!/usr/bin/env bash
# Qwen3-14B, NVFP4 + LoRA + AQN (QeRL), single GPU: batch 2 (= generations per prompt),
# rollout memory share 0.40 (vLLM engine only), default data gsm8k -- the settings of the Qwen2.5-14B script.
# Extra flags are passed on to `python -m qerl.train`; MODEL_PATH replaces the default model (a local path or hub id).
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu_model qwen3-14b Qwen/Qwen3-14B nvfp4 2 0.40 gsm8k "$@"
