"""Training through vLLM per family (issue 73): QeRLTrainer with ``rollout_engine="vllm"`` runs two GRPO steps on a
tiny NVFP4 Qwen3 and a tiny NVFP4 Llama 3 (``helpers.vllm_checkpoint``), rolling out from a colocated vLLM that
serves the checkpoint while the trainer holds the same weights: the adapter and norms are pushed before each step's
rollout, the loss is finite and the adapter moves (GPU + vLLM only).

Each family trains in a child process (one vLLM engine per process: vLLM does not free a second in-process engine
cleanly), driven as benchmarks.grpo_harness drives a step: 4 completions of 16 tokens, one micro-batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def train_two_steps(checkpoint: str, out_dir: str) -> dict[str, object]:
    """Two steps of QeRLTrainer on ``checkpoint`` with the vLLM engine (runs in the child process)."""
    from benchmarks import grpo_harness
    from qerl import load_model
    from qerl.rollout.vllm_engine import VLLMEngine

    pushes = []
    sync = VLLMEngine.sync
    VLLMEngine.sync = lambda self: pushes.append(1) or sync(self)  # count the pushes (this process only)
    model = load_model(checkpoint, load="nvfp4", device="cuda", dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    engine = {"checkpoint": checkpoint, "gpu_memory_utilization": 0.25, "max_model_len": 256, "enforce_eager": True}
    args = argparse.Namespace(
        local_n=4, n=4, micro_batch=4, tokens=16, lora_r=16, gradient_checkpointing="on",
        rollout_engine="vllm", rollout_engine_kwargs=engine,
    )  # fmt: skip
    prompt = {"prompt": " ".join(f"t{i}" for i in range(1, 9))}
    trainer = grpo_harness.make_trainer(model, grpo_harness.build_tokenizer(vocab), prompt, args, out_dir)
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    losses = [grpo_harness.run_step(trainer, [prompt] * 4, lambda phase: None)[0] for _ in range(2)]
    moved = sum(float((p.detach() - lora[n]).abs().max()) for n, p in trainer.model.named_parameters() if n in lora)
    return {
        "engine": type(trainer.rollout_engine()).__name__,
        "losses": losses,
        "pushes": len(pushes),
        "lora_moved": moved,
    }


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_two_steps_roll_out_through_vllm(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    pytest.importorskip("vllm")
    from helpers import vllm_checkpoint

    ckpt = vllm_checkpoint(tmp_path_factory, family)
    tmp = tmp_path_factory.mktemp(f"vllm-train-{family}")
    result = tmp / "result.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    cmd = [sys.executable, __file__, str(ckpt), str(tmp / "run"), str(result)]
    subprocess.run(cmd, check=True, timeout=900, env=env)
    got = json.loads(result.read_text())
    print(f"\n{family}: {got}")
    assert got["engine"] == "VLLMEngine" and all(math.isfinite(x) for x in got["losses"])
    assert got["pushes"] >= 2 and got["lora_moved"] > 0  # pushed before each step's rollout; the adapter trained


if __name__ == "__main__":  # the child process: train, write what the test checks
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    checkpoint, out_dir, result_path = sys.argv[1:4]
    Path(result_path).write_text(json.dumps(train_two_steps(checkpoint, out_dir)))
