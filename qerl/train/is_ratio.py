"""The rollout importance-sampling ratio from the loss forward's own log-probs: one pass over the batch fewer.

trl corrects the mismatch between the policy that sampled and the one that is trained
(``vllm_importance_sampling_correction``, on in ``QeRLConfig``; see ``qerl.train.trainer``) by weighting each token's
loss with pi_train / pi_rollout, truncated or masked, per token or per sequence. It gets pi_train from a separate
no-grad forward over the whole batch right after generation (``old_per_token_logps``). When every generation is
consumed within one optimizer step (``gradient_accumulation_steps`` a multiple of ``steps_per_generation *
num_iterations``: trl's own test for "aligned" steps), no weight changes between that pass and the loss forward,
so its log-probs are the loss forward's, detached; and trl's loss already takes ``per_token_logps.detach()`` as
the old log-probs when none are given. The extra pass is one more forward over the batch's tokens beside the three
to four of the loss forward + backward (four under gradient checkpointing), for a ratio the loss forward can give.

So :class:`LossPassRatio`, a mixin of ``QeRLTrainer``, lets trl skip that pass (its generation sees the
correction switched off) and fills ``importance_sampling_ratio`` in each micro-batch from the log-probs the loss
forward has just computed, before trl's loss reads it: the same formula (:func:`rollout_ratio`) on the same
numbers, and trl's ``sampling/*`` metrics under their names, over each whole generation.
``is_ratio_from_loss_pass=False`` restores trl's separate pass; options that are not aligned (``num_iterations``
> 1 with one generation per optimizer step, ...) or take another loss path (``use_liger_kernel``) keep it
regardless.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: trl's modes (``vllm_importance_sampling_mode``): the ratio per token or per sequence, truncated or masked.
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_ratio(
    train_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float | None,
    high: float | None,
) -> torch.Tensor:
    """pi_train / pi_rollout over the masked completion tokens, (B, T) for token modes, (B, 1) for sequence
    modes (the product over the sequence); ``*_truncate`` clamps it to [low, high], ``*_mask`` zeroes it outside.
    A token whose sampling log-prob is NaN (its engine could not score it) counts as a ratio of 1."""
    if mode not in MODES:
        raise ValueError(f"--vllm_importance_sampling_mode: expected one of {', '.join(MODES)}, got {mode!r}")
    diff = torch.nan_to_num((train_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


class LossPassRatio:
    """Mixin over trl's ``GRPOTrainer``: the rollout IS ratio from the loss forward (see the module docstring).

    How it steers trl, all of it pinned by ``tests/test_trl_contract.py`` against the trl release we accept:

    * ``_generate_and_score_completions``: runs trl's with ``self.vllm_importance_sampling_correction`` off, so trl
      computes neither the old log-probs nor the ratio; then checks that the rollout gave sampling log-probs.
    * ``_compute_loss`` -> ``_get_per_token_logps_and_entropies``: the side channel. trl's loss asks for the
      log-probs through the second inside the first, with no way to hand the micro-batch along; so ``_compute_loss``
      parks the micro-batch's ``inputs`` in ``self._ratio_inputs`` and the next log-prob call (the loss forward's,
      always the first inside it) takes them back out, writes ``inputs["importance_sampling_ratio"]``, which trl's
      loss reads right after, and clears the slot; ``_compute_loss`` clears it too, whatever happens.
    * ``self._metrics``: the ``sampling/*`` values trl would have logged, under its names.
    """

    _ratio_inputs: dict[str, Any] | None = None
    #: (log-prob differences, ratios) of the current generation's loss forwards so far.
    _ratio_parts: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    #: Loss forwards still to come of the current micro-batch: a pass in row chunks (``qerl.train.chunked_pass``) runs
    #: one per chunk, and a generation ends with its last micro-batch's last.
    _ratio_pieces_left: int = 0
    _ratio_batches: int = 0  # micro-batches of the current generation done so far

    def _ratio_from_loss_pass(self) -> bool:
        args = self.args
        return bool(
            args.is_ratio_from_loss_pass
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and not args.use_liger_kernel
            and args.gradient_accumulation_steps % (args.steps_per_generation * self.num_iterations) == 0
        )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self._ratio_from_loss_pass():
            return super()._generate_and_score_completions(inputs)
        self.vllm_importance_sampling_correction = False  # trl then skips the old-log-prob pass and the ratio
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True
        if output.get("sampling_per_token_logps") is None:
            raise ValueError(
                "the rollout returned no sampling log-probs, which the importance-sampling correction "
                "needs; set vllm_importance_sampling_correction=False to train without it"
            )
        return output

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        self._ratio_inputs = inputs if self._ratio_from_loss_pass() else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ratio_inputs = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._ratio_inputs = self._ratio_inputs, None
        if inputs is not None:  # the loss forward of a micro-batch: its ratio, before the loss reads it
            inputs["importance_sampling_ratio"] = self._loss_pass_ratio(result[0].detach(), inputs)
        return result

    def _loss_pass_ratio(self, logps: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """:func:`rollout_ratio` for one micro-batch (or one chunk of its rows); trl's ``sampling/*`` metrics once per
        generation."""
        mask = (
            inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        )
        sampling = inputs["sampling_per_token_logps"]
        mode = self.vllm_importance_sampling_mode
        ratio = rollout_ratio(
            logps, sampling, mask, mode, self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        )
        delta = (logps - sampling).abs()[mask.bool()]
        parts = self._ratio_parts = self._ratio_parts or []
        parts.append(
            (delta[~torch.isnan(delta)], ratio.flatten() if mode.startswith("sequence") else ratio[mask.bool()])
        )
        if self._ratio_pieces_left:
            return ratio
        self._ratio_batches += 1
        if self._ratio_batches == (self.args.steps_per_generation if self.model.training else 1):  # its last
            self._ratio_parts, self._ratio_batches = None, 0
            self._log_ratio_metrics(torch.cat([d for d, _ in parts]), torch.cat([r for _, r in parts]))
        return ratio

    def _log_ratio_metrics(self, delta: torch.Tensor, ratio: torch.Tensor) -> None:
        """What trl logs of one generation's log-prob differences and ratios, under its names and reductions."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        gather = self.accelerator.gather
        zero = torch.zeros((), device=delta.device)
        for name, values, reduce, across in (
            ("sampling_logp_difference/mean", delta, torch.mean, torch.mean),
            ("sampling_logp_difference/max", delta, torch.max, torch.max),
            ("importance_sampling_ratio/min", ratio, torch.min, torch.min),
            ("importance_sampling_ratio/mean", ratio, torch.mean, torch.mean),
            ("importance_sampling_ratio/max", ratio, torch.max, torch.max),
        ):
            metrics[f"sampling/{name}"].append(across(gather(reduce(values) if values.numel() else zero)).item())


__all__ = ["MODES", "LossPassRatio", "rollout_ratio"]
