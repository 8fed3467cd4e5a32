"""CPU smoke test of benchmarks/integrity.py (``--tiny``): the loads with checks on really check every tensor
the loader reads, the loads with checks off check none, and the shares come out of the measured times."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

import qerl.load.loader
from benchmarks import integrity


def test_tiny_run_measures_the_checks(tmp_path: Path) -> None:
    out = tmp_path / "integrity.json"
    assert (
        integrity.main(
            [
                "--tiny",
                "--dir",
                str(tmp_path / "ckpt"),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--repeats",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    row = doc["row"]
    assert len(row["load_s_checks_on"]) == len(row["load_s_checks_off"]) == len(row["check_s"]) == 2
    names = qerl.checkpoint.TensorIndex(tmp_path / "ckpt" / "nvfp4").names()
    assert row["tensors_checked"] == len(names)  # every tensor of the (untied) checkpoint, once
    assert all(0 < c < load for c, load in zip(row["check_s"], row["load_s_checks_on"], strict=True))
    shares = [c / load for c, load in zip(row["check_s"], row["load_s_checks_on"], strict=True)]
    assert doc["summary"]["check_share_of_load"] == pytest.approx(statistics.median(shares), rel=0.05)
    assert doc["summary"]["met"] == (doc["summary"]["check_share_of_load"] < integrity.TARGET_SHARE)
    assert doc["command"].startswith("python -m benchmarks.integrity --tiny")


def test_checks_off_checks_nothing_and_restores_the_loader(tmp_path: Path) -> None:
    model_dir = integrity.synthetic_checkpoint(tmp_path, tiny=True)
    real = qerl.load.loader.Verdicts
    off = integrity.timed_load(model_dir, torch.device("cpu"), torch.float32, "off")
    assert off["tensors_checked"] == 0 and off["check_s"] == 0
    assert qerl.load.loader.Verdicts is real
