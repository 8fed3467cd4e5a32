"""A two-turn "check your answer" rollout over qerl's engine, through trl's ``rollout_func`` contract.

Turn 1: the model answers the arithmetic question. Turn 2: the environment (this function) adds a user
message asking it to check the answer, and the model answers again. The completion trl trains on is
both turns with the inserted message between them; ``env_mask`` marks that message's tokens 0, so the
loss covers only what the model wrote, and the reward reads the last number of the whole completion (the
checked answer).

    python examples/check_answer_rollout.py --model-name smollm2-135m --max-steps 4 --output-dir runs/check

The rollout runs on ``trainer.rollout_engine()`` (qerl's native engine by default, with AQN's noise on,
as for any qerl rollout), with the run's sampling settings from ``trainer.sampling_params()``.
"""

from __future__ import annotations

import argparse
from typing import Any

from qerl.load.loader import load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.tasks.prompts import encode_chat
from qerl.train.rewards import last_number_accuracy
from qerl.trainer import QeRLConfig, QeRLTrainer

CHECK = "Check your answer. Reply with the final number only."
_SLOT = "\x00ANSWER\x00"


def turn_suffix(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """Token ids the chat template puts between an assistant answer and the next assistant turn's header:
    the end of the answer's turn, the CHECK message, the new header. Read off the template itself, so it
    holds for any chat model."""
    messages = [*conversation, {"role": "assistant", "content": _SLOT}, {"role": "user", "content": CHECK}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text.split(_SLOT, 1)[1], add_special_tokens=False)["input_ids"]


def check_answer_rollout(prompts: list[list[dict[str, str]]], trainer: QeRLTrainer) -> dict[str, list[list[Any]]]:
    """trl's ``rollout_func``: one two-turn completion per prompt (trl has already repeated each prompt
    ``num_generations`` times), with the sampling log-probs of the model's tokens (0 for inserted ones)."""
    tok, engine = trainer.processing_class, trainer.rollout_engine()
    stop = set(trainer.eos_token_ids)
    prompt_ids = [encode_chat(tok, p) for p in prompts]
    first = engine.generate(prompt_ids, trainer.sampling_params(), n=1)
    answers = [
        ids[:-1] if ids and ids[-1] in stop else ids for ids in first.completion_ids
    ]  # the template ends the turn
    inserted = [turn_suffix(tok, p) for p in prompts]
    second = engine.generate(
        [p + a + s for p, a, s in zip(prompt_ids, answers, inserted, strict=True)], trainer.sampling_params(), n=1
    )
    completion_ids, logprobs, env_mask = [], [], []
    for a, lp, s, b, lp2 in zip(answers, first.logprobs, inserted, second.completion_ids, second.logprobs, strict=True):
        completion_ids.append(a + s + b)
        logprobs.append(lp[: len(a)] + [0.0] * len(s) + lp2)
        env_mask.append([1] * len(a) + [0] * len(s) + [1] * len(b))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "env_mask": env_mask}


def build_trainer(
    model_name: str, config: QeRLConfig, train_dataset: Any, lora_rank: int = 8, rewards: list[Any] | None = None
) -> QeRLTrainer:
    """A QeRLTrainer that rolls out with ``check_answer_rollout`` and by default rewards the checked answer."""
    return QeRLTrainer(
        load_model(model_name),
        rewards or [last_number_accuracy],
        config,
        train_dataset=train_dataset,
        processing_class=load_tokenizer(model_name),
        peft_config=lora_config(r=lora_rank, train_norms=True),
        rollout_func=check_answer_rollout,
    )


def main(argv: list[str] | None = None) -> None:
    from qerl.train.data import load_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name", default="smollm2-135m")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="runs/check_answer")
    args = parser.parse_args(argv)
    config = QeRLConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=64,
        logging_steps=1,
        report_to=[],
        gradient_checkpointing=False,
    )
    build_trainer(args.model_name, config, load_dataset("arithmetic", num_samples=64, arithmetic_level="easy")).train()


if __name__ == "__main__":
    main()
