#!/usr/bin/env bash
# Qwen2.5-14B-Instruct, NVFP4 + LoRA + AQN (QeRL), single GPU: batch 2 (= generations per prompt),
# rollout memory share 0.40 (vLLM engine only), default data gsm8k -- the reference's per-size settings (its run scripts).
# Extra flags are passed on to `python -m qerl.train`.
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu 14b nvfp4 2 0.40 gsm8k "$@"
