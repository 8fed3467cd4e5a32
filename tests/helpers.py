"""What several test modules share, besides fixtures (``conftest.py``) and the tiny models (``tiny_models.py``).

* Commands on hostile input: the one ``error:`` line a refusal prints (:func:`one_error`), an evaluation's arguments
  (:func:`eval_argv`, :data:`EVAL_FLAGS`, :data:`GOOD`), an export (:func:`run_export`), a data file
  (:func:`data_file`), a model whose config.json says something else (:func:`with_config`), a command in a child
  process of bounded memory (:func:`run_module`).
* Training runs: a tiny run's arguments (:func:`train_argv`) and a copy of a finished run (:func:`copy_run`).
* The trl drop-in: our trainer on a tiny model with trl's settings (:func:`qerl_trainer`, :func:`trl_settings`), its
  rewards and rollouts (:func:`spread_reward`, :func:`fixed_rollout`), its loss logs (:func:`loss_logs`).
* vLLM: the checkpoint the GPU tests serve (:func:`vllm_checkpoint`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: One GSM8K-style record an evaluation scores.
GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
#: An evaluation of a tiny model in about a second: transformers' engine, fp32 on the CPU, three greedy tokens.
EVAL_FLAGS = ["--engine", "hf", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3", "--temperature", "0"]
#: The address space a child gets: /dev/zero read whole fails there at once, not at the machine's end.
CHILD_MEMORY = 6 << 30
#: Completions per prompt in the trl drop-in's runs.
GROUP = 2


def one_error(code: int, err: str) -> str:
    """The one ``error:`` line of a command that refused its input (exit status 2, no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def data_file(tmp_path: Path, rows: list[dict]) -> Path:
    """``tmp_path/d.jsonl`` holding ``rows``."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def with_config(model: Path, out: Path, **changes: object) -> Path:
    """A copy of ``model`` whose config.json has ``changes``."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def eval_argv(model: Path, tmp_path: Path, *flags: str) -> list[str]:
    """``eval.gsm8k``'s arguments for one question on ``model`` into ``tmp_path/r.jsonl``."""
    out = tmp_path / "r.jsonl"
    return [
        "--model",
        str(model),
        "--data",
        str(data_file(tmp_path, [GOOD])),
        "--output",
        str(out),
        *EVAL_FLAGS,
        *flags,
    ]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def run_module(argv: list[str], tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    """``python -m ARGV`` in a child of :data:`CHILD_MEMORY` bytes (a hang inside a regular expression or a blocking
    open cannot be interrupted from inside); the test fails if it still runs after ``timeout``."""
    env = {**os.environ, "QERL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    how = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": timeout, "preexec_fn": _limited}
    try:
        done = subprocess.run([sys.executable, "-m", *argv], **how)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m {argv[0]} still ran after {timeout} s")
    return done.returncode, done.stderr


def run_export(
    merge: dict[str, Path], output: Path, capsys: pytest.CaptureFixture, *flags: str, model: Path | None = None
) -> tuple[int, str]:
    """``python -m qerl.export`` of ``merge``'s adapter (on ``model`` when given, else its model) into ``output``:
    (exit status, stderr)."""
    from qerl import export

    code = export.main(
        ["--model", str(model or merge["model"]), "--lora", str(merge["adapter"]), "--output", str(output), *flags]
    )
    return code, capsys.readouterr().err


def train_argv(model: Path, out: Path, *extra: str, steps: int = 2, save_steps: int = 1) -> list[str]:
    """``python -m qerl.train``'s arguments for a tiny run: 12 arithmetic rows, LoRA rank 2, 2 completions of 4
    tokens per prompt, a checkpoint every ``save_steps``, no plots or reports."""
    return [
        "--model-name", str(model), "--dataset", "arithmetic", "--num-samples", "12", "--lora-rank", "2",
        "--max-steps", str(steps), "--save-steps", str(save_steps), "--per-device-train-batch-size", "2",
        "--num-generations", "2", "--max-completion-length", "4", "--output-dir", str(out), "--report-to", "none",
        "--disable-tqdm", "True", "--plot", "False", "--seed", "0", "--logging-steps", "1", *extra,
    ]  # fmt: skip


def copy_run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run directory ``trained`` as ``tmp_path/run``, for a test that changes it."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def spread_reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Deterministic, with spread inside each group, so that advantages (and gradients) are non-zero."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def fixed_rollout(prompts: list[Any], trainer: Any) -> dict[str, list[list[Any]]]:
    """The same tokens for trl's trainer and ours: prompt i gets completion i (some end in EOS id 2)."""
    prompt_ids = [[1, 9690, 314, 216, 28 + i % 4, 2, 198] for i in range(len(prompts))]
    completion_ids = [
        [30 + (7 * i) % 11, 40 + i, 50 + (3 * i) % 5, 60, 2 if i % 3 else 61] for i in range(len(prompts))
    ]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[-1.0] * 5 for _ in prompts]}


