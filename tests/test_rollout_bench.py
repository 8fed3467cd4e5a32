"""benchmarks/rollout.py's merge of rows measured in other device calls (vLLM, transformers + NF4;
benchmarks/rollout_report.py): what the README's rollout table and the issue's summary ratios are built from."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def rollout() -> ModuleType:
    from benchmarks import rollout_report

    return rollout_report


def _row(engine: str, weights: str, ms: float, **extra: object) -> dict:
    return {"shape": "7b", "engine": engine, "weights": weights, "lora": True, "batch": 8, "tokens": 1024,
            "ms_per_step": ms, "floor_ms": None, "weight_gb": None, "lora_gb": None, "kv_gb_mean": None, **extra}  # fmt: skip


def test_merge_fills_floors_stamps_dates_and_replaces_same_rows(rollout: ModuleType, tmp_path: Path) -> None:
    native = _row("native", "nvfp4", 4.1, floor_ms=1.2, weight_gb=4.7, lora_gb=0.08, kv_gb_mean=0.35)
    old_vllm = _row("vllm", "nvfp4", 5.0, measured="yesterday")
    extra = tmp_path / "vllm.json"
    extra.write_text(json.dumps({"date": "2026-11-30T00:39:54+00:00", "device": "H200", "versions": {"vllm": "0.26.0"},
                                 "results": [_row("vllm", "nvfp4", 4.9)]}))  # fmt: skip
    rows, env = rollout.with_extra_rows([native, old_vllm], [extra], {"device": "H200", "versions": {"torch": "2.11"}})
    assert len(rows) == 2  # the vLLM row replaced, not duplicated
    vllm = next(r for r in rows if r["engine"] == "vllm")
    assert vllm["ms_per_step"] == 4.9 and vllm["measured"] == "2026-11-30T00:39:54+00:00"
    assert (vllm["floor_ms"], vllm["weight_gb"], vllm["kv_gb_mean"]) == (1.2, 4.7, 0.35)  # same bytes as native
    assert env["versions"] == {"torch": "2.11", "vllm": "0.26.0"}


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"date": "d", "device": "H200", "results": [_row("native", "nvfp4", 1.0)]}, "expected rollout_vllm.py's"),
        ({"date": "d", "device": "A100", "results": [_row("vllm", "bf16", 1.0)]}, "was measured on A100"),
    ],
)
def test_merge_refuses_foreign_rows(rollout: ModuleType, tmp_path: Path, doc: dict, message: str) -> None:
    extra = tmp_path / "rows.json"
    extra.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=message):
        rollout.with_extra_rows([], [extra], {"device": "H200", "versions": {}})
