"""Every file qerl writes gets the permissions the user's umask gives, as ``open()`` and ``mkdir()`` would
(issue 78): files 0o666 and directories 0o777, less the umask. safetensors 0.8 creates its files 0600 and
``tempfile`` its names 0600 / 0700, so without ``qerl.fsutil.umask_modes`` a trained adapter, a checkpoint or
a temp-then-rename file was readable by its owner alone (a server running as another user could not load it).

One chain per umask on a tiny model: quantize it, train two steps on it (checkpoints and the adapter), export the
adapter, evaluate it; then the file-level writers of ``qerl.fsutil`` on their own.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qerl.fsutil import append_whole, atomic_directory, atomic_write_text, save_safetensors

torch.set_num_threads(1)
UMASKS = (0o022, 0o027)


@pytest.fixture(params=UMASKS, ids=lambda m: f"umask{m:03o}")
def umask(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def wrong_modes(root: Path, mask: int) -> dict[str, str]:
    """``{path: 'found, wanted'}`` for every file and directory under ``root`` (``root`` too) whose permission bits
    are not what ``open()`` / ``mkdir()`` give under ``mask``."""
    wrong = {}
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        found = stat.S_IMODE(path.stat().st_mode)
        if found != want:
            wrong[str(path.relative_to(root.parent))] = f"{found:04o}, wanted {want:04o}"
    return wrong


def _train_argv(model: Path, out: Path) -> list[str]:
    flags = {
        "--model-name": model,
        "--dataset": "arithmetic",
        "--num-samples": 12,
        "--heldout": 2,
        "--heldout-max-tokens": 4,
        "--lora-rank": 2,
        "--ln": True,
        "--max-steps": 2,
        "--save-steps": 1,
        "--per-device-train-batch-size": 2,
        "--num-generations": 2,
        "--max-completion-length": 4,
        "--output-dir": out,
        "--report-to": "none",
        "--disable-tqdm": True,
        "--seed": 0,
    }
    return [str(x) for flag, value in flags.items() for x in (flag, value)]


def test_every_command_writes_with_the_umask_modes(umask: int, tiny_dense_dir: Path, tmp_path: Path) -> None:
    from eval import gsm8k
    from qerl.export import command as export
    from qerl.quantize.pipeline import quantize_checkpoint
    from qerl.train.run import main as train

    work = tmp_path / "work"
    work.mkdir()
    nvfp4 = quantize_checkpoint(tiny_dense_dir, work / "tiny-nvfp4")
    run = work / "run"
    train(_train_argv(nvfp4, run))
    assert {"adapter", "checkpoint-1", "checkpoint-2"} <= {p.name for p in run.iterdir()}
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    export(["--model", str(nvfp4), "--lora", str(run / "adapter"), "--output", str(work / "export")])
    gsm8k.main(
        [
            *("--model", str(nvfp4), "--lora", str(run / "adapter"), "--data", str(run / "heldout.jsonl")),
            *("--output", str(work / "eval" / "heldout.jsonl"), "--engine", "hf", "--device", "cpu"),
            *("--dtype", "float32", "--max-new-tokens", "3", "--temperature", "0"),
        ]
    )
    assert (work / "export" / "model.safetensors").is_file() and (work / "eval" / "heldout.jsonl").is_file()
    assert wrong_modes(work, umask) == {}


def test_the_file_writers_use_the_umask_modes(umask: int, tmp_path: Path) -> None:
    root = tmp_path / "out"
    atomic_write_text(root / "atomic.json", json.dumps({"a": 1}))
    append_whole(root / "appended.jsonl", "{}\n")
    with atomic_directory(root / "tree") as tmp:
        (tmp / "sub").mkdir()
        save_safetensors({"w": torch.zeros(2)}, tmp / "sub" / "weights.safetensors")
    assert sorted(p.name for p in root.rglob("*")) == [
        "appended.jsonl",
        "atomic.json",
        "sub",
        "tree",
        "weights.safetensors",
    ]
    assert wrong_modes(root, umask) == {}
