"""Reliability of the commands on hostile input (issue 60): one test per class of defect, each seen to
fail before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


# --- the trl drop-in's config ------------------------------------------------------------------------------

def test_trl_differences_accepts_every_batch_shape_trl_accepts(tmp_path: Path) -> None:
    """18 completions per step in generations of 12 (4 prompts x 3): trl accepts it, and listing the settings that
    differ from trl's must not refuse it (it built its reference config without the generation batch)."""
    from qerl.config import QeRLConfig, trl_differences

    cfg = QeRLConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=3,
                     gradient_accumulation_steps=6, num_generations=4, generation_batch_size=12)
    differences = trl_differences(cfg)
    assert "generation_batch_size" not in differences and "steps_per_generation" not in differences


def test_trl_differences_never_stops_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A reference config trl refuses (a trl release with a new rule) costs the report only."""
    from qerl import config

    cfg = config.QeRLConfig(output_dir=str(tmp_path), report_to=[])

    def refuse(**kwargs: object) -> None:
        raise ValueError("a rule of a newer trl")

    monkeypatch.setattr(config, "GRPOConfig", refuse)
    assert config.trl_differences(cfg) == {}
    assert "a rule of a newer trl" in caplog.text
