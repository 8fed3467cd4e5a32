"""Adapters know their base (README, "Adapters know their base"): training records the base model's content digest
in its adapter, and export and eval refuse another model whatever its folder is called (``--allow-base-mismatch``
waives it); the digest covers the weights and config.json only; an adapter made elsewhere, without that record, is
held to the base its adapter_config.json names. Each test was seen to fail before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import EVAL_FLAGS, GOOD, data_file, eval_argv, one_error, with_config

from eval import gsm8k
from qerl import export
from qerl.cli import run

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def test_adapter_is_refused_on_another_base(chat_models, tmp_path: Path, capsys) -> None:
    """Item 3: export merged an adapter into another model with rc 0, and eval accepted another model
    under the right directory name; both now compare the recorded digest, and --allow-base-mismatch waives it."""
    adapter = chat_models["adapter"]
    code = export.main(["--model", str(chat_models["qtiny2"]), "--lora", str(adapter), "--output", str(tmp_path / "x")])
    assert "--allow-base-mismatch" in one_error(code, capsys.readouterr().err) and not (tmp_path / "x").exists()
    record = export.export(chat_models["qtiny2"], adapter, tmp_path / "x", allow_base_mismatch=True)
    assert record["base_verified"] is False
    assert export.export(chat_models["qtiny"], adapter, tmp_path / "y")["base_verified"] is True

    impostor = tmp_path / "other" / "qtiny"  # qtiny2's weights under qtiny's directory name
    shutil.copytree(chat_models["qtiny2"], impostor)
    data = data_file(tmp_path, [GOOD])
    argv = [
        "--model",
        str(impostor),
        "--lora",
        str(adapter),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
    ]
    assert "was trained on" in one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    copy = tmp_path / "copy" / "renamed"  # the same weights under any name are accepted
    shutil.copytree(chat_models["qtiny"], copy)
    argv[1] = str(copy)
    assert gsm8k.main(argv).questions == 1


def test_model_digest_covers_the_weights_and_config_only(qtiny, tmp_path: Path) -> None:
    """A NOTES.md, or eval's lock file of an output written inside the model directory, made every adapter of the
    model 'trained on other weights'; a changed config or weight still does."""
    from qerl.fingerprint import model_sha256

    model = shutil.copytree(qtiny, tmp_path / "model")
    digest = model_sha256(model)
    (model / "NOTES.md").write_text("my notes\n")
    (model / ".results.jsonl.lock").write_text("123\n")
    (model / "results.jsonl").write_text("{}\n")
    assert model_sha256(model) == digest
    with_config(model, tmp_path / "other", rms_norm_eps=1e-3)
    assert model_sha256(tmp_path / "other") != digest


def test_export_refuses_an_adapter_made_for_another_base_as_eval_does(qtiny, tmp_path: Path, capsys) -> None:
    """An adapter without qerl_base.json (made elsewhere) records its base's name only: eval refused it on another
    base, export merged it with rc 0 and no warning."""
    from peft import get_peft_model

    from eval import gsm8k
    from qerl import export
    from qerl.cli import run
    from qerl.load.loader import load_model
    from qerl.load.lora import lora_config

    adapter = tmp_path / "adapter"
    get_peft_model(load_model(qtiny, device="cpu", dtype=torch.float32), lora_config(r=2)).save_pretrained(adapter)
    assert not (adapter / "qerl_base.json").exists()
    other = shutil.copytree(qtiny, tmp_path / "other-model")
    argv = ["--model", str(other), "--lora", str(adapter), "--output", str(tmp_path / "merged")]
    line = one_error(export.main(argv), capsys.readouterr().err)
    assert "adapter was made for base model" in line and "--allow-base-mismatch" in line, line
    evaluation = eval_argv(other, tmp_path, "--lora", str(adapter))
    assert "adapter was made for base model" in one_error(run(gsm8k.main, evaluation), capsys.readouterr().err)
    assert not (tmp_path / "merged").exists()
    assert export.main(argv + ["--allow-base-mismatch"]) == 0
    assert export.main(["--model", str(qtiny), "--lora", str(adapter), "--output", str(tmp_path / "m2")]) == 0
