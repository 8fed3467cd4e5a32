"""The shipped recipes parse into QeRLConfig and only name logging integrations that are installed.

Why: the quickstart recipe reports to tensorboard; when tensorboard was missing from the
dependencies, `bash setup_env.sh && bash training/quickstart.sh` (the README's main job) died at
trainer construction in a fresh clone while every other test passed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from transformers.integrations import get_available_reporting_integrations

from qerl.train.trainer import QeRLConfig

RECIPES = sorted((Path(__file__).resolve().parents[1] / "training" / "recipes").glob("*.yaml"))


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
