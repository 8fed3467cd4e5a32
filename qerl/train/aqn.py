"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise on the rollout model's RMSNorm weights.

The paper folds a noise vector Z ~ N(0, sigma^2) into the RMSNorm scale that feeds q/k/v
(``input_layernorm``) and gate/up (``post_attention_layernorm``); through the following Linear it
acts as row-wise multiplicative weight noise, i.e. extra exploration on top of the fixed NVFP4
rounding error. The reference implementation gets this wrong in ways that silently change the
experiment: it looks for transformers' RMSNorm classes in vLLM's model, whose norms are vLLM's own
class, so most likely it adds no noise at all, and each point below is a way it would differ even
if it did. This module does it deliberately:

* **Stages over the real run.** ``K`` equal stages over the number of optimizer steps the trainer
  will actually take (``state.max_steps``), not over the planned epoch. Stage 0 is noise-free; stages
  1..K-1 run sigma from ``sigma_start`` to ``sigma_end`` (both reached) along the chosen decay.
* **Only the q/k/v and gate/up norms.** The final ``model.norm`` (which feeds the unquantized
  lm_head) is never touched. Norms are found by module name, so a wrapper class (peft's
  ``ModulesToSaveWrapper`` when the norms are trained) cannot hide them; finding none is an error.
* **Fresh noise, no accumulation.** The clean weights are saved before the rollout, the noisy ones
  are written as ``clean + Z`` (never ``noisy + Z``), and the clean tensors are copied back
  afterwards: the training forward sees bit-identical clean weights and nothing piles up across
  steps, whether or not the norms are trained.
* **One rounding, from the clean weight.** The noisy weight is ``(clean.float() + Z).to(dtype)``:
  exact for fp32 norms; for bf16 norms the noisy weight is rounded *once* to bf16. A perturbation
  below half a bf16 ulp of its weight (~3.9e-3 for weights in [1, 2)) still vanishes: that is the
  resolution of a bf16 norm the rollout kernels read, and no add order avoids it. The reference
  cast the noise to bf16 first and then added in bf16, rounding twice, and added it to the
  previous step's noisy weight, so rounding errors compounded. ``changed_fraction`` (logged as
  ``aqn/changed_frac``) reports how many entries the noise actually moved, so a sigma below the
  storage resolution is visible instead of silent.
* **Deterministic, stateless draws.** Each draw comes from a CPU generator seeded by
  ``(seed, step, draw index)``: a resumed run redraws exactly the noise the uninterrupted run
  would have, with no RNG state to checkpoint, and results do not depend on the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qerl.arch import NORM_MODULES

#: Decay shapes the paper ablated (Fig. 9/15); exponential is its default.
SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
#: When a new noise vector is drawn: once per rollout (``step``), or once per decoded token (``token``).
RESAMPLE_MODES = ("step", "token")


