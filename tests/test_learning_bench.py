"""benchmarks.learning's bookkeeping: paired seeds, mean and standard error, the gain ratio, reruns
of only the arms a seed lacks (the training itself runs on the GPU; its CPU smoke is in the docstring)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import learning


def _fake_seed(
    out: Path, seed: int, accs: dict[str, tuple[float, float]], exit_codes: dict[str, int] | None = None, steps: int = 3
) -> None:
    d = out / f"seed{seed}"
    rows = []
    for run, (before, after) in accs.items():
        rows.append(
            {
                "run": run,
                "exit_code": (exit_codes or {}).get(run, 0),
                "steps": steps,
                "heldout_rows": 200,
                "heldout_accuracy_before": before,
                "heldout_accuracy_after": after,
                "train_runtime_s": 1.0,
            }
        )
        (d / run).mkdir(parents=True)
        (d / run / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "loss": 0.1, "reward": after * s + seed}) + "\n" for s in range(1, steps + 1)
            )
        )
    (d / "results.json").write_text(json.dumps(rows))


def test_aggregate_paired_seeds(tmp_path: Path):
    arms = ["bf16", "rtn", "best"]
    gains = {0: (0.50, 0.10, 0.30), 1: (0.40, 0.20, 0.30), 2: (0.45, 0.00, 0.27)}
    for seed, (g_bf16, g_rtn, g_best) in gains.items():
        _fake_seed(
            tmp_path,
            seed,
            {"bf16_lora": (0.2, 0.2 + g_bf16), "nvfp4_lora": (0.1, 0.1 + g_rtn), "best_lora": (0.1, 0.1 + g_best)},
        )
    _fake_seed(
        tmp_path,
        3,
        {"bf16_lora": (0.2, 0.9), "nvfp4_lora": (0.1, 0.9), "best_lora": (0.1, 0.9)},
        exit_codes={"best_lora": 1},
    )  # an unfinished arm drops the whole seed (pairs stay whole)
    result = learning.aggregate(tmp_path, arms, "gptq")
    assert result["seeds"] == [0, 1, 2]
    best = result["arms"]["best"]
    g = [0.30, 0.30, 0.27]
    mean = sum(g) / 3
    assert best["gain"]["mean"] == pytest.approx(mean)
    assert best["gain"]["se"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in g) / 2 / 3))
    assert best["label"] == "NVFP4 gptq + LoRA"
    ratio = best["gain_vs_bf16"]
    assert ratio["ratio"] == pytest.approx(mean / 0.45) and ratio["se"] > 0
    # perfectly proportional gains have a ratio with no spread
    exact = learning.ratio_se([0.2, 0.4, 0.6], [0.4, 0.8, 1.2])
    assert exact["ratio"] == pytest.approx(0.5) and exact["se"] == pytest.approx(0.0, abs=1e-6)
    curve = result["reward_curves"]["bf16"]
    assert [c[0] for c in curve] == [1, 2, 3]
    assert curve[0][1] == pytest.approx(sum(0.2 + gains[s][0] + s for s in gains) / 3)  # reward = after * step + seed
    png = learning.plot(result, tmp_path / "learning.png", smooth=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_FAKE_COMPARE = """#!/usr/bin/env bash
# stands in for compare_smollm2.sh: one results row per run in $RUNS, and a log of what was asked
set -euo pipefail
mkdir -p "$QERL_OUT"
echo "$RUNS | $*" >> "$QERL_OUT/../calls.txt"
python3 - "$QERL_OUT" $RUNS <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
json.dump([{"run": r, "exit_code": 1 if r == "best_lora" and "fail" in open(out + "/../mode").read() else 0,
            "steps": 2, "heldout_accuracy_before": 0.1, "heldout_accuracy_after": 0.2,
            "train_runtime_s": 1.0} for r in runs], open(out + "/results.json", "w"))
