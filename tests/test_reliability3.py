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


# --- the run lock ------------------------------------------------------------------------------------------

def test_lock_refuses_a_planted_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    from qerl.cli import UsageError
    from qerl.runlock import lock_path, run_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    lock_path(out).symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"), run_lock(out):
        pass
    assert victim.read_text() == "precious\n" and lock_path(out).is_symlink()


def test_lock_is_keyed_by_the_resolved_directory(tmp_path: Path) -> None:
    """``alias`` and ``runs/real`` are one directory: a run into each at once would interleave their files."""
    from qerl.runlock import OutputBusy, run_lock

    real = tmp_path / "runs" / "real"
    real.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "runs-alias").symlink_to(tmp_path / "runs")
    with run_lock(real):
        for other in (tmp_path / "alias", tmp_path / "runs-alias" / "real", real / ".." / "real"):
            with pytest.raises(OutputBusy), run_lock(other):
                pass