@dataclass(frozen=True)
class AQNSchedule:
    """sigma as a function of (optimizer step, total optimizer steps)."""

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4  # the reference's scripts (its ModelConfig and the paper's Table 4 say 5e-4)
    num_stages: int = 10
    schedule: str = "exponential"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--aqn_schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_stages < 2:
            raise ValueError(f"--num_stages: expected >= 2 (stage 0 is noise-free), got {self.num_stages}")
        if not (self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError(f"--sigma_start/--sigma_end: expected > 0, got {self.sigma_start} and {self.sigma_end}")

    def stage(self, step: int, total_steps: int) -> int:
        """Stage of 0-based optimizer ``step``: K equal slices of ``total_steps``, clamped to the last."""
        if total_steps < 1:
            raise ValueError(f"AQN needs the number of optimizer steps, got total_steps={total_steps}")
        return min(self.num_stages - 1, max(0, step) * self.num_stages // total_steps)

    def stage_sigma(self, stage: int) -> float:
        """sigma of a stage: 0 for stage 0, then sigma_start ... sigma_end over stages 1..K-1."""
        if stage <= 0:
            return 0.0
        decay_stages = self.num_stages - 1
        u = 0.0 if decay_stages == 1 else (stage - 1) / (decay_stages - 1)  # 0 at stage 1, 1 at stage K-1
        s0, s1 = self.sigma_start, self.sigma_end
        if self.schedule == "exponential":  # the paper's Eq. 8, normalised so sigma_end is reached
            return s0 * (s1 / s0) ** u
        if self.schedule == "linear":
            return s0 + (s1 - s0) * u
        if self.schedule == "cosine":
            return s1 + (s0 - s1) * 0.5 * (1.0 + math.cos(math.pi * u))
        # logarithmic: falls fastest at first, s0 at u=0 and s1 at u=1
        return s1 + (s0 - s1) * (1.0 - math.log1p((math.e - 1.0) * u))

    def sigma(self, step: int, total_steps: int) -> float:
        return self.stage_sigma(self.stage(step, total_steps))

    def sigmas(self) -> list[float]:
        """sigma of every stage, for logging the plan at the start of a run."""
        return [self.stage_sigma(k) for k in range(self.num_stages)]


def norm_weights(model: nn.Module, names: tuple[str, ...] = NORM_MODULES) -> list[tuple[str, torch.Tensor]]:
    """The live q/k/v and gate/up RMSNorm weights of ``model`` (never the final norm).

    Raises when there are none: AQN that finds nothing to perturb must not pass silently.
    """
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            # peft's ModulesToSaveWrapper (trained norms) forwards `.weight` to the active copy,
            # which is the tensor its forward uses.
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                found.append((name, weight))
    if not found:
        raise ValueError(f"AQN: no modules named {names} in {type(model).__name__}; cannot apply noise")
    return found


def draw_seed(seed: int, step: int, draw: int) -> int:
    """A distinct 63-bit seed per (run seed, step, draw), stable across runs and resumes."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + draw * 0x94D049BB133111EB) & (2**64 - 1)
    return mixed >> 1


class NormNoise:
    """Puts ``clean + N(0, sigma^2)`` into a set of norm weights for the span of one rollout.

    Usage::

        with noise.applied(sigma, step):
            engine.generate(...)
        # weights are bit-identical to before here

    Per-token resampling (``token_hook``) is meant to be registered once with an engine that calls
    it before prefill and before every decode step, inside a captured CUDA graph on GPU. It is
    therefore capture-safe: it reads persistent buffers (the clean copies, sigma, an on/off flag)
    by address, draws from the device's default generator and writes in place; outside
    ``applied`` the flag is off and the hook leaves the weights untouched (they may be training).
    Its draws are reproducible through torch's global RNG state (which checkpoints save), not
    through the stateless per-step seeds of the per-step draws.
    """

    def __init__(self, weights: list[tuple[str, torch.Tensor]], seed: int = 0) -> None:
        if not weights:
            raise ValueError("NormNoise: no weights to perturb")
        self.weights = weights
        self.seed = seed
        self.numel = sum(w.numel() for _, w in weights)
        with torch.no_grad():
            self._clean = [w.detach().clone() for _, w in weights]
        self._devices = sorted({w.device for _, w in weights}, key=str)
        self._sigma = {d: torch.zeros((), device=d) for d in self._devices}
        self._on = {d: torch.zeros((), dtype=torch.bool, device=d) for d in self._devices}
        self._active = False
        self._sigma_value = 0.0
        self._step = 0
        self.draws = 0
        self.changed_fraction = 0.0

    @torch.no_grad()
    def resample(self) -> None:
        """Overwrite every weight with its clean value plus a fresh draw, seeded by (seed, step, draw):
        one flat CPU draw, one copy per device. A no-op at sigma 0 or outside ``applied``."""
        sigma = self._sigma_value if self._active else 0.0
        if sigma == 0.0:
            return
        gen = torch.Generator(device="cpu").manual_seed(draw_seed(self.seed, self._step, self.draws))
        flat = torch.randn(self.numel, generator=gen, dtype=torch.float32).mul_(sigma)
        self.draws += 1
        moved = {d: flat.to(d) for d in self._devices}
        offset = 0
        for (_, w), clean in zip(self.weights, self._clean, strict=True):
            z = moved[w.device][offset : offset + w.numel()].view_as(w)
            offset += w.numel()
            w.copy_((clean.float() + z).to(w.dtype))
        if self.draws == 1:  # cheap (norm vectors only), and the first draw is representative
            changed = sum(int((w != c).sum()) for (_, w), c in zip(self.weights, self._clean, strict=True))
            self.changed_fraction = changed / self.numel

    @torch.no_grad()
    def token_hook(self) -> None:
        """A fresh draw for every weight, capture-safe (see the class docstring); inert outside ``applied``."""
        for d in self._devices:
            parts = [(w, c) for (_, w), c in zip(self.weights, self._clean, strict=True) if w.device == d]
            flat = torch.randn(sum(w.numel() for w, _ in parts), device=d, dtype=torch.float32)
            offset = 0
            for w, clean in parts:
                z = flat[offset : offset + w.numel()].view_as(w)
                offset += w.numel()
                noisy = (clean.float() + self._sigma[d] * z).to(w.dtype)
                w.copy_(torch.where(self._on[d], noisy, w))

    @contextmanager
    def applied(self, sigma: float, step: int) -> Iterator[NormNoise]:
        """Noise in for the body, clean weights (bit-exact) back afterwards, even on error."""
        if self._active:
            raise RuntimeError("NormNoise.applied is not re-entrant")
        if sigma < 0 or not math.isfinite(sigma):
            raise ValueError(f"AQN sigma must be finite and >= 0, got {sigma}")
        with torch.no_grad():
            for (_, w), clean in zip(self.weights, self._clean, strict=True):
                clean.copy_(w)  # the buffers keep their addresses: captured graphs read them
            for d in self._devices:
                self._sigma[d].fill_(sigma)
                self._on[d].fill_(sigma > 0)
        self._active, self._sigma_value, self._step = True, float(sigma), int(step)
        self.draws, self.changed_fraction = 0, 0.0
        try:
            self.resample()
            yield self
        finally:
            with torch.no_grad():
                for d in self._devices:
                    self._on[d].fill_(False)
                    self._sigma[d].zero_()
                for (name, w), clean in zip(self.weights, self._clean, strict=True):
                    w.copy_(clean)
                    if not torch.equal(w, clean):  # e.g. a weight re-bound to a new tensor mid-rollout
                        raise RuntimeError(f"AQN: could not restore {name} bit-exactly after the rollout")
            self._active = False