PY
"""


def test_run_seed_reruns_only_missing_arms(tmp_path: Path, monkeypatch):
    fake = tmp_path / "compare.sh"
    fake.write_text(_FAKE_COMPARE)
    monkeypatch.setattr(learning, "COMPARE", fake)
    out = tmp_path / "out"
    out.mkdir()
    dirs = {k: tmp_path / k for k in ("bf16", "rtn", "dequant", "best")}
    (out / "mode").write_text("fail")
    assert learning.run_seed(out, 0, ["bf16", "best"], dirs, 2, None, ["--heldout", "4"]) == (0, False)
    (out / "mode").write_text("ok")
    learning.run_seed(out, 0, ["bf16", "best"], dirs, 2, None, ["--heldout", "4"])
    learning.run_seed(out, 0, ["bf16", "best"], dirs, 2, None, ["--heldout", "4"])  # nothing left to run
    calls = (out / "calls.txt").read_text().splitlines()
    assert calls == ["bf16_lora best_lora | --seed 0 --heldout 4", "best_lora | --seed 0 --heldout 4"]
    recorded = json.loads((out / "seed0" / "calls.json").read_text())
    assert [c["runs"] for c in recorded] == ["bf16_lora best_lora", "best_lora"] and recorded[0]["steps"] == 2
    rows = learning.seed_rows(out / "seed0")
    assert {r: rows[r]["exit_code"] for r in rows} == {"bf16_lora": 0, "best_lora": 0}


def test_dequantized_arm_has_the_nvfp4_weights(tiny_llama_dir: Path, tmp_path: Path):
    from qerl.load.linear import NVFP4Linear
    from qerl.load.loader import load_model
    from qerl.quantize.pipeline import quantize_checkpoint

    q = quantize_checkpoint(tiny_llama_dir, tmp_path / "q")
    d = learning.dequantized_copy(q, tmp_path / "d")
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    dense, quant = load_model(d, device="cpu"), load_model(q, device="cpu")
    assert not any(isinstance(m, NVFP4Linear) for m in dense.modules())
    w = dense.model.layers[1].mlp.down_proj.weight
    assert torch.equal(w, quant.model.layers[1].mlp.down_proj.dequantized_weight(torch.bfloat16).float())
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.no_grad():
        a, b = dense(ids).logits, quant(ids).logits
    assert (a - b).abs().max() < 1e-2 * b.abs().max()


_RECORDING_PYTHON = """#!/usr/bin/env bash
# stands in for python: records each qerl.train.run call's arguments under the name of its --output-dir
prev=""
for a in "$@"; do [[ $prev == --output-dir ]] && out=$a; prev=$a; done
[[ -n ${out:-} ]] && printf "%s\\n" "$@" > "$RECORD/$(basename "$out").argv"
exit 0
"""


def _flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last occurrence wins, as in argparse


def test_compare_script_runs_the_learning_arms(tmp_path: Path):
    stub, record = tmp_path / "python", tmp_path / "record"
    stub.write_text(_RECORDING_PYTHON)
    stub.chmod(0o755)
    record.mkdir()
    env = {
        **os.environ,
        "PYTHON": str(stub),
        "RECORD": str(record),
        "BF16_DIR": "/m/bf16",
        "NVFP4_DIR": "/m/rtn",
        "DEQUANT_DIR": "/m/deq",
        "BEST_DIR": "/m/gptq",
        "QERL_OUT": str(tmp_path / "out"),
        "RUNS": "bf16_lora dequant_lora nvfp4_lora best_lora qerl_best_aqn",
    }
    subprocess.run(["bash", str(learning.COMPARE), "--seed", "3"], env=env, capture_output=True, text=True)
    want = {
        "bf16_lora": ("/m/bf16", "bf16", "False"),
        "dequant_lora": ("/m/deq", "bf16", "False"),
        "nvfp4_lora": ("/m/rtn", "nvfp4", "False"),
        "best_lora": ("/m/gptq", "nvfp4", "False"),
        "qerl_best_aqn": ("/m/gptq", "nvfp4", "True"),
    }
    for run, (model, load, aqn) in want.items():
        argv = (record / f"{run}.argv").read_text().splitlines()
        assert (_flag(argv, "--model-name"), _flag(argv, "--load"), _flag(argv, "--aqn"), _flag(argv, "--seed")) == (
            model,
            load,
            aqn,
            "3",
        ), run
    # an unknown run or a missing directory stops the script before any run starts
    for bad in ({"RUNS": "bf16_lora nope"}, {"RUNS": "bf16_lora best_lora", "BEST_DIR": ""}):
        shutil.rmtree(record)
        record.mkdir()
        proc = subprocess.run(["bash", str(learning.COMPARE)], env={**env, **bad}, capture_output=True, text=True)
        assert proc.returncode != 0 and not list(record.iterdir()), proc.stderr