def trl_settings(out: Path, **overrides: Any) -> dict[str, Any]:
    """The config both trl's trainer and ours take in the drop-in's tests: 2 steps of 4 completions on the CPU."""
    return {
        **dict(
            output_dir=str(out),
            max_steps=2,
            per_device_train_batch_size=4,
            num_generations=GROUP,
            max_completion_length=8,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            gradient_checkpointing=False,
            learning_rate=1e-2,
            bf16=False,
            use_cpu=True,
            seed=0,
        ),
        **overrides,
    }


def arithmetic_rows() -> Any:
    """Eight rows of the generated arithmetic set."""
    from qerl.train.data import load_dataset

    return load_dataset("arithmetic", num_samples=8)


def loss_logs(trainer: Any) -> list[dict[str, Any]]:
    """The log rows of a trainer's steps (those with a loss)."""
    return [r for r in trainer.state.log_history if "loss" in r]


def qerl_trainer(
    model_dir: Path,
    out: Path,
    rewards: Any = (spread_reward,),
    dtype: torch.dtype = torch.float32,
    dataset: Any = None,
    **config: Any,
) -> Any:
    """Our trainer on ``model_dir`` with :func:`trl_settings` and ``config``, LoRA rank 2."""
    from qerl.load.loader import load_model, load_tokenizer
    from qerl.load.lora import lora_config
    from qerl.train.trainer import QeRLConfig, QeRLTrainer

    kwargs = {k: config.pop(k) for k in ("rollout_func", "reward_processing_classes") if k in config}
    model = load_model(model_dir, device="cpu", dtype=dtype)
    return QeRLTrainer(
        model,
        list(rewards),
        QeRLConfig(**trl_settings(out, **config)),
        train_dataset=arithmetic_rows() if dataset is None else dataset,
        processing_class=load_tokenizer(model_dir),
        peft_config=lora_config(r=2),
        **kwargs,
    )


def vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory, family: str = "llama") -> Path:
    """The NVFP4A16 checkpoint the vLLM tests serve: ``QERL_VLLM_TEST_CKPT``, else a tiny Llama quantized here; for
    another ``family`` (``tiny_models.FAMILY_CONFIGS``: llama3, qwen3, mistral) a tiny model of it, always."""
    env = os.environ.get("QERL_VLLM_TEST_CKPT")
    if env and family == "llama":
        path = Path(env)
        if not (path / "config.json").exists():
            pytest.fail(f"QERL_VLLM_TEST_CKPT={env}: no config.json there; expected an NVFP4A16 checkpoint dir")
        return path
    from tiny_models import make_tiny_family, make_tiny_llama

    from qerl.quantize.pipeline import quantize_checkpoint

    # head_dim 64 (hidden 256 / 4 heads; Qwen3's set to it): a FlashAttention size; Marlin pads the small GEMMs.
    sizes = dict(hidden_size=256, intermediate_size=512, vocab_size=1024)
    out = tmp_path_factory.mktemp(f"tiny-{family}") / "bf16"
    if family == "llama":
        src = make_tiny_llama(out, hidden=256, intermediate=512, vocab=1024)
    else:
        src = make_tiny_family(out, family, **sizes, **({"head_dim": 64} if family == "qwen3" else {}))
    return quantize_checkpoint(src, tmp_path_factory.mktemp(f"tiny-{family}") / "nvfp4", backend="qerl")
