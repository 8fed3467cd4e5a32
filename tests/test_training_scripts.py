"""The scripts under training/ on a fresh clone (issue 16, item 7): they must run with the project's venv
(made by setup_env.sh) without it being activated, say in one line how to make it when it is missing,
and quickstart.sh must take its run directory from a qerl-specific variable, not a generic $OUT.

The clone is a copy of training/ with a stand-in ``.venv/bin/python`` that records its arguments; the
PATH offers only a ``python``/``python3`` without torch, as on a machine where nothing is activated."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "training").glob("*.sh") if not p.name.startswith("_"))


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "clone"
    shutil.copytree(ROOT / "training", repo / "training")
    _exe(repo / ".venv" / "bin" / "python", f'echo "$*" >> "{repo}/calls.log"\n')
    for name in ("python", "python3"):  # what PATH offers: an interpreter without qerl's dependencies
        _exe(tmp_path / "bin" / name, "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1\n")
    return repo


def _run(clone: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        "PATH": f"{clone.parent / 'bin'}:/usr/bin:/bin",
        "HOME": str(clone.parent),
        "OUT": str(clone.parent / "elsewhere"),
        "BF16_DIR": "bf16",
        "NVFP4_DIR": "nvfp4",
    }
    return subprocess.run(
        ["bash", str(clone / "training" / script)], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def _calls(clone: Path) -> list[str]:
    log = clone / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_use_the_project_venv(clone: Path, script: str) -> None:
    proc = _run(clone, script)
    assert "No module named" not in proc.stderr, proc.stderr
    trains = [c for c in _calls(clone) if c.startswith("-m qerl.train ")]
    assert trains, (proc.returncode, proc.stderr, _calls(clone))
    assert not (clone.parent / "elsewhere").exists()  # a generic $OUT is not read


def test_quickstart_run_dir_is_qerl_out(clone: Path) -> None:
    assert _run(clone, "quickstart.sh").returncode == 0
    (train,) = [c for c in _calls(clone) if c.startswith("-m qerl.train ")]
    assert train.endswith("--output-dir runs/quickstart")
    (clone / "calls.log").unlink()
    assert _run(clone, "quickstart.sh", QERL_OUT="runs/mine").returncode == 0
    (train,) = [c for c in _calls(clone) if c.startswith("-m qerl.train ")]
    assert train.endswith("--output-dir runs/mine")


def test_without_a_venv_one_line_says_how_to_make_it(clone: Path) -> None:
    shutil.rmtree(clone / ".venv")
    proc = _run(clone, "quickstart.sh")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: no Python with qerl's dependencies: run 'bash setup_env.sh' in {clone} (it makes {clone}/.venv), or set PYTHON"
    ]
    explicit = _exe(clone.parent / "mine" / "python", f'echo "mine $*" >> "{clone}/calls.log"\n')
    assert _run(clone, "quickstart.sh", PYTHON=str(explicit)).returncode == 0
    assert any(c.startswith("mine -m qerl.train") for c in _calls(clone))


def _train_args(clone: Path, script: str, **env: str) -> list[str]:
    """The qerl.train.run arguments the script passes (a fresh calls.log per run)."""
    (clone / "calls.log").unlink(missing_ok=True)
    assert _run(clone, script, **env).returncode == 0
    (train,) = [c for c in _calls(clone) if c.startswith("-m qerl.train ")]
    return train.split()


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


#: Each Qwen3 / Llama-3.1 script, its default bf16 model, and the Qwen2.5 script whose options it takes.
FAMILY_SCRIPTS = [
    ("qwen3-4b", "Qwen/Qwen3-4B", "qwen2.5-3b"),
    ("qwen3-8b", "Qwen/Qwen3-8B", "qwen2.5-7b"),
    ("qwen3-14b", "Qwen/Qwen3-14B", "qwen2.5-14b"),
    ("qwen3-32b", "Qwen/Qwen3-32B", "qwen2.5-32b"),
    ("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5-7b"),
]


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
@pytest.mark.parametrize("tag,hub,like", FAMILY_SCRIPTS, ids=[t for t, _, _ in FAMILY_SCRIPTS])
def test_qwen3_and_llama_scripts_take_the_qwen25_options(
    clone: Path, tag: str, hub: str, like: str, precision: str
) -> None:
    args = _train_args(clone, f"dapo_{tag}_{precision}_single_gpu.sh")
    ref = _train_args(clone, f"dapo_{like}_{precision}_single_gpu.sh")
    differ = {"--model-name", "--output-dir", "--run-name"}
    assert [a for i, a in enumerate(args) if i == 0 or args[i - 1] not in differ] == [
        a for i, a in enumerate(ref) if i == 0 or ref[i - 1] not in differ
    ]
    run = _flag(args, "--run-name")
    assert run.startswith(f"{tag}_{precision}_") and _flag(args, "--output-dir").endswith(f"runs/{run}")
    default = f"qmodel/{hub.split('/')[-1]}-NVFP4A16" if precision == "nvfp4" else hub
    assert _flag(args, "--model-name") == default
    assert (
        _flag(_train_args(clone, f"dapo_{tag}_{precision}_single_gpu.sh", MODEL_PATH="/data/mine"), "--model-name")
        == "/data/mine"
    )


def test_qwen25_scripts_keep_their_models_and_run_names(clone: Path) -> None:
    args = _train_args(clone, "dapo_qwen2.5-7b_nvfp4_single_gpu.sh")
    assert _flag(args, "--model-name") == "qmodel/Qwen2.5-7B-Instruct-NVFP4A16"
    assert _flag(args, "--run-name") == "qwen2.5-7b_nvfp4_gsm8k_b2_r16"
    assert (
        _flag(_train_args(clone, "dapo_qwen2.5-32b_bf16_single_gpu.sh"), "--model-name") == "Qwen/Qwen2.5-32B-Instruct"
    )
