"""Defaults and prompts follow the reference (issue 15, fidelity items; the reference's noise scheduler and the reference's prompt and reward code), on fixed
inputs: AQN on only for NVFP4 models with sigma 1e-2 -> 1e-4, one epoch and the scripts' completion
budgets, the GSM8K and DAPO prompts as the reference built them, ``--push_to_hub`` accepted but inert
without a token, and the held-out accuracy judged by evaluation's scorer. (The DAPO normaliser and the
BigMath reward are checked against the reference in test_rewards.py.)"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import Dataset
from tiny_models import make_tiny_chat_model

from qerl.load.loader import is_nvfp4_model, load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.tasks.data_sets import DEFAULT_COMPLETION_LENGTH
from qerl.tasks.prompts import TAG_SYSTEM_PROMPT
from qerl.train.aqn import AQNSchedule
from qerl.train.config import TRL_COMPLETION_LENGTH, QeRLConfig, with_model_defaults
from qerl.train.data import load_dataset
from qerl.train.run import heldout_accuracy, parse_args
from qerl.train.trainer import QeRLTrainer

SAMPLE = Path(__file__).parent / "data" / "gsm8k_train30.jsonl"


@pytest.fixture(scope="module")
def tiny_nvfp4_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny chat model quantized to NVFP4 (its tokenizer copied beside it)."""
    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("fidelity")
    src = make_tiny_chat_model(root / "dense", smollm2_dir)
    out = quantize_checkpoint(src, root / "nvfp4", backend="qerl")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not (out / name).exists():
            shutil.copy(src / name, out / name)
    return out


def _trainer(model_dir: Path, out: Path, **config: Any) -> QeRLTrainer:
    args = QeRLConfig(
        output_dir=str(out),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    return QeRLTrainer(
        model,
        [lambda completions, **kw: [0.0] * len(completions)],
        args,
        train_dataset=load_dataset("arithmetic", num_samples=4),
        processing_class=load_tokenizer(model_dir),
        peft_config=lora_config(r=2, train_norms=True),
    )


def test_aqn_is_on_by_default_for_nvfp4_models_only(tiny_nvfp4_dir: Path, tiny_dense_dir: Path, tmp_path: Path) -> None:
    """The reference switched its noise scheduler on only for NVFP4 models (the reference's training entry point)."""
    nvfp4 = _trainer(tiny_nvfp4_dir, tmp_path / "q")
    dense = _trainer(tiny_dense_dir, tmp_path / "d")
    assert is_nvfp4_model(nvfp4.model) and not is_nvfp4_model(dense.model)
    assert nvfp4.aqn is not None and nvfp4.args.aqn is True
    assert dense.aqn is None and dense.args.aqn is False and dense.current_sigma() == 0.0
    # The reference's schedule: 10 stages, sigma 1e-2 -> 1e-4 (the reference's noise scheduler).
    assert nvfp4.aqn.sigmas()[1:] == pytest.approx(
        [1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4], rel=2e-3
    )
    # The same defaults pick the reference's learning rates; an explicit choice wins on either model.
    assert (nvfp4.args.learning_rate, dense.args.learning_rate) == (1e-5, 5e-6)
    assert _trainer(tiny_dense_dir, tmp_path / "d2", aqn=True).aqn is not None
    assert _trainer(tiny_nvfp4_dir, tmp_path / "q2", aqn=False).aqn is None


def test_model_defaults_leave_the_callers_config_alone(tmp_path: Path) -> None:
    config = QeRLConfig(output_dir=str(tmp_path), report_to=[])
    filled = with_model_defaults(config, torch.nn.Linear(2, 2))
    assert (config.aqn, config.learning_rate, config.max_completion_length) == (None, None, None)
    assert (filled.aqn, filled.learning_rate, filled.max_completion_length) == (False, 5e-6, TRL_COMPLETION_LENGTH)


def test_config_defaults_are_trls_and_the_recipe_the_reference_scripts(tmp_path: Path) -> None:
    """QeRLConfig keeps trl's epochs (3); the reference recipe runs 1 epoch. AQN's own defaults are the reference's:
    sigma 1e-2 -> 1e-4 over 10 stages (its noise scheduler and run scripts)."""
    config = QeRLConfig(output_dir=str(tmp_path), report_to=[])
    assert (config.num_train_epochs, config.sigma_start, config.sigma_end, config.num_stages) == (3, 1e-2, 1e-4, 10)
    assert AQNSchedule().sigma_end == 1e-4
    _, recipe = parse_args(["--config", "training/recipes/qerl_nvfp4.yaml", "--output-dir", str(tmp_path)])
    assert (recipe.num_train_epochs, recipe.loss_type, recipe.epsilon_high, recipe.max_grad_norm) == (
        1,
        "bnpo",
        0.28,
        0.2,
    )


@pytest.mark.parametrize(
    "dataset,expected",
    [
        ("gsm8k", 2048),
        ("bigmath", 4096),
        ("bigmath_hard", 4096),
        ("dapomath", DEFAULT_COMPLETION_LENGTH),
        ("arithmetic", DEFAULT_COMPLETION_LENGTH),
    ],
)
def test_completion_length_follows_the_reference_scripts(dataset: str, expected: int, tmp_path: Path) -> None:
    """The scripts' presets by DATA_NAME: gsm8k 2048, bigmath 4096, anything else 8192. An explicit flag wins."""
    base = ["--dataset", dataset, "--output-dir", str(tmp_path), "--report-to", "none"]
    _, config = parse_args(base)
    assert config.max_completion_length == expected
    _, config = parse_args([*base, "--max-completion-length", "96"])
    assert config.max_completion_length == 96
    assert DEFAULT_COMPLETION_LENGTH == 8192


def test_gsm8k_and_dapo_prompts_as_the_reference_built_them(tmp_path: Path) -> None:
    """GSM8K: the question as the only (user) message. DAPO-Math: the row's own source_prompt. Ours
    (the tag instruction) only through --prompt-style."""
    question = json.loads(SAMPLE.read_text().splitlines()[0])["question"]
    assert load_dataset("gsm8k", str(SAMPLE))[0]["prompt"] == [{"role": "user", "content": question}]
    source = [
        {
            "role": "user",
            "content": "Solve the following math problem step by step. The last line of your response "
            "should be of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            'What is 6 * 7?\n\nRemember to put your answer on its own line after "Answer:".',
        }
    ]
    path = tmp_path / "dapo.jsonl"
    path.write_text(json.dumps({"prompt": "What is 6 * 7?", "solution": "42", "source_prompt": source}) + "\n")
    row = load_dataset("dapo-math", str(path))[0]
    assert row == {"prompt": source, "answer": "42"}
    tagged = load_dataset("dapo-math", str(path), style="tags")[0]["prompt"]
    assert tagged == [{"role": "system", "content": TAG_SYSTEM_PROMPT}, {"role": "user", "content": "What is 6 * 7?"}]
    script, _ = parse_args(
        ["--dataset", "gsm8k", "--prompt-style", "tags", "--output-dir", str(tmp_path), "--report-to", "none"]
    )
    assert script.prompt_style == "tags"


def _no_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def test_push_to_hub_is_accepted_and_inert_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing here may reach the network: without a token the flag is switched off with one note; with
    one it stays on (only the config is built, never a trainer that would create the repo)."""
    _no_token(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="qerl.train.config"):
        _, config = parse_args(["--push-to-hub", "True", "--output-dir", str(tmp_path / "run"), "--report-to", "none"])
    assert config.push_to_hub is False
    notes = [r.getMessage() for r in caplog.records if "push_to_hub" in r.getMessage()]
    assert len(notes) == 1 and "nothing will be uploaded" in notes[0] and str(tmp_path / "run") in notes[0]
    monkeypatch.setenv("HF_TOKEN", "hf_test_not_a_real_token")
    assert QeRLConfig(output_dir=str(tmp_path), report_to=[], push_to_hub=True).push_to_hub is True


class _ScriptedEngine:
    """Returns fixed completions, one per prompt, in order: the held-out loop's only model call."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts: list[list[int]], params: Any, n: int) -> Any:
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in self.texts[: len(prompts)]]
        self.texts = self.texts[len(prompts) :]
        return SimpleNamespace(completion_ids=ids)


