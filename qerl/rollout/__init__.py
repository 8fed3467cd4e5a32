"""Rollout engines: sample completions (with their sampling log-probs) from the policy being trained.

``get_engine(model, tokenizer, kind)`` picks one:

* ``"native"`` (default): qerl's own static-KV-cache decoder with a CUDA-graph decode step, reading
  the trainer's modules in place (NVFP4 weights, unmerged LoRA, norm weights);
* ``"hf"``: transformers' ``generate`` (baseline and fallback);
* ``"vllm"``: a colocated vLLM engine serving the NVFP4 checkpoint with LoRA pushed from memory.
"""

from __future__ import annotations

from typing import Any

from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "get_engine"]

KINDS = ("native", "hf", "vllm")


def get_engine(model: Any, tokenizer: Any, kind: str = "native", **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine ``kind`` over ``model``; ``tokenizer`` may also be a pad token id.

    Extra keyword arguments go to the engine's constructor.
    """
    if kind == "native":
        from qerl.rollout.native import NativeEngine

        return NativeEngine(model, tokenizer, **kwargs)
    if kind == "hf":
        from qerl.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, **kwargs)
    if kind == "vllm":
        from qerl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **kwargs)
    raise ValueError(f"rollout engine kind: expected one of {KINDS}, got {kind!r}")
