"""benchmarks/gemm.py's kernels.json summary (what the README's kernels table and issue 12's decode targets are read
from): the vLLM Marlin peer's figures appear exactly when its rows were timed, from those rows' own times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _row(m: int, ours: float, bf16: float, marlin: float | None) -> dict:
    fwd = {
        "time_us": ours,
        "bf16_time_us": bf16,
        "speedup_vs_bf16": bf16 / ours,
        "weight_bw_fraction_of_copy": 9.0 / ours,
    }
    if marlin is not None:
        fwd.update(
            {
                "vllm_marlin_time_us": marlin,
                "vllm_marlin_speedup_vs_bf16": bf16 / marlin,
                "vllm_marlin_weight_bw_fraction_of_copy": 9.0 / marlin,
                "speedup_vs_vllm_marlin": marlin / ours,
            }
        )
    return {
        "model": "qwen2.5-7b",
        "layer": "down",
        "M": m,
        "N": 3584,
        "K": 18944,
        "fwd": fwd,
        "bwd": {"time_us": 2 * ours, "speedup_vs_bf16": 0.9},
    }


@pytest.mark.parametrize("with_marlin", [False, True])
def test_kernels_summary_carries_the_marlin_peer_only_when_timed(
    tmp_path: Path, with_marlin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import gemm

    monkeypatch.setattr(gemm.torch.cuda, "get_device_name", lambda *a: "test device")
    rows = [_row(m, ours=10.0 + m / 8, bf16=40.0, marlin=20.0 + m / 2 if with_marlin else None) for m in gemm.MS]
    summary = gemm.write(tmp_path, rows, [], copy_bw=4.25e12, complete=True)
    assert summary == json.loads((tmp_path / "kernels.json").read_text())["summary"]
    assert (tmp_path / "kernels_speedup.png").stat().st_size > 0
    assert summary["m16_speedup"] == pytest.approx(40.0 / 12.0)
    if not with_marlin:
        assert "vllm_marlin" not in summary
        return
    peer = summary["vllm_marlin"]
    assert peer["m1_bw_fraction"] == pytest.approx(9.0 / 20.5)
    assert peer["m64_speedup"] == pytest.approx(40.0 / 52.0)
    assert peer["ours_over_marlin_m16"] == pytest.approx(28.0 / 12.0)
