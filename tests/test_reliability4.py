"""Reliability of training on hostile input (issue 60, training side): one test per class of defect, each seen
to fail before its fix. Tiny random dense model with SmolLM2's tokenizer, 2-3 steps: a few seconds per run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qerl.cli import run
from qerl.train.run import main

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def narrow_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny chat Llama of another width than ``tiny_dense_dir``'s: its adapters do not fit that model."""
    from tiny_models import _copy_tokenizer, make_tiny_llama

    out = tmp_path_factory.mktemp("narrow") / "narrow"
    return _copy_tokenizer(smollm2_dir, make_tiny_llama(out, hidden=32, vocab=49152, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dense_dir: Path) -> Path:
    """A finished 2-step run with checkpoints 1 and 2 (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    main(_argv(tiny_dense_dir, out, steps=2))
    return out


def _argv(model: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    return [
        "--model-name",
        str(model),
        "--dataset",
        "arithmetic",
        "--num-samples",
        "12",
        "--lora-rank",
        "2",
        "--max-steps",
        str(steps),
        "--save-steps",
        "1",
        "--per-device-train-batch-size",
        "2",
        "--num-generations",
        "2",
        "--max-completion-length",
        "4",
        "--output-dir",
        str(out),
        "--report-to",
        "none",
        "--disable-tqdm",
        "True",
        "--plot",
        "False",
        "--seed",
        "0",
        "--logging-steps",
        "1",
        *extra,
    ]


def _one_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


# --- resume -------------------------------------------------------------------------------------------------


def test_forced_resume_with_another_model_leaves_the_record_alone(
    trained: Path, narrow_dir: Path, tmp_path: Path, capsys
) -> None:
    """--resume force with a model the checkpoint does not fit rewrote run_config.json, then failed (a traceback):
    the original run then refused to resume. Now: one line, and the record is the original run's."""
    out = _copy(trained, tmp_path)
    record = (out / "run_config.json").read_bytes()
    capsys.readouterr()
    line = _one_error(run(main, _argv(narrow_dir, out, "--resume", "force", steps=3)), capsys.readouterr().err)
    assert str(out / "checkpoint-2") in line and "shape" in line, line
    assert (out / "run_config.json").read_bytes() == record
    assert not (out / "checkpoint-3").exists()


def _nan_in_optimizer(ckpt: Path) -> None:
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    next(iter(state["state"].values()))["exp_avg_sq"].view(-1)[0] = float("nan")
    torch.save(state, ckpt / "optimizer.pt")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, file",
    [
        (_nan_in_optimizer, "optimizer.pt"),
        (lambda ckpt: _truncate(ckpt / "optimizer.pt"), "optimizer.pt"),
        (lambda ckpt: _truncate(ckpt / "trainer_state.json"), "trainer_state.json"),
        (lambda ckpt: _truncate(ckpt / "adapter_model.safetensors"), "adapter_model.safetensors"),
        (lambda ckpt: _truncate(ckpt / "scheduler.pt"), "scheduler.pt"),
    ],
)
def test_damaged_checkpoint_is_refused_and_the_previous_one_offered(
    trained: Path, tiny_dense_dir: Path, tmp_path: Path, capsys, damage, file: str
) -> None:
    """One NaN in the optimizer state gave rc 0 and an all-NaN adapter; a truncated file gave a traceback. Now the
    whole checkpoint is checked: one line naming the file and the previous checkpoint, nothing changed; with
    --damaged_checkpoint previous the damaged one is moved aside and the run resumes from the one before."""
    out = _copy(trained, tmp_path)
    damage(out / "checkpoint-2")
    record = (out / "run_config.json").read_bytes()
    capsys.readouterr()
    line = _one_error(run(main, _argv(tiny_dense_dir, out, steps=3)), capsys.readouterr().err)
    assert str(out / "checkpoint-2" / file) in line and "--damaged_checkpoint previous" in line, line
    assert "checkpoint-1" in line, line
    assert (out / "run_config.json").read_bytes() == record and not (out / "checkpoint-3").exists()

    summary = main(_argv(tiny_dense_dir, out, "--damaged_checkpoint", "previous", steps=3))
    assert summary["global_step"] == 3 and list(out.glob(".damaged-checkpoint-2-*"))
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


# --- recipes ------------------------------------------------------------------------------------------------

RECIPE = Path(__file__).resolve().parents[1] / "training" / "recipes" / "quickstart.yaml"
BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "rewards: *i\n"
)


