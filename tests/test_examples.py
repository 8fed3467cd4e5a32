"""examples/: the two-turn "check your answer" rollout (trl's rollout_func over qerl's engine) trains on CPU."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import torch

from qerl.train.data import load_dataset
from qerl.train.trainer import QeRLConfig

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "check_answer_rollout.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("check_answer_rollout", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A random tiny model never gets a sum right: a reward with spread gives the step a gradient."""
    return [float(len(c[-1]["content"]) % 3) for c in completions]


def test_two_turn_rollout_trains_and_masks_the_inserted_turn(tiny_dense_dir: Path, tmp_path: Path) -> None:
    example = _example()
    config = QeRLConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        gradient_checkpointing=False,
        learning_rate=1e-2,
        aqn=True,
        num_stages=2,
        seed=0,
    )
    torch.manual_seed(0)
    trainer = example.build_trainer(
        str(tiny_dense_dir), config, load_dataset("arithmetic", num_samples=8), lora_rank=2, rewards=[length_reward]
    )
    seen: list[dict[str, Any]] = []
    rollout = trainer.rollout_func

    def spy(prompts: list[Any], t: Any) -> dict[str, Any]:
        seen.append(rollout(prompts, t))
        return seen[-1]

    trainer.rollout_func = spy
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2] and all(math.isfinite(r["loss"]) for r in logs)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert logs[1]["aqn/sigma"] > 0  # the rollout ran under AQN like any qerl rollout
    tok = trainer.processing_class
    out = seen[0]
    for ids, mask, lps in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        assert len(ids) == len(mask) == len(lps)
        inserted = [t for t, m in zip(ids, mask, strict=True) if m == 0]
        assert example.CHECK in tok.decode(inserted)  # the environment's message, masked out of the loss
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        assert sum(mask) > 0
