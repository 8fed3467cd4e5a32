"""QeRLTrainer as a drop-in for trl's GRPOTrainer (issue 54): every trl option it accepts behaves as in trl.

A tiny random chat model on CPU, 1-2 steps each. Where a quantity can be computed independently (the loss
and gradient norm of a step on fixed tokens and rewards), it is compared with trl's own GRPOTrainer on the
same bf16 model: both trainers get their completions from the same ``rollout_func``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in trl 1.16: said once, here
from datasets import Dataset
from helpers import (
    arithmetic_rows,
    fixed_rollout,
    loss_logs,
    qerl_trainer,
    spread_reward,
    trl_settings,
)
from trl import GRPOConfig, GRPOTrainer

from qerl.load.loader import load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.train.trainer import QeRLConfig, QeRLTrainer


def alternating_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """0, 1, 0, 1, ... down the batch: trl keeps each group's completions adjacent, so every group has spread
    whatever was sampled (a sampled reward can tie inside every group of a one-step run and train nothing)."""
    return [float(i % 2) for i in range(len(completions))]


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _moved(trainer: Any, before: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------- trl's own numbers

SAME_AS_TRL = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "scale_batch_delta_clip_high": dict(scale_rewards="batch", delta=1.5, epsilon_high=0.28),
    "scale_none_top_entropy": dict(scale_rewards="none", top_entropy_quantile=0.5),
    "beta_ref_adapter_off": dict(beta=0.1),
    "entropy_bonus": dict(entropy_coef=0.05),
    "sequence_is": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "mask_truncated": dict(mask_truncated_completions=True),
}


@pytest.mark.parametrize("name", list(SAME_AS_TRL))
def test_two_steps_match_trls_own_trainer(name: str, tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Same bf16 model, tokens, rewards and seed: the loss and gradient norm of both steps, the logged keys
    and the trained weights are trl's. (IS correction off: trl applies it only with its vLLM engine.) Masked
    (truncated) completions pad the batch, and our pass then runs unmasked on shifted rows (qerl.train.aligned_rows):
    another SDPA kernel than trl's masked one, whose bf16 rounds differently (grad norm 1.3e-4 apart at step 1,
    1.1e-3 at step 2); that case runs in fp32, where it is trl's within the same bounds."""
    options = SAME_AS_TRL[name]
    dtype = torch.float32 if options.get("mask_truncated_completions") else torch.bfloat16
    torch.manual_seed(0)
    theirs = GRPOTrainer(
        load_model(tiny_dense_dir, device="cpu", dtype=dtype),
        [spread_reward],
        GRPOConfig(**trl_settings(tmp_path / "trl", **options)),
        train_dataset=arithmetic_rows(),
        processing_class=load_tokenizer(tiny_dense_dir),
        peft_config=lora_config(r=2),
        rollout_func=fixed_rollout,
    )
    theirs.train()
    torch.manual_seed(0)
    ours = qerl_trainer(
        tiny_dense_dir,
        tmp_path / "qerl",
        dtype=dtype,
        rollout_func=fixed_rollout,
        vllm_importance_sampling_correction=False,
        **options,
    )
    ours.train()
    a, b = loss_logs(theirs), loss_logs(ours)
    assert [r["step"] for r in b] == [1, 2]
    for t, o in zip(a, b, strict=True):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4, abs=1e-7)
        assert set(t) <= set(o), sorted(set(t) - set(o))
    assert any(r["grad_norm"] > 0 for r in b)
    final = dict(theirs.model.named_parameters())
    for n, p in ours.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, final[n], rtol=1e-4, atol=1e-6, msg=n)


# ---------------------------------------------------------------------------------------- option families

TRAINS = {
    "num_iterations": dict(num_iterations=2),
    "steps_per_generation": dict(steps_per_generation=2, per_device_train_batch_size=2),
    "adaptive_entropy": dict(use_adaptive_entropy=True),
    "off_policy_mask": dict(off_policy_mask_threshold=0.5),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "min_p_repetition_penalty": dict(min_p=0.05, repetition_penalty=1.3),
    "generation_kwargs": dict(generation_kwargs={"min_tokens": 3, "ignore_eos": True}),
}
#: What trl logs for each family besides the common keys.
KEYS = {
    "adaptive_entropy": {"entropy_coef", "policy_loss"},
    "off_policy_mask": set(),
    "luspo": {"clip_ratio/region_mean"},
}


@pytest.mark.parametrize("name", list(TRAINS))
def test_option_trains_with_our_engine(name: str, tiny_dense_dir: Path, tmp_path: Path) -> None:
    """With the native engine sampling: the step trains, trl's keys are logged under trl's names."""
    steps = 2 if name in ("num_iterations", "steps_per_generation") else 1  # options that act across steps
    trainer = qerl_trainer(tiny_dense_dir, tmp_path, rewards=(alternating_reward,), max_steps=steps, **TRAINS[name])
    before = _params(trainer)
    trainer.train()
    logs = loss_logs(trainer)
    assert [r["step"] for r in logs] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in logs)
    assert _moved(trainer, before)
    for key in {
        "reward",
        "reward_std",
        "rewards/alternating_reward/mean",
        "entropy",
        "completions/mean_length",
        "sampling/importance_sampling_ratio/mean",
        *KEYS.get(name, ()),
    }:
        assert key in logs[0], key


