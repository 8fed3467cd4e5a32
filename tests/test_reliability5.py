"""Reliability of export and evaluation on hostile input (issue 60, the eval/export side): one test per
class of defect, each seen to fail before its fix."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import VOCAB, make_adapter
from tiny_models import make_tiny_llama

from qerl import export
from qerl.quantize import quantize_checkpoint

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny NVFP4 Llama and an adapter trained (randomly) on it."""
    root = tmp_path_factory.mktemp("reliability5")
    model = quantize_checkpoint(make_tiny_llama(root / "bf16", vocab=VOCAB), root / "nvfp4", backend="qerl")
    return {"model": model, "adapter": make_adapter(model, root / "adapter")}


def _one_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _export(
    merge: dict[str, Path], output: Path, capsys: pytest.CaptureFixture, *flags: str, model: Path | None = None
) -> tuple[int, str]:
    code = export.main(
        ["--model", str(model or merge["model"]), "--lora", str(merge["adapter"]), "--output", str(output), *flags]
    )
    return code, capsys.readouterr().err


# --- export: every tensor checked against the model before writing -------------------------------------------


def _damaged(model: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``model`` whose weights file went through ``change`` (a header that lies about a tensor)."""
    shutil.copytree(model, out)
    state = load_file(out / "model.safetensors")
    change(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


DAMAGE = {
    "larger tensor": (
        lambda s: s.update({"model.embed_tokens.weight": torch.zeros(4 * VOCAB, 64, dtype=torch.bfloat16)}),
        "model.embed_tokens.weight' is declared BF16 [1024, 64], the model's is BF16/F16/F32 [256, 64]",
    ),
    "extra tensor": (
        lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(8, 8, dtype=torch.bfloat16)}),
        "holds tensor 'model.layers.0.mlp.extra.weight', which the model",
    ),
    "scales as fp32": (
        lambda s: s.update(
            {"model.layers.1.mlp.up_proj.weight_scale": s["model.layers.1.mlp.up_proj.weight_scale"].float()}
        ),
        "'model.layers.1.mlp.up_proj.weight_scale' is declared F32 [128, 4], the model's is F8_E4M3",
    ),
    "missing tensor": (lambda s: s.pop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_export_checks_every_tensor_against_the_model(merge, tmp_path: Path, capsys, damage: str) -> None:
    """A damaged header (a larger tensor, one the model has not, a scale of another dtype) was copied into the
    export with rc 0; now it is refused in one line naming the tensor, and nothing is written."""
    change, expected = DAMAGE[damage]
    model = _damaged(merge["model"], tmp_path / "damaged", change)
    code, err = _export(merge, tmp_path / "out", capsys, "--allow-base-mismatch", model=model)  # a copy: other weights
    assert expected in _one_error(code, err)
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["damaged"]
