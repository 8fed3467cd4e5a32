"""The rollout side of ``QeRLTrainer``: trl's generation hooks served by a ``qerl.rollout`` engine, and AQN around them.

A mixin, kept apart from the trainer's training-step and checkpoint code: what runs while the policy samples
(the engine, AQN's noise on the norms, the sampling settings and seeds, the eval-mode / no-grad toggle and its
metrics) reads on its own. It relies on what ``QeRLTrainer.__init__`` sets (``aqn``, ``_engine``, ``_noise``,
``_rollout_index``) and on trl's own attributes (``args``, ``state``, ``accelerator``, ``_metrics``, ...).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from qerl.rollout import SamplingParams, get_engine
from qerl.train.aqn import NormNoise, draw_seed, norm_weights

logger = logging.getLogger(__name__)


def group_repeats(prompt_ids: list[list[int]]) -> tuple[list[list[int]], int]:
    """(unique prompts, n) when the batch is runs of equal length n of identical prompts, as trl's
    RepeatSampler produces; else (all prompts, 1). Lets the engine share each prompt's prefill."""
    runs: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if runs and runs[-1][0] == ids:
            runs[-1] = (ids, runs[-1][1] + 1)
        else:
            runs.append((list(ids), 1))
    sizes = {n for _, n in runs}
    if len(sizes) == 1:
        return [ids for ids, _ in runs], sizes.pop()
    return [list(ids) for ids in prompt_ids], 1


