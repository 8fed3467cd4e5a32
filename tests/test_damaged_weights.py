"""Damaged weights stop every command in one line naming the tensor (README, "Damaged weights"): a NaN FP8 block
scale in a checkpoint (load, eval, export), an Inf in an adapter (export, eval), and a header that lies about a
tensor (export, which copies tensors whole, checks each against the model's config first). Each test was seen to
fail before its fix."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import EVAL_FLAGS, GOOD, data_file, eval_argv, one_error, run_export
from safetensors.torch import load_file, save_file
from tiny_models import SMALL_VOCAB

from eval import gsm8k
from qerl import export
from qerl.cli import run
from qerl.load.loader import load_model

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def _nan_scale_copy(model_dir: Path, out: Path) -> str:
    """A copy of ``model_dir`` with one FP8 block scale set to NaN (byte 0x7f); returns the tensor's name."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("o_proj.weight_scale"))
    raw = tensors[name].view(torch.uint8).clone()
    raw.view(-1)[3] = 0x7F
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return name


def test_nan_block_scale_is_refused_by_load_eval_and_export(chat_models, tmp_path: Path, capsys) -> None:
    """Item 2: a NaN FP8 block scale inside a valid checkpoint stopped nothing (eval printed nonsense,
    export wrote NaN weights, train logged a NaN gradient norm); now every load names the tensor."""
    broken = tmp_path / "broken"
    name = _nan_scale_copy(chat_models["qtiny"], broken)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has 1 NaN or negative FP8 block scales"):
        load_model(broken, device="cpu")  # what train and eval load through
    data = data_file(tmp_path, [GOOD])
    code = run(
        gsm8k.main, ["--model", str(broken), "--data", str(data), "--output", str(tmp_path / "r.jsonl"), *EVAL_FLAGS]
    )
    assert name in one_error(code, capsys.readouterr().err) and not (tmp_path / "r.jsonl").exists()
    code = export.main(
        [
            "--model",
            str(broken),
            "--lora",
            str(chat_models["adapter"]),
            "--output",
            str(tmp_path / "x"),
            "--allow-base-mismatch",
        ]
    )
    assert name in one_error(code, capsys.readouterr().err) and not (tmp_path / "x").exists()


def test_nan_adapter_is_refused(chat_models, tmp_path: Path, capsys) -> None:
    """Item 2: the same for an adapter's tensors, in export and eval."""
    adapter = tmp_path / "adapter"
    shutil.copytree(chat_models["adapter"], adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("inf")
    save_file(tensors, adapter / "adapter_model.safetensors")
    code = export.main(["--model", str(chat_models["qtiny"]), "--lora", str(adapter), "--output", str(tmp_path / "x")])
    assert name in one_error(code, capsys.readouterr().err)
    code = run(
        gsm8k.main,
        eval_argv(chat_models["qtiny"], tmp_path, "--lora", str(adapter)),
    )
    assert name in one_error(code, capsys.readouterr().err) and not (tmp_path / "r.jsonl").exists()


def _damaged(model: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``model`` whose weights file went through ``change`` (a header that lies about a tensor)."""
    shutil.copytree(model, out)
    state = load_file(out / "model.safetensors")
    change(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


DAMAGE = {
    "larger tensor": (
        lambda s: s.update({"model.embed_tokens.weight": torch.zeros(4 * SMALL_VOCAB, 64, dtype=torch.bfloat16)}),
        "vocab_size gives 'model.embed_tokens.weight' 256 rows, but model.safetensors declares it [1024, 64]",
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
    code, err = run_export(
        merge, tmp_path / "out", capsys, "--allow-base-mismatch", model=model
    )  # a copy: other weights
    assert expected in one_error(code, err)
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["damaged"]
