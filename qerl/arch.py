"""What qerl knows about the models it trains: one place for the decoder layout facts that LoRA, the
quantizer, AQN, the rollout engines and export all rely on, and the one check that refuses the rest.

Supported: transformers' dense decoder-only causal LMs of the families in :data:`FAMILIES` (and
checkpoints with the same module names). Each decoder layer has
``input_layernorm -> self_attn.{q,k,v,o}_proj`` and ``post_attention_layernorm -> mlp.{gate,up,down}_proj``
with SiLU gating; the families differ only in the quirks :class:`Family` records. RoPE variants
(Llama-3.x's ``rope_type: llama3`` frequency scaling, YaRN, ...) are not a family quirk: every consumer
takes the cos/sin tables from the model's own ``rotary_emb``, so transformers' rope init functions
decide the frequencies. Tied embeddings are not one either: ``lm_head`` then shares the embedding
tensor, which the quantizer keeps in bf16 and the engines read in place.

AQN and the trained norms cover exactly :data:`NORM_MODULES`, the norms that feed a quantized fused
group. Qwen3's per-head ``q_norm`` / ``k_norm`` are left alone: they act after the projections, on the
head dimension shared by every head, and feed RoPE and the attention logits, not an NVFP4 matmul. Noise
there would not be the row-wise multiplicative weight noise on a quantized layer that AQN emulates (it
would rescale every head's attention logits along the same dimensions at once), and they absorb no
quantization error of a following Linear, which is why QeRL trains the other norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The attention input projections, and the MLP input projections: each group reads the same
#: normalised input, so vLLM fuses it into one matmul (one shared NVFP4 global scale, see
#: ``qerl.quantize.pipeline``) and the rollout engine computes its LoRA shrinks together.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED_GROUPS = (QKV, GATE_UP)

#: Every decoder Linear: the LoRA targets and the layers NVFP4 quantizes.
LINEAR_TARGETS = (*QKV, "o_proj", *GATE_UP, "down_proj")

#: The RMSNorms that feed a fused group: AQN perturbs exactly these, and LoRA can train them.
NORM_FEEDS = {"input_layernorm": QKV, "post_attention_layernorm": GATE_UP}
NORM_MODULES = tuple(NORM_FEEDS)

#: Qwen3's per-head RMSNorms on q and k (``self_attn.q_norm`` / ``k_norm``), applied before RoPE.
QK_NORMS = ("q_norm", "k_norm")


@dataclass(frozen=True)
class Family:
    """The per-family quirks of the shared layout above."""

    model_type: str
    #: q and k pass through per-head RMSNorms (:data:`QK_NORMS`) between projection and RoPE.
    qk_norm: bool = False
    #: what the family's usual checkpoints add (for error messages and docs; the code reads the config).
    notes: str = ""


FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", notes="Llama 2/3.x; rope_type llama3 scaling; tied embeddings on Llama-3.2-1B/3B"),
        Family("qwen2", notes="Qwen2/2.5; q/k/v biases; tied embeddings on the small sizes"),
        Family("qwen3", qk_norm=True, notes="Qwen3 dense; per-head q_norm/k_norm before RoPE; no q/k/v bias"),
        Family("mistral", notes="Mistral; sliding_window attention (rollouts up to the window)"),
    )
}

#: ``config.model_type`` values qerl quantizes for training, loads, trains and rolls out.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def check_config(config: Mapping[str, Any] | Any, where: str) -> Family:
    """The family of a model config (a config.json dict or a transformers config), or a one-line
    ``ValueError`` naming ``where``, the model type and the supported list. MoE and multimodal types
    (``qwen3_moe``, ``mixtral``, ``qwen2_vl``, ...) are other model types, so they are refused here,
    before any weight is read."""
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    model_type = get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; qerl supports the dense causal LM "
            f"types {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family


def check_model(model: Any, where: str) -> Family:
    """:func:`check_config` on a (possibly peft-wrapped) transformers model, or a hub id / directory."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return check_config(AutoConfig.from_pretrained(model, trust_remote_code=False), where)
    get_base = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model
    return check_config(getattr(lm, "config", None) or {}, where)


def sliding_window(config: Any) -> int | None:
    """The attention window of a transformers config, None for full attention. transformers sets
    Qwen2/Qwen3's ``sliding_window`` to None unless ``use_sliding_window``; Mistral's is used as given."""
    return getattr(config, "sliding_window", None)
