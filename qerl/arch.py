"""What qerl knows about the models it trains: one place for the decoder layout facts that LoRA, the
quantizer, AQN, the rollout engines and export all rely on.

Supported: transformers' Llama and Qwen2 causal LMs (and checkpoints with the same module names).
Each decoder layer has ``input_layernorm -> self_attn.{q,k,v,o}_proj`` and
``post_attention_layernorm -> mlp.{gate,up,down}_proj``.
"""

from __future__ import annotations

#: ``config.model_type`` values whose layout is the one below (the native engine refuses others).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

#: The attention input projections, and the MLP input projections: each group reads the same
#: normalised input, so vLLM fuses it into one matmul (one shared NVFP4 global scale, see
#: ``qerl.quantize``) and the rollout engine computes its LoRA shrinks together.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED_GROUPS = (QKV, GATE_UP)

#: Every decoder Linear: the LoRA targets and the layers NVFP4 quantizes.
LINEAR_TARGETS = (*QKV, "o_proj", *GATE_UP, "down_proj")

#: The RMSNorms that feed a fused group: AQN perturbs exactly these, and LoRA can train them.
NORM_FEEDS = {"input_layernorm": QKV, "post_attention_layernorm": GATE_UP}
NORM_MODULES = tuple(NORM_FEEDS)
