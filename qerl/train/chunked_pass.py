"""The training pass in row chunks: no recompute where a whole micro-batch's activations do not fit but a chunk's do.

trl's micro-batch (``per_device_train_batch_size`` completions) is also the unit its loss normalises: bnpo, the
recipes' loss, divides by the micro-batch's completion tokens, so a different split would change the loss. Its
activations without recompute are another matter: at 8 x 2304 tokens of a 7B model they need ~121 GB by
``qerl.train.recompute``'s estimate, so an 80 GB card recomputed every layer. :class:`ChunkedPass` keeps trl's
micro-batch and runs its forward + backward in chunks of its rows (completions), one chunk's activations alive at a
time, each chunk's loss normalised as the whole micro-batch's:

* trl's ``compute_loss`` runs on each chunk (the chunk's rows of every per-row tensor of the micro-batch, at the
  micro-batch's padded lengths) and normalises it as if it were the micro-batch; :func:`chunk_scales` swaps that
  normaliser for the micro-batch's (bnpo: its completion tokens over the micro-batch's; grpo, dr_grpo: its rows over
  the micro-batch's; dapo divides by the generation's token count whatever the split: 1);
* every chunk but the last runs its backward at once, through ``accelerator.backward`` as transformers' step runs the
  last one (trl marks its loss as already scaled for accumulation: ``loss_is_scaled_for_ga``), under ``no_sync`` so
  that data parallelism all-reduces only in the last backward, as for any micro-batch but the last of a step; the
  gradients add up in ``.grad`` as the micro-batches' do;
* the returned loss is the last chunk's plus the others', detached: transformers' backward runs the last chunk's,
  and the loss it logs is the sum of the chunks', the micro-batch's loss up to the order of the sum;
* the metrics trl's loss logs once per call are combined into the one value the unchunked call logs: the
  token-weighted means (entropy, KL, clip ratios) weighted by each chunk's completion tokens (rows at sequence-level
  importance sampling), summed over the ranks; the per-sequence extremes (``clip_ratio/low_min``, ``high_max``) as the
  extreme of the chunks'. The rollout importance-sampling ratio (``qerl.train.is_ratio``) is per token or per row: a
  chunk's is the micro-batch's on its rows, and its ``sampling/*`` metrics still come once per generation.

Exact up to the order of sums: each row's log-probs come from the same ops on the same inputs (the rows of a batch do
not mix in a decoder), and each gradient is the same sum over the same tokens, split in chunks; the scale factors are
one or two fp32 roundings (``tests/test_chunked_pass.py`` holds loss, every LoRA gradient and every logged metric to
the unchunked pass). A loss or option whose per-call normalisation or statistics this does not know how to combine
(other loss types, the entropy bonus or mask, a MoE router's aux loss, image inputs) keeps the pass in one piece
(:func:`refusal`); so do DeepSpeed, DataParallel and LOMO optimizers, whose backward transformers calls otherwise.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from qerl.train.recompute import AutoRecompute

#: The loss types whose chunks :func:`chunk_scales` normalises as the whole micro-batch.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: The keys of trl's text micro-batch; a chunk is their rows (0-d tensors, ``num_items_in_batch``, as they are).
TEXT_KEYS = frozenset(
    {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "tool_mask",
        "advantages",
        "num_items_in_batch",
        "old_per_token_logps",
        "sampling_per_token_logps",
        "importance_sampling_ratio",
        "ref_per_token_logps",
    }
)
#: trl's ``_compute_loss`` metrics that are means over the completion tokens of the call (``global_masked_mean``).
TOKEN_MEANS = ("kl", "entropy")
#: Its clip-ratio means: over the completion tokens, or over the rows at sequence-level importance sampling.
CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
#: Its extremes of the per-sequence means, NaN (a sequence without tokens) left out.
EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}


def refusal(trainer: Any, inputs: dict[str, Any] | None = None) -> str | None:
    """Why ``trainer``'s training passes cannot run in row chunks (None: they can); ``inputs``: a micro-batch, whose
    keys are checked too."""
    if trainer.loss_type not in LOSS_TYPES:
        return f"loss_type {trainer.loss_type} (chunks are normalised for {', '.join(LOSS_TYPES)})"
    if trainer._entropy_bonus_enabled:
        return "the entropy bonus (entropy_coef) is normalised per call"
    if trainer.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 takes its quantile over the whole micro-batch"
    if trainer.aux_loss_enabled:
        return "a MoE router's aux loss is averaged per call"
    if trainer.is_deepspeed_enabled or trainer.args.n_gpu > 1 or "lomo" in str(trainer.args.optim):
        return "DeepSpeed, DataParallel and LOMO take the backward out of accelerate's plain path"
    extra = sorted(set(inputs or ()) - TEXT_KEYS)
    return f"the micro-batch carries {extra[0]}, whose rows are not its completions" if extra else None


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The completion tokens trl's loss counts (its ``mask``: the completion mask, times the tool mask if any)."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def rows_of(inputs: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """Rows ``start:end`` of a micro-batch, sliced as trl's ``split_tensor_dict`` slices a generation batch: every
    tensor of one or more dimensions and every list along the first, anything else (``num_items_in_batch``) as is."""
    return {
        key: value[start:end] if isinstance(value, list) or (torch.is_tensor(value) and value.ndim) else value
        for key, value in inputs.items()
    }


def chunk_scales(loss_type: str, mask: torch.Tensor, spans: list[tuple[int, int]]) -> list[float]:
    """Per chunk, the factor that turns trl's loss of the chunk (normalised as if it were the micro-batch) into its
    share of the micro-batch's loss: bnpo divides by the call's completion tokens (at least 1), grpo averages the
    call's rows and dr_grpo divides by its rows times the completion budget, so the factor is the chunk's count over
    the micro-batch's; dapo divides by the generation's token count, the same for every split."""
    if loss_type == "dapo":
        return [1.0] * len(spans)
    if loss_type == "bnpo":
        total = max(float(mask.sum()), 1.0)
        return [max(float(mask[start:end].sum()), 1.0) / total for start, end in spans]
    return [(end - start) / spans[-1][1] for start, end in spans]


def combine(name: str, values: list[float], weights: list[float]) -> float:
    """The value trl's loss logs for metric ``name`` over the whole micro-batch, from its value on each chunk:
    an extreme of the chunks' (NaN where every chunk's is), else the mean weighted by ``weights`` (what trl's mean
    divides by in each chunk; a chunk that counts nothing logged 0 and weighs 0)."""
    if name in EXTREMES:
        kept = [v for v in values if not math.isnan(v)]
        return EXTREMES[name](kept) if kept else math.nan
    return sum(v * w for v, w in zip(values, weights, strict=True)) / max(sum(weights), 1.0)


class ChunkedPass(AutoRecompute):
    """Mixin over trl's ``GRPOTrainer``: each training pass as planned (``AutoRecompute`` with
    ``gradient_checkpointing`` unset, or ``--pass_chunk_rows N``), in one piece or in row chunks (module docstring).

    ``recompute_passes`` and ``chunk_passes`` (set by the trainer's ``__init__``) count the training passes run with
    recompute ``none`` and ``full``, and those run in chunks by rows per chunk: the benchmarks record both."""

    recompute_passes: dict[str, int]
    chunk_passes: dict[int, int]

    def check_pass_chunks(self) -> None:
        """``--pass_chunk_rows N`` refused in one line where this trainer's passes cannot run in chunks."""
        reason = refusal(self) if self.args.pass_chunk_rows else None
        if reason:
            raise ValueError(f"--pass_chunk_rows {self.args.pass_chunk_rows}: cannot chunk the training pass: {reason}")

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if not (self.model.training and torch.is_grad_enabled()):  # evaluation: trl's, in one piece
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        rows = inputs["prompt_ids"].shape[0]
        self.free_rollout_memory(inputs)
        chunk = self.plan_pass(inputs)
        self.recompute_passes["full" if self.model.is_gradient_checkpointing else "none"] += 1
        if chunk >= rows:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.chunk_passes[chunk] = self.chunk_passes.get(chunk, 0) + 1
        return self._chunked_loss(model, inputs, chunk)

    def plan_pass(self, inputs: dict[str, Any]) -> int:
        """Rows per forward + backward of this pass: ``--pass_chunk_rows`` N if set, the automatic choice where
        ``gradient_checkpointing`` is unset (chunks unless ``--pass_chunk_rows 0``), else the whole micro-batch."""
        asked, rows = self.args.pass_chunk_rows, inputs["prompt_ids"].shape[0]
        if asked:
            reason = refusal(self, inputs)
            if reason:
                raise ValueError(f"--pass_chunk_rows {asked}: cannot chunk the training pass: {reason}")
            return min(asked, rows)
        if self.args.gradient_checkpointing is None and self.planned_recompute != "full":
            return self._choose_recompute(inputs, chunks=self.auto_may_chunk(inputs))
        return rows

    def auto_may_chunk(self, inputs: dict[str, Any]) -> bool:
        """Chunks unless ``--pass_chunk_rows 0`` or the pass cannot be chunked (:func:`refusal`)."""
        return self.args.pass_chunk_rows is None and refusal(self, inputs) is None

    def _chunked_loss(self, model: nn.Module, inputs: dict[str, Any], chunk: int) -> torch.Tensor:
        """The micro-batch's loss, forward + backward in chunks of ``chunk`` rows; all but the last chunk's backward
        run here, the last one's in transformers' step (module docstring)."""
        rows = inputs["prompt_ids"].shape[0]
        spans = [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]
        mask = loss_mask(inputs)
        scales = chunk_scales(self.loss_type, mask, spans)
        metrics = self._metrics["train"]
        logged = {name: len(values) for name, values in metrics.items()}
        losses = []
        for i, (start, end) in enumerate(spans):
            last = i == len(spans) - 1
            self._ratio_pieces_left = len(spans) - 1 - i  # qerl.train.is_ratio: one generation's metrics, once
            try:
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = super().compute_loss(model, rows_of(inputs, start, end))
                    loss = loss if scales[i] == 1.0 else loss * scales[i]
                    if not last:
                        self.accelerator.backward(loss)
            finally:
                self._ratio_pieces_left = 0
            losses.append(loss if last else loss.detach())
        self._combine_metrics(metrics, logged, self._chunk_counts(mask, spans))
        return losses[-1] + torch.stack(losses[:-1]).sum()

    def _chunk_counts(self, mask: torch.Tensor, spans: list[tuple[int, int]]) -> list[list[float]]:
        """[completion tokens, rows] of each chunk, summed over the data-parallel ranks (what trl's means divide by)."""
        counts = torch.tensor(
            [[float(mask[start:end].sum()), float(end - start)] for start, end in spans],
            dtype=torch.float64,
            device=mask.device,
        )
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        return counts.tolist()

    def _combine_metrics(
        self, metrics: dict[str, list[float]], logged: dict[str, int], counts: list[list[float]]
    ) -> None:
        """Each metric trl's loss appended once per chunk, replaced by the one value of the whole micro-batch
        (:func:`combine`); a metric appended once (the ``sampling/*`` of a generation's last pass) stays as it is."""
        tokens, rows = [c[0] for c in counts], [c[1] for c in counts]
        weights = {name: tokens for name in TOKEN_MEANS}
        weights.update({name: tokens if self.importance_sampling_level == "token" else rows for name in CLIP_MEANS})
        for name, values in metrics.items():
            added = len(values) - logged.get(name, 0)
            if added <= 1:
                continue
            if added != len(counts) or (name not in weights and name not in EXTREMES):
                raise RuntimeError(
                    f"chunked training pass: trl logged {name!r} {added} times in {len(counts)} chunks, which qerl "
                    "cannot combine into the micro-batch's value; --pass_chunk_rows 0 keeps the pass in one piece"
                )
            values[-added:] = [combine(name, values[-added:], weights.get(name, rows))]


__all__ = ["ChunkedPass", "LOSS_TYPES", "chunk_scales", "combine", "loss_mask", "refusal", "rows_of"]
