"""``python -m qerl.train``'s setup, from argv to the trainer: what it reads of the model, and how often. The name
``--model_name`` gives is resolved (``qerl.hub.resolve_model``: the embedded default's directory, a local path or a
hub id) once, and every later step (the output-directory check, the tokenizer, the prompt budget, the memory check,
the model's digest, the load) is handed the result: it was resolved 7 times along that path (6 on a CPU, where the
memory check does not read the model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qerl import hub
from qerl.train import run as train_run


class Prepared(Exception):
    """Raised where the setup hands over to the training itself."""


def test_the_model_name_is_resolved_once(tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    resolved: list[str] = []
    resolve = hub.resolve_model
    monkeypatch.setattr(hub, "resolve_model", lambda name: resolved.append(str(name)) or resolve(name))
    check_fits = train_run.check_fits

    def on_a_card(script, config, prompt_tokens, model_dir):  # the memory check reads the model only with CUDA
        with monkeypatch.context() as card:
            card.setattr(config, "use_cpu", False)
            card.setattr(torch.cuda, "is_available", lambda: True)
            card.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
            card.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(name="Mock GPU"))
            estimate = check_fits(script, config, prompt_tokens, model_dir)
        assert estimate is not None  # it ran, and read the model's config.json
        return estimate

    def fit(script, prepared, out):
        assert prepared.trainer.model is not None and prepared.base_digest is not None
        raise Prepared

    monkeypatch.setattr(train_run, "check_fits", on_a_card)
    monkeypatch.setattr(train_run, "fit", fit)
    argv = [
        "--model-name", str(tiny_dense_dir), "--dataset", "arithmetic", "--num-samples", "8", "--max-steps", "1",
        "--per-device-train-batch-size", "2", "--num-generations", "2", "--max-completion-length", "4",
        "--output-dir", str(tmp_path / "run"), "--report-to", "none",
    ]  # fmt: skip
    with pytest.raises(Prepared):
        train_run.main(argv)
    assert resolved == [str(tiny_dense_dir)]
