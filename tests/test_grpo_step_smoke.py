"""Smoke test of benchmarks/grpo_step.py in ``--tiny`` mode, so that the GPU benchmark cannot rot
between its runs: one real QeRLTrainer GRPO step per base (NVFP4 and dense) on a 2-layer Llama,
every phase timed, the JSON complete. Also checks the analytic decode floor against the floor that
benchmarks/rollout.py computed from a real 7B-shape model's bytes on the H200."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grpo_step() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_step_bench", ROOT / "benchmarks" / "grpo_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_every_phase_and_the_summary(grpo_step: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "grpo_step.json"
    grpo_step.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert not (tmp_path / "grpo_step.partial.json").exists()  # superseded by the final JSON
    for key in ("date", "device", "versions", "command", "setup", "summary", "results"):
        assert doc[key], key
    assert "--tiny" in doc["command"] and doc["versions"]["trl"]

    rows = doc["results"]
    assert [(r["shape"], r["base"]) for r in rows] == [("tiny", "nvfp4"), ("tiny", rows[1]["base"])]
    assert rows[1]["base"] != "nvfp4"
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert set(r["phases_s"]) == set(grpo_step.PHASES) == set(r["peak_gb"])
        assert all(r["phases_s"][p] > 0 for p in ("rollout", "logprobs", "fwd_bwd", "optimizer"))
        assert r["step_s"] == pytest.approx(sum(r["phases_s"].values()), rel=1e-3, abs=1e-3)
        assert r["forced_length"] and r["completion_lengths"] == [16] and r["decode_steps"] == 15
        assert r["gradient_checkpointing"] and r["lora_updated"] and r["aqn_sigma"] > 0
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # LoRA r16 on 7 projections of 2 layers (64 hidden, 128 intermediate, 2 kv heads) + 4 norms
        assert r["trainable_params"] == 2 * 16 * (128 + 96 + 96 + 128 + 192 + 192 + 192) + 4 * 64
        assert set(r["floors"]) >= {"rollout_s", "logprobs_s", "fwd_bwd_s", "optimizer_s"}

    summary = doc["summary"]
    for key in ("peak_gb_32b_nvfp4", "peak_gb_7b_nvfp4", "step_speedup_7b"):
        assert key in summary and summary[key] is None  # not run in tiny mode: present, null
    dense = rows[1]
    assert summary["step_speedup_tiny"] == pytest.approx(dense["step_s"] / rows[0]["step_s"], rel=1e-2)
    assert f"peak_gb_tiny_{dense['base']}" in summary and "peak_gb_tiny_nvfp4" in summary
    assert set(summary["targets"]) == {"peak_gb_32b_nvfp4", "step_speedup_7b"}


def test_decode_floor_matches_the_measured_model_bytes(grpo_step: ModuleType) -> None:
    """The analytic 7B NVFP4 bytes per decode step equal the floor benchmarks/rollout.py derived
    from the built model's tensors (b=8, 128 new tokens, same copy bandwidth)."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "rollout_lora_b1_b8.json").read_text())
    row = next(r for r in measured["results"] if r["batch"] == 8 and r["variant"] == "lora_fused")
    floor = grpo_step.floors(grpo_step.SHAPES["7b"], grpo_step.VOCAB, True, 8, 256, 128, 16)["decode_step_ms"]
    scale = grpo_step.COPY_BW / (measured["copy_bandwidth_tb_s"] * 1e12)
    assert floor * scale == pytest.approx(row["floor_ms"], rel=5e-3)