def test_heldout_accuracy_is_judged_by_the_evaluation_scorer(smollm2_dir: Path) -> None:
    """Issue 15 item 3: held-out accuracy scores with eval's reading, not with 'reward > 0'. The shaped
    closeness reward is positive for every near miss below; the accuracy counts only the right answers."""
    from qerl.train.rewards import last_number_closeness

    tok = load_tokenizer(smollm2_dir)
    rows = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)],
            "answer": ["72", "40", "15", "-8"],
        }
    )
    texts = ["The answer is 72.", "#### 41", "<answer>15</answer>", "so -9"]
    modes: list[str] = []

    @contextmanager
    def inference_mode():  # the trainer's toggle (qerl.train.rollout_hooks), seen entered and left
        modes.append("eval")
        yield True
        modes.append("train")

    trainer = SimpleNamespace(
        processing_class=tok,
        rollout_engine=lambda: _ScriptedEngine(tok, texts),
        inference_mode=inference_mode,
        eos_token_ids=[2],
    )
    assert all(r > 0 for r in last_number_closeness(texts, answer=rows["answer"]))
    assert heldout_accuracy(trainer, rows, "numeric", max_new_tokens=8) == 0.5
    assert modes == ["eval", "train"]  # the greedy pass ran under the trainer's toggle


# --- the held-out measure --------------------------------------------------------------------------------------------


def test_heldout_evaluation_uses_the_trainers_inference_toggle(monkeypatch) -> None:
    """heldout_accuracy re-implemented the trainer's eval-mode toggle; it now runs under ``trainer.inference_mode``
    (eval mode and no autograd, restored after), without the rollouts' AQN noise."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from datasets import Dataset

    from qerl.train.run import heldout_accuracy

    entered: list[bool] = []

    @contextmanager
    def inference_mode():
        entered.append(True)
        yield False

    engine = SimpleNamespace(generate=lambda ids, params, n: SimpleNamespace(completion_ids=[[5]] * len(ids)))
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["#### 5"] * len(ids))
    trainer = SimpleNamespace(
        processing_class=tokenizer, rollout_engine=lambda: engine, eos_token_ids=[2], inference_mode=inference_mode
    )
    monkeypatch.setattr("qerl.train.run.encode_chat", lambda tok, messages: [1, 2, 3])
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"}] * 3)
    assert heldout_accuracy(trainer, rows, "numeric", 8) == 1.0 and entered == [True]
