"""The rollout IS ratio from the loss forward (``qerl.train.is_ratio``): the same training as trl's separate pass.

Two of our trainers on the same tiny model, tokens (a fixed ``rollout_func`` whose sampling log-probs differ from
the model's, so the ratios are neither 1 nor all clipped), rewards and seed: one takes the ratio from the loss
forward, the other runs trl's no-grad pass. Losses, gradient norms, the ``sampling/*`` metrics and the trained
weights must agree, in every IS mode, and the first must make no forward pass outside the loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fixed_rollout, loss_logs, qerl_trainer, spread_reward

from qerl.train.is_ratio import rollout_ratio


def _rollout(prompts: list[Any], trainer: Any) -> dict[str, list[list[Any]]]:
    """``fixed_rollout``'s tokens with sampling log-probs spread around the model's (ratios above and below 1)."""
    out = fixed_rollout(prompts, trainer)
    out["logprobs"] = [
        [-9.0 - 0.4 * ((i + j) % 5) for j in range(len(ids))] for i, ids in enumerate(out["completion_ids"])
    ]
    return out


def _train(model_dir: Path, out: Path, from_loss: bool, **options: Any) -> tuple[Any, int]:
    """(trained trainer, forward passes made without grad)."""
    torch.manual_seed(0)
    trainer = qerl_trainer(
        model_dir, out, rewards=(spread_reward,), rollout_func=_rollout, is_ratio_from_loss_pass=from_loss, **options
    )
    calls = []
    real = trainer._get_per_token_logps_and_entropies

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted
    trainer.train()
    return trainer, calls.count(False)


MODES = {
    "token_truncate": dict(),
    "token_mask": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1e4),
    "sequence_truncate": dict(
        vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1e30
    ),
    "sequence_mask": dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1e30),
    "steps_per_generation_2": dict(
        steps_per_generation=2, gradient_accumulation_steps=2, per_device_train_batch_size=2
    ),
}


@pytest.mark.parametrize("name", list(MODES))
def test_ratio_from_the_loss_pass_trains_as_trls_pass(name: str, tiny_dense_dir: Path, tmp_path: Path) -> None:
    ours, extra = _train(tiny_dense_dir, tmp_path / "loss", True, **MODES[name])
    trl, passes = _train(tiny_dense_dir, tmp_path / "pass", False, **MODES[name])
    assert extra == 0 and passes > 0, (extra, passes)
    a, b = loss_logs(trl), loss_logs(ours)
    assert [r["step"] for r in b] == [1, 2]
    for t, o in zip(a, b, strict=True):
        assert math.isfinite(o["loss"]) and o["grad_norm"] > 0
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5, abs=1e-7)
        for key in (
            "sampling/sampling_logp_difference/mean",
            "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/max",
        ):
            assert o[key] == pytest.approx(t[key], rel=1e-5), key
    ratio = b[0]["sampling/importance_sampling_ratio/mean"]
    assert ratio != pytest.approx(1.0, abs=1e-3), ratio  # the correction did something
    final = dict(trl.model.named_parameters())
    for n, p in ours.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, final[n], rtol=1e-5, atol=1e-7, msg=n)


def test_unaligned_steps_keep_trls_pass(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """num_iterations 2 reuses a generation after an optimizer step: the old log-probs must come from their pass."""
    _, passes = _train(tiny_dense_dir, tmp_path, True, num_iterations=2)
    assert passes > 0


def test_rollout_ratio_by_hand() -> None:
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[-1.5, -1.0, float("nan")], [-1.0, -3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = rollout_ratio(train, sampling, mask, "token_truncate", None, 2.0)
    torch.testing.assert_close(token, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, 2.0, 1.0]]))
    masked = rollout_ratio(train, sampling, mask, "token_mask", 0.5, 2.0)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(0.5), 0.0, 1.0], [1.0, 0.0, 1.0]]))
    seq = rollout_ratio(train, sampling, mask, "sequence_truncate", None, 100.0)
    torch.testing.assert_close(seq, torch.tensor([[math.exp(-0.5)], [math.exp(2.0)]]))
    torch.testing.assert_close(
        rollout_ratio(train, sampling, mask, "sequence_mask", None, 5.0), torch.tensor([[math.exp(-0.5)], [0.0]])
    )
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        rollout_ratio(train, sampling, mask, "token", None, 2.0)
