"""Two GRPO steps of QeRLTrainer on a tiny NVFP4 Llama, for tests/test_ddp.py (one process, or one per
rank under ``accelerate launch``). Not a test module itself: the test runs it and reads its files.

    accelerate launch --config_file training/accelerate/ddp.yaml --cpu --num_processes 2 \\
        tests/ddp_grpo_worker.py MODEL_DIR OUT_DIR PER_DEVICE

Two runs, the same global batch (one prompt x 8 completions per step: with 2 ranks each rank holds
half of every group, as in the 7B recipe on 2 GPUs):

* ``engine``: the real native rollout engine, AQN on; records the LoRA/norm weights after 2 steps and
  each rank's prompts and completions;
* ``fixed``: completions that depend only on (prompt, row of the global batch), not on the number of
  processes, and no importance-sampling correction, so that the loss, the gradient norm and the
  weights after 2 steps can be compared with a 1-process run over the same global batch. Its KL term
  (beta 1, large enough to stand out of the fp32 rounding) makes the loss non-zero from step 2:
  on-policy with equal lengths, the policy term of GRPO is exactly zero (advantages have zero mean
  in each group);
* ``chunked``: ``fixed`` with each training pass in chunks of one row and no recompute
  (``qerl.train.chunked_pass``): all but the last chunk's backward outside DDP's all-reduce, trl's metrics
  gathered per chunk; compared with the same 1-process run.

Every completion has TOKENS tokens, so every rank holds the same number of tokens: bnpo (the recipes'
loss) normalises by the tokens of each rank's batch and DDP averages the ranks, which equals the
1-process token mean only then (as with gradient-accumulation micro-batches); ``dapo`` normalises by
the global token count and is invariant in general.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

STEPS, GROUP, TOKENS = 2, 8, 8


def varied_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Deterministic with spread within a group, so advantages and gradients are non-zero."""
    return [float(len(c[-1]["content"]) % 3) for c in completions]


def fixed_completion(prompt: list[int], row: int) -> list[int]:
    """TOKENS ids (no EOS) from the prompt and the row's index in the global generation batch."""
    h = sum(prompt) % 997
    return [(h + 37 * row + 11 * t) % 900 + 100 for t in range(TOKENS)]


def make_trainer(model_dir: str, out_dir: str, per_device: int, fixed: bool, chunk: int | None = None) -> Any:
    from qerl.hub import embedded_model_dir
    from qerl.load.loader import load_model, load_tokenizer
    from qerl.load.lora import lora_config
    from qerl.train.data import load_dataset
    from qerl.train.trainer import QeRLConfig, QeRLTrainer

    class FixedRollouts(QeRLTrainer):
        def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            # Rank r holds rows [r * len, (r + 1) * len) of the global batch (accelerate's sharding).
            first = self.accelerator.process_index * len(prompt_ids)
            ids = [fixed_completion(p, first + i) for i, p in enumerate(prompt_ids)]
            return ids, [[0.0] * TOKENS for _ in ids]

    config = QeRLConfig(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        num_generations=GROUP,
        max_completion_length=TOKENS,
        save_strategy="no",
        report_to=[],
        seed=0,
        num_stages=2,
        sigma_start=1e-2,
        sigma_end=1e-3,
        warmup_steps=0,
        learning_rate=1e-3,
        mask_truncated_completions=False,
        gradient_checkpointing=chunk is None,
        pass_chunk_rows=chunk,
        disable_tqdm=True,
        logging_steps=1,
        bf16=False,
        vllm_importance_sampling_correction=not fixed,
        beta=1.0 if fixed else 0.0,
    )
    torch.manual_seed(0)  # LoRA A's init: rank 0's is broadcast by DDP, and equals the 1-process run's
    model = load_model(model_dir, device=config.device, dtype=torch.float32)
    cls = FixedRollouts if fixed else QeRLTrainer
    return cls(
        model,
        [varied_reward],
        config,
        train_dataset=load_dataset("arithmetic", num_samples=32),
        processing_class=load_tokenizer(embedded_model_dir()),
        peft_config=lora_config(r=4, train_norms=True),
    )


def run(model_dir: str, out_dir: str, per_device: int, fixed: bool, chunk: int | None = None) -> dict[str, Any]:
    """Train STEPS steps (``chunk``: each pass in chunks of that many rows); return the logged losses and grad norms,
    the trainable weights, the passes run in chunks, and this process's prompts and completions."""
    trainer = make_trainer(model_dir, out_dir, per_device, fixed, chunk)
    logs: list[dict[str, float]] = []
    rollouts: list[tuple[list[list[int]], list[list[int]]]] = []

    log = trainer.log

    def keep_log(values: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in values:
            logs.append(dict(values))
        log(values, *args, **kwargs)

    trainer.log = keep_log
    generate = trainer._generate_single_turn

    def keep_rollout(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        ids, lps = generate(prompt_ids, *args, **kwargs)
        rollouts.append(([list(p) for p in prompt_ids], [list(c) for c in ids]))
        return ids, lps

    trainer._generate_single_turn = keep_rollout
    trainer.train()
    weights = {
        n: p.detach().cpu().clone()
        for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        if p.requires_grad
    }
    return {
        "losses": [v["loss"] for v in logs],
        "grad_norms": [v["grad_norm"] for v in logs],
        "weights": weights,
        "rollouts": rollouts,
        "chunk_passes": dict(trainer.chunk_passes),
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir, out_dir, per_device = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    for kind in ("engine", "fixed", "chunked"):
        result = run(model_dir, str(out_dir / kind), per_device, kind != "engine", 1 if kind == "chunked" else None)
        torch.save(result, out_dir / f"{kind}-rank{result['process_index']}.pt")
    from qerl.train.run import end_process_group

    end_process_group()  # as qerl.train.run does: no rank exits while another still uses the group
