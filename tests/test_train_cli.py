"""``python -m qerl.train`` on bad input: ``error: <one line>`` on stderr, exit status 2, no traceback, and
nothing written (issue 16, item 6). Every case fails before a model is loaded, so each takes ~a second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.cli import run
from qerl.train.run import main

ROOT = Path(__file__).resolve().parents[1]


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert run(main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and not any("Traceback" in line for line in lines), lines
    return errors[0]


def test_bad_flags_and_recipe_keys(tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    base = [
        "--model-name",
        str(tiny_dense_dir),
        "--dataset",
        "arithmetic",
        "--num-samples",
        "8",
        "--output-dir",
        str(out),
        "--report-to",
        "none",
    ]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: arithmetic\nlora_rnk: 8\n")
    assert _error(base + ["--config", str(recipe)], capsys) == (
        f"error: --config {recipe}: unknown key(s) lora_rnk (see python -m qerl.train --help)"
    )
    recipe.write_text("dataset: [arithmetic\n")
    assert _error(base + ["--config", str(recipe)], capsys).startswith(f"error: --config {recipe}: ")
    assert _error(base + ["--config", str(tmp_path / "none.yaml")], capsys).startswith(
        f"error: --config {tmp_path / 'none.yaml'}: "
    )
    assert _error(base + ["--rewards", "nosuch"], capsys).startswith("error: --rewards: unknown ['nosuch']")
    assert (
        _error(base + ["--learning-rate", "-1"], capsys)
        == "error: --learning_rate: expected a non-negative number, got -1.0"
    )
    assert _error(base + ["--lora-rank", "0"], capsys).startswith("error: --lora_rank: expected a positive integer")
    # No prefix matching: --learning_rat is a typo, not --learning_rate.
    assert _error(base + ["--learning_rat", "1e-5"], capsys) == (
        "error: unrecognized arguments: --learning_rat 1e-5 (see python -m qerl.train --help)"
    )
    assert _error(base + ["--lora-rank", "two"], capsys).startswith(
        "error: argument --lora_rank/--lora-rank: invalid int value"
    )
    assert _error(base + ["--rollout-engine", "warp"], capsys).startswith("error: --rollout_engine: expected one of")
    assert not out.exists()


def test_missing_and_binary_paths(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    common = ["--output-dir", str(out), "--report-to", "none"]
    # A local path with one slash could be a hub id: the message must say it is not a local directory either.
    err = _error(["--model-name", "qmodel/no-such-model", *common], capsys)
    assert err.startswith("error: --model_name qmodel/no-such-model: ") and "no such local directory" in err
    model = ["--model-name", str(tiny_dense_dir), *common]
    err = _error([*model, "--dataset", "gsm8k", "--dataset-path", "data/train.jsonl"], capsys)
    assert err == "error: --dataset_path data/train.jsonl: no such file or directory"
    err = _error([*model, "--dataset", "gsm8k", "--dataset-path", "someone/no-such-set"], capsys)
    assert err.startswith("error: --dataset_path someone/no-such-set: no such local file or directory, and loading hub")
    for name in ("train.jsonl", "train.parquet"):
        (tmp_path / name).write_bytes(bytes(range(256)) * 16)
        err = _error([*model, "--dataset", "gsm8k", "--dataset-path", str(tmp_path / name)], capsys)
        why = "not UTF-8 text (near byte 128)" if name.endswith(".jsonl") else "not a readable .parquet file ("
        assert err.startswith(f"error: --dataset_path {tmp_path / name}: {why}"), err
    assert not out.exists()


def test_output_dir_in_the_model_or_held_by_another_run(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 53, items 6 and 1: ``--output-dir`` equal to (or inside) the model directory wrote the run
    into the model's folder; a second training into one output dir ran alongside the first."""
    before = sorted(p.name for p in tiny_dense_dir.iterdir())
    for out in (tiny_dense_dir, tiny_dense_dir / "run"):
        err = _error(["--model-name", str(tiny_dense_dir), "--output-dir", str(out), "--report-to", "none"], capsys)
        assert err.startswith(f"error: --output_dir {out}: is ") and "model directory" in err, err
    assert sorted(p.name for p in tiny_dense_dir.iterdir()) == before
    from qerl.runlock import run_lock

    out = tmp_path / "run"
    with run_lock(out):
        err = _error(
            [
                "--model-name",
                str(tiny_dense_dir),
                "--dataset",
                "arithmetic",
                "--output-dir",
                str(out),
                "--report-to",
                "none",
            ],
            capsys,
        )
    assert err.startswith(f"error: --output_dir {out}: another run (PID {os.getpid()}) is writing it"), err
    assert not out.exists()


@pytest.mark.parametrize("module", ["qerl.train", "eval.gsm8k"])
def test_entry_points_exit_2_with_one_line(module: str, tmp_path: Path) -> None:
    """The ``python -m`` entry points themselves go through qerl.cli.run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--learning_rat" if module == "qerl.train" else "--max-new", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("error: unrecognized arguments: ")
        and "Traceback" not in proc.stderr
    )