def test_generation_kwargs_are_honoured(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """min_tokens keeps EOS out of the first tokens, ignore_eos drops it as a stop token."""
    trainer = qerl_trainer(tiny_dense_dir, tmp_path, generation_kwargs={"min_tokens": 3, "ignore_eos": True}, min_p=0.1)
    params = trainer.sampling_params()
    assert (params.min_tokens, params.stop_token_ids, params.min_p) == (3, [], 0.1)
    assert trainer.sampling_params(max_new_tokens=5).max_new_tokens == 5
    plain = qerl_trainer(tiny_dense_dir, tmp_path / "plain").sampling_params()
    assert plain.stop_token_ids == list(trainer.eos_token_ids) and plain.min_tokens == 0


def test_unsupported_generation_kwargs_and_tools_are_refused_in_one_line(tiny_dense_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--generation_kwargs key 'typical_p' is not supported"):
        qerl_trainer(tiny_dense_dir, tmp_path, generation_kwargs={"typical_p": 0.9})
    with pytest.raises(ValueError, match="tools is not supported"):
        model = load_model(tiny_dense_dir, device="cpu", dtype=torch.float32)
        QeRLTrainer(
            model,
            [spread_reward],
            QeRLConfig(**trl_settings(tmp_path)),
            train_dataset=arithmetic_rows(),
            processing_class=load_tokenizer(tiny_dense_dir),
            tools=[len],
        )


def test_iterable_and_plain_text_datasets(tiny_dense_dir: Path, tmp_path: Path) -> None:
    for i, dataset in enumerate(
        (arithmetic_rows().to_iterable_dataset(), Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "7-2="]}))
    ):
        trainer = qerl_trainer(tiny_dense_dir, tmp_path / str(i), dataset=dataset)
        before = _params(trainer)
        trainer.train()
        assert [r["step"] for r in loss_logs(trainer)] == [1, 2] and _moved(trainer, before)


# ---------------------------------------------------------------------------------------- rewards


async def async_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [float(len(c[-1]["content"]) % 3) + (0.5 if a else 0.0) for c, a in zip(completions, answer, strict=True)]


def none_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [None] * len(completions)


def test_rewards_as_trl_calls_them(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """async reward (with a dataset column as a keyword), a None reward and reward weights, all at once."""
    trainer = qerl_trainer(
        tiny_dense_dir, tmp_path, rewards=(async_reward, none_reward, spread_reward), reward_weights=[1.0, 1.0, 0.5]
    )
    trainer.train()
    first = loss_logs(trainer)[0]
    assert math.isfinite(first["rewards/async_reward/mean"]) and first["rewards/none_reward/mean"] is None
    assert "reward" in first and math.isfinite(first["reward"])


def test_a_reward_model_scores_as_in_trl(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """A sequence-classification model as a reward function (trl's reward-model path: its own tokenizer, the
    completion scored as text), beside a plain function: both logged under trl's names, and the step trains."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_dense_dir, num_labels=1)
    torch.manual_seed(0)
    scorer = AutoModelForSequenceClassification.from_config(config)
    scorer.config._name_or_path = "tiny-scorer"
    trainer = qerl_trainer(
        tiny_dense_dir,
        tmp_path,
        rewards=(scorer, spread_reward),
        reward_processing_classes=[load_tokenizer(tiny_dense_dir), None],
    )
    before = _params(trainer)
    trainer.train()
    first = loss_logs(trainer)[0]
    assert math.isfinite(first["rewards/tiny-scorer/mean"]) and first["rewards/tiny-scorer/std"] > 0
    assert math.isfinite(first["rewards/spread_reward/mean"]) and _moved(trainer, before)


def test_a_users_raising_reward_fails_the_step(tiny_dense_dir: Path, tmp_path: Path) -> None:
    def broken(completions: list[Any], **kwargs: Any) -> list[float]:
        raise KeyError("missing column")

    trainer = qerl_trainer(tiny_dense_dir, tmp_path, rewards=(broken,))
    with pytest.raises(KeyError, match="missing column"):
        trainer.train()


def test_builtin_rewards_log_their_parser_errors(tiny_dense_dir: Path, tmp_path: Path) -> None:
    from qerl.train.rewards import get_rewards

    trainer = qerl_trainer(tiny_dense_dir, tmp_path, rewards=get_rewards(["gsm8k", "soft_format"]), max_steps=1)
    trainer.train()
    first = loss_logs(trainer)[0]
    assert first["rewards/gsm8k_accuracy/errors"] == 0.0 and first["rewards/soft_format_reward/errors"] == 0.0


# ---------------------------------------------------------------------------------------- config


def test_args_none_builds_trls_default_config(
    tiny_dense_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    model = load_model(tiny_dense_dir, device="cpu", dtype=torch.float32)
    trainer = QeRLTrainer(
        model, [spread_reward], None, train_dataset=arithmetic_rows(), processing_class=load_tokenizer(tiny_dense_dir)
    )
    assert isinstance(trainer.args, QeRLConfig) and trainer.args.output_dir.endswith(f"{tiny_dense_dir.name}-GRPO")
    assert (trainer.args.loss_type, trainer.args.num_train_epochs, trainer.max_completion_length) == ("dapo", 3, 512)


def test_startup_logs_every_field_that_differs_from_trl(
    tiny_dense_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="qerl.train.trainer"):
        qerl_trainer(tiny_dense_dir, tmp_path, loss_type="bnpo")
    lines = [r.getMessage() for r in caplog.records if "differ from trl's GRPOConfig defaults" in r.getMessage()]
    assert len(lines) == 1
    for part in (
        "loss_type='bnpo' (trl: 'dapo')",
        "vllm_importance_sampling_mode='token_truncate' (trl: 'sequence_mask')",
        "learning_rate=0.01 (trl: 1e-06)",
        "max_steps=2 (trl: -1)",
    ):
        assert part in lines[0], part
    assert "num_train_epochs" not in lines[0] and "weight_decay" not in lines[0]
