#!/usr/bin/env bash
# Qwen3-32B, bf16 LoRA baseline, single GPU: batch 2 (= generations per prompt),
# rollout memory share 0.95 (vLLM engine only), default data bigmath -- the settings of the Qwen2.5-32B script.
# Extra flags are passed on to `python -m qerl.train`; MODEL_PATH replaces the default model (a local path or hub id).
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu_model qwen3-32b Qwen/Qwen3-32B bf16 2 0.95 bigmath "$@"
