"""The private trl / transformers hooks QeRLTrainer overrides, pinned against the trl release pyproject accepts.

QeRLTrainer is a drop-in for trl's GRPOTrainer and steers it through a few private methods and attributes
(``qerl/train/trainer.py``, ``qerl/train/is_ratio.py``). A trl release that renames one, changes its parameters or stops reading
an attribute would otherwise break training silently (an override that is never called, a gate never read): here it
fails by name."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import pytest
from trl import GRPOTrainer

from qerl.train import chunked_pass
from qerl.train.is_ratio import LossPassRatio
from qerl.train.trainer import QeRLTrainer

#: Every private base-class method a qerl class overrides -> the base's parameter names it was written against.
PINNED: dict[str, tuple[str, ...]] = {
    "_generate": ("self", "prompts"),
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ),
    "_generate_and_score_completions": ("self", "inputs"),
    "_compute_loss": ("self", "model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
}

#: Attributes of trl's that qerl sets or reads, and the trl method whose code must read or write them.
STEERED: dict[str, str] = {
    "self.use_vllm": "_generate_and_score_completions",  # the IS-correction gate, switched on for qerl's engines
    "self.vllm_importance_sampling_correction": "_generate_and_score_completions",  # off while LossPassRatio works
    "self._last_loaded_step": "_generate",  # marks trl's weight sync done: qerl's engines read the live modules
    "self._metrics": "_generate_and_score_completions",  # where the sampling/* metrics go
    # what qerl.train.chunked_pass reads to decide whether, and how, a pass runs in row chunks
    "self.loss_type": "_compute_loss",
    "self.importance_sampling_level": "_compute_loss",
    "self.top_entropy_quantile": "_compute_loss",
    "self._entropy_bonus_enabled": "_compute_loss",
    "self.aux_loss_enabled": "_compute_loss",
}


def base_method(name: str) -> Callable:
    for cls in GRPOTrainer.__mro__:
        if name in vars(cls):
            return vars(cls)[name]
    raise AssertionError(f"trl's GRPOTrainer (or transformers' Trainer) no longer has {name}, which qerl overrides")


def qerl_private_overrides() -> set[str]:
    """The private methods QeRLTrainer's own classes define that also exist on trl's GRPOTrainer."""
    ours = [cls for cls in QeRLTrainer.__mro__ if cls.__module__.startswith("qerl.")]
    names = {
        n for cls in ours for n, v in vars(cls).items() if callable(v) and n.startswith("_") and not n.startswith("__")
    }
    return {n for n in names if hasattr(GRPOTrainer, n)}


def test_every_private_override_is_pinned() -> None:
    """A new override of a private hook must be pinned here, and every pinned one is still overridden."""
    assert qerl_private_overrides() == set(PINNED)
    assert {"_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies"} <= set(
        vars(LossPassRatio)
    )


@pytest.mark.parametrize("name", list(PINNED))
def test_private_hook_signature_is_the_pinned_one(name: str) -> None:
    params = tuple(inspect.signature(base_method(name)).parameters)
    assert params == PINNED[name], f"{name}: trl's parameters are now {params}"


@pytest.mark.parametrize("attribute", list(STEERED))
def test_steered_attribute_is_still_read_by_trl(attribute: str) -> None:
    method = STEERED[attribute]
    assert attribute in inspect.getsource(base_method(method)), f"trl's {method} no longer uses {attribute}"


def test_chunked_pass_combines_every_metric_of_trls_loss() -> None:
    """A pass in row chunks (``qerl.train.chunked_pass``) calls trl's loss once per chunk and combines what it logged
    per call; every metric trl's loss can log is combined there, or logged only with an option that keeps the pass in
    one piece (the entropy bonus's, the MoE aux loss, the other loss types'). And transformers' step hands trl's loss
    to ``accelerator.backward`` unscaled, as the chunked pass does with all but the last chunk's."""
    logged = set(re.findall(r'self\._metrics\[mode\]\["([^"]+)"\]', inspect.getsource(base_method("_compute_loss"))))
    combined = {*chunked_pass.TOKEN_MEANS, *chunked_pass.CLIP_MEANS, *chunked_pass.EXTREMES}
    refused = {"policy_loss", "entropy_coef", "aux_loss", "cispo_clip_ratio", "vespo/phi_seq_mean"}
    assert logged == combined | refused
    assert GRPOTrainer.loss_is_scaled_for_ga is True
