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

from qerl.trainer import QeRLConfig

RECIPES = sorted((Path(__file__).resolve().parents[1] / "training" / "recipes").glob("*.yaml"))


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "qerl_nvfp4.yaml", "lora_bf16.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_reports_only_to_installed_integrations(recipe: Path, tmp_path: Path) -> None:
    values = yaml.safe_load(recipe.read_text())
    report_to = values.get("report_to", [])
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    missing = [name for name in report_to if name not in ("none", "all") and name not in get_available_reporting_integrations()]
    assert not missing, f"{recipe.name}: report_to names {missing}, not installed"
    fields = set(QeRLConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in values.items() if k in fields}
    if kwargs.get("optim") == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        kwargs["optim"] = "adamw_torch"  # setup_env.sh installs bitsandbytes on CUDA machines only
    config = QeRLConfig(output_dir=str(tmp_path), **kwargs)
    assert config.report_to == report_to
