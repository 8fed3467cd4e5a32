"""The shipped recipes parse into QeRLConfig and only name logging integrations that are installed, and a recipe's
values are held to their fields' types and ranges before trl reads it (``qerl.train.recipe``).

Why: the quickstart recipe reports to tensorboard; when tensorboard was missing from the
dependencies, `bash setup_env.sh && bash training/quickstart.sh` (the README's main job) died at
trainer construction in a fresh clone while every other test passed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from helpers import one_error
from transformers.integrations import get_available_reporting_integrations

from qerl.cli import run
from qerl.train.trainer import QeRLConfig

RECIPES = sorted((Path(__file__).resolve().parents[1] / "training" / "recipes").glob("*.yaml"))
RECIPE = Path(__file__).resolve().parents[1] / "training" / "recipes" / "quickstart.yaml"


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "qerl_nvfp4.yaml", "lora_bf16.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_reports_only_to_installed_integrations(recipe: Path, tmp_path: Path) -> None:
    values = yaml.safe_load(recipe.read_text())
    report_to = values.get("report_to", [])
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    missing = [
        name for name in report_to if name not in ("none", "all") and name not in get_available_reporting_integrations()
    ]
    assert not missing, f"{recipe.name}: report_to names {missing}, not installed"
    fields = set(QeRLConfig.__dataclass_fields__)
    config = QeRLConfig(output_dir=str(tmp_path), **{k: v for k, v in values.items() if k in fields})
    assert config.report_to == report_to


def test_the_readme_train_example_parses_without_bitsandbytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53: the README's train command names a recipe with ``optim: adamw_8bit``; on an install without
    bitsandbytes (setup_env.sh adds it on CUDA machines only) it stopped with ``needs bitsandbytes``. It
    must run, on 32-bit AdamW, with the recipe's other settings intact."""
    from qerl.train.run import parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    recipe = Path(__file__).resolve().parents[1] / "training" / "recipes" / "qerl_nvfp4.yaml"
    script, config = parse_args(
        [
            "--config",
            str(recipe),
            "--model-name",
            "qmodel/Qwen2.5-7B-Instruct-NVFP4A16",
            "--dataset",
            "gsm8k",
            "--lora-rank",
            "16",
            "--ln",
            "True",
            "--sigma-start",
            "1e-2",
            "--sigma-end",
            "1e-4",
            "--num-stages",
            "10",
            "--output-dir",
            str(tmp_path / "run"),
            "--report-to",
            "none",
        ]
    )
    assert config.optim == "adamw_torch"
    assert (config.loss_type, config.epsilon_high, config.mask_truncated_completions, config.weight_decay) == (
        "bnpo",
        0.28,
        True,
        0.1,
    )
    assert (config.max_completion_length, config.num_train_epochs, script.lora_rank) == (2048, 1, 16)


@pytest.mark.parametrize("recipe", ["qerl_nvfp4.yaml", "lora_bf16.yaml"])
def test_the_reference_recipes_spell_out_the_dapo_settings(recipe: str) -> None:
    """QeRLConfig keeps trl's defaults; the reference's DAPO settings must therefore be in the recipes."""
    values = yaml.safe_load((RECIPES[0].parent / recipe).read_text())
    assert {
        k: values.get(k)
        for k in (
            "loss_type",
            "epsilon_high",
            "mask_truncated_completions",
            "max_grad_norm",
            "lr_scheduler_type",
            "warmup_steps",
            "adam_beta2",
            "weight_decay",
            "num_train_epochs",
            "beta",
        )
    } == {
        "loss_type": "bnpo",
        "epsilon_high": 0.28,
        "mask_truncated_completions": True,
        "max_grad_norm": 0.2,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.1,
        "adam_beta2": 0.99,
        "weight_decay": 0.1,
        "num_train_epochs": 1,
        "beta": 0.0,
    }


# --- values a recipe may not hold -------------------------------------------------------------------------------------


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
    line = one_error(
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