class RolloutHooks:
    """``QeRLTrainer``'s rollouts: ``rollout_engine``, ``noise``, ``sampling_params``, ``rollout_mode`` and trl's
    ``_generate`` / ``_generate_single_turn`` hooks."""

    def _policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model_wrapped)

    def rollout_engine(self) -> Any:
        """The engine, built on first use (the model is peft-wrapped and placed by then)."""
        if self._engine is None:
            kwargs = dict(self.args.rollout_engine_kwargs or {})
            self._engine = get_engine(self._policy(), self.processing_class, self.args.rollout_engine, **kwargs)
            if (
                self.aqn is not None
                and self.args.aqn_resample == "token"
                and not hasattr(self._engine, "set_step_hook")
            ):
                raise ValueError(
                    f"--aqn_resample token: the {self.args.rollout_engine!r} engine has no per-decode-step hook "
                    "(set_step_hook); use --aqn_resample step or --rollout_engine native"
                )
        return self._engine

    def noise(self) -> NormNoise:
        """AQN's handle on the rollout model's norm weights: the trainer's own modules, which the
        native and hf engines read in place and the vLLM engine pushes into vLLM at each generate."""
        if self._noise is None:
            weights = norm_weights(self._policy())
            self._noise = NormNoise(weights, seed=draw_seed(self.args.seed, 0, 1))
            if self.args.aqn_resample == "token":  # registered once: graphs captured with it stay valid
                self.rollout_engine().set_step_hook(self._noise.token_hook)
            logger.info(
                "AQN on %d norm vectors (%d values); sigma per stage: %s",
                len(weights),
                self._noise.numel,
                ", ".join(f"{s:.3g}" for s in self.aqn.sigmas()),
            )
        return self._noise

    def current_sigma(self) -> float:
        """AQN's sigma for the rollout of the current optimizer step (0 when AQN is off)."""
        if self.aqn is None:
            return 0.0
        return self.aqn.sigma(self.state.global_step, max(1, self.state.max_steps))

    def _sampling_seed(self) -> int:
        """A seed per (run seed, optimizer step, rollout within the step, process), so rollouts after a
        resume are the ones the uninterrupted run drew, and data-parallel ranks that sample the same
        prompt (a group split across ranks) draw different completions. One process: (seed, step, count)."""
        step, count = self._rollout_index
        count = count + 1 if step == self.state.global_step else 0
        self._rollout_index = (self.state.global_step, count)
        draw = count * self.accelerator.num_processes + self.accelerator.process_index
        return draw_seed(self.args.seed, self.state.global_step, draw)

    @contextmanager
    def _aqn_applied(self, sigma: float) -> Iterator[NormNoise | None]:
        if self.aqn is None:
            yield None
            return
        with self.noise().applied(sigma, self.state.global_step) as handle:
            yield handle

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The run's sampling settings for ``rollout_engine().generate``: trl's temperature, top-k/-p,
        min-p, repetition penalty and ``generation_kwargs``, the completion budget, EOS as the stop
        token (none with ``ignore_eos``) and a fresh seed per call (``_sampling_seed``); ``overrides``
        replace any of them (a ``rollout_func``'s second turn may want a shorter budget, say)."""
        extra = dict(self.args.generation_kwargs or {})
        ignore_eos = bool(extra.pop("ignore_eos", False))
        values: dict[str, Any] = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            max_new_tokens=self.max_completion_length,
            stop_token_ids=[] if ignore_eos else list(self.eos_token_ids),
            seed=self._sampling_seed(),
        )
        values.update(extra)
        values.update(overrides)
        return SamplingParams(**values)

    @contextmanager
    def inference_mode(self) -> Iterator[bool]:
        """The policy in eval mode without autograd, its mode restored after; yields whether it was training. Every
        generation runs under it: the rollouts (``rollout_mode``) and the held-out evaluation (``qerl.train.run``)."""
        policy = self._policy()
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                yield was_training
        finally:
            policy.train(was_training)

    @contextmanager
    def rollout_mode(self) -> Iterator[dict[str, int]]:
        """What every rollout runs under, ours or a ``rollout_func``'s: ``inference_mode`` and AQN's noise on the
        norms (removed bit-exactly after). Logs the rollout's time, its tokens per second (the caller puts the count
        of generated tokens in the yielded ``["tokens"]``) and the AQN stage."""
        sigma = self.current_sigma()
        stats = {"tokens": 0}
        start = time.perf_counter()
        with self.inference_mode() as was_training, self._aqn_applied(sigma):
            yield stats
        elapsed = time.perf_counter() - start
        metrics = self._metrics["train" if was_training else "eval"]
        metrics["rollout/seconds"].append(elapsed)
        metrics["rollout/tokens_per_s"].append(stats["tokens"] / max(elapsed, 1e-9))
        if self.aqn is not None:
            metrics["aqn/sigma"].append(sigma)
            metrics["aqn/stage"].append(float(self.aqn.stage(self.state.global_step, max(1, self.state.max_steps))))
            metrics["aqn/changed_frac"].append(self._noise.changed_fraction if self._noise else 0.0)

    def _in_rollout_mode(self, rollout_func: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """A user's ``rollout_func`` (trl's contract) run under ``rollout_mode``, like our own rollouts."""

        @functools.wraps(rollout_func)
        def run(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            with self.rollout_mode() as stats:
                out = rollout_func(prompts, trainer)
                stats["tokens"] = sum(len(c) for c in out.get("completion_ids", []))
            return out

        return run

    def _generate(self, prompts: list[Any]) -> Any:
        """trl's ``_generate``. Before a ``rollout_func`` trl syncs its own vLLM engine's weights when
        ``use_vllm`` (our IS gate) is on: qerl's engines read the live modules, so that sync is marked done."""
        self._last_loaded_step = self.state.global_step
        return super()._generate(prompts)

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: Any,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]]]:
        if images is not None or multimodal_fields:
            raise ValueError("QeRLTrainer: text-only rollouts; got images/multimodal inputs")
        engine = self.rollout_engine()
        prompts, n = group_repeats(prompt_ids)
        params = self.sampling_params()
        with self.rollout_mode() as stats:
            out = engine.generate(prompts, params, n=n)
            stats["tokens"] = sum(len(c) for c in out.completion_ids)
        return out.completion_ids, out.logprobs
