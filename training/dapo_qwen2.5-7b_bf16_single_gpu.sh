#!/usr/bin/env bash
# Qwen2.5-7B-Instruct, bf16 LoRA baseline, single GPU: batch 2 (= generations per prompt),
# rollout memory share 0.30 (vLLM engine only), default data bigmath -- the reference's per-size settings (its run scripts).
# Extra flags are passed on to `python -m qerl.train`.
source "$(dirname "$0")/_single_gpu.sh"
qerl_single_gpu 7b bf16 2 0.30 bigmath "$@"