@pytest.mark.parametrize(
    "text, key",
    [
        ("max_steps: 2.5\n", "max_steps"),
        ("num_generations: 0\n", "num_generations"),
        ("per_device_train_batch_size: 0\n", "per_device_train_batch_size"),
        ("temperature: 0\n", "temperature"),
        ("temperature: -1\n", "temperature"),
        ("rewards: 5\n", "rewards"),
        ("lora_rank: [1, 2]\n", "lora_rank"),
        ("lora_rank: 4\nlora_rank: 8\n", "lora_rank"),
        (BOMB, "aliases"),
    ],
)
def test_recipe_values_that_would_fail_later_are_refused_in_one_line(
    tmp_path: Path, capsys, text: str, key: str
) -> None:
    """An alias bomb was OOM-killed; these values passed the parser and crashed later with a traceback (or, for
    per-device batch 0 and temperature 0 / -1, were accepted); a duplicate key silently won. Each is one line
    naming the file (or the flag) and the key, before anything is loaded."""
    from qerl.train.run import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    capsys.readouterr()
    line = _one_error(
        run(parse_args, ["--config", str(recipe), "--output_dir", str(tmp_path / "out")]), capsys.readouterr().err
    )
    assert key in line and (str(recipe) in line or f"--{key}" in line), line


def test_a_recipe_in_use_still_parses(tmp_path: Path) -> None:
    """The checks refuse nothing the committed recipes say (strings for numbers included: the parser converts)."""
    from qerl.train.run import parse_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.read_text() + "warmup_ratio: '0.1'\n")
    script, config = parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert (script.lora_rank, config.max_steps, config.warmup_ratio) == (8, 8, 0.1)


# --- bounded inputs and one-line errors ---------------------------------------------------------------------

QUESTIONS = [f"What is {a} + {b}?" for a in range(1, 4) for b in range(1, 5)]


def _data(tmp_path: Path, questions: list[str]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n" for q in questions))
    return path


def _gsm8k_argv(model: Path, out: Path, data: Path, *extra: str) -> list[str]:
    argv = _argv(model, out, "--dataset_path", str(data), *extra, steps=1)
    argv[argv.index("arithmetic")] = "gsm8k"
    i = argv.index("--num-samples")
    return argv[:i] + argv[i + 2 :]


def test_training_prompts_are_bounded_without_max_prompt_length(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Without --max_prompt_length nothing bounded a prompt (four 64 KB questions ran to an OOM kill): by default a
    prompt must fit the model's context (2048 positions here) less the completion budget, and longer ones are
    dropped, as --max_prompt_length drops them."""
    huge = "1 + 1 = ? " * 600  # about 3,600 tokens: past the tiny model's 2,048 positions
    data = _data(tmp_path, QUESTIONS + [huge])
    summary = main(_gsm8k_argv(tiny_dense_dir, tmp_path / "run", data))
    assert summary["train_rows"] == len(QUESTIONS)
    from qerl.train.run import DEFAULT_MAX_PROMPT_TOKENS, ScriptArguments, prompt_budget

    config = type("Config", (), {"max_completion_length": 4})()
    assert prompt_budget(ScriptArguments(model_name=str(tiny_dense_dir)), config) == 2044 < DEFAULT_MAX_PROMPT_TOKENS


def test_model_without_a_chat_template_is_one_line_and_leaves_nothing(
    tiny_dense_dir: Path, tmp_path: Path, capsys
) -> None:
    """A 32-line traceback, and files left in the output directory; now one line naming the model, no output."""
    model = tmp_path / "plain"
    shutil.copytree(tiny_dense_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    capsys.readouterr()
    line = _one_error(run(main, _argv(model, out)), capsys.readouterr().err)
    assert f"--model_name {model}" in line and "chat template" in line, line
    assert not out.exists() or not any(out.iterdir())


def test_training_data_that_is_not_utf8_is_one_line_naming_the_file(
    tiny_dense_dir: Path, tmp_path: Path, capsys
) -> None:
    data = _data(tmp_path, QUESTIONS)
    data.write_bytes(data.read_bytes() + b'{"question": "What is \xff?", "answer": "#### 1"}\n')
    capsys.readouterr()
    line = _one_error(run(main, _gsm8k_argv(tiny_dense_dir, tmp_path / "run", data)), capsys.readouterr().err)
    assert f"--dataset_path {data}" in line and "UTF-8" in line, line


# --- schedules ----------------------------------------------------------------------------------------------


def test_extending_max_steps_replans_the_learning_rate(
    trained: Path, tiny_dense_dir: Path, tmp_path: Path, caplog
) -> None:
    """A 2-step run's linear schedule ends at learning rate 0, and the optimizer file keeps that rate: extended to 4
    steps, its first new step ran at 0. The schedule is re-planned to the new end (one log line): steps 3 and 4 run
    at the rates of a 4-step plan at those steps (the dense model's default rate x 2/4, x 1/4)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from qerl.train.config import LR_BF16

    out = _copy(trained, tmp_path)
    rates: list[float] = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: rates.append(optimizer.param_groups[0]["lr"])
    )
    try:
        main(_argv(tiny_dense_dir, out, steps=4))
    finally:
        hook.remove()
    assert rates == pytest.approx([LR_BF16 * 2 / 4, LR_BF16 * 1 / 4])
    assert "re-planned to end at step 4" in caplog.text


# --- structure (issue 62) -----------------------------------------------------------------------------------


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
