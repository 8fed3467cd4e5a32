"""Evaluation resumes only work made by the same weights and settings (issue 16, item 2).

A results JSONL is keyed on the generation settings and on content digests of the model and adapter:
retraining an adapter into the same directory, or rewriting the model in place, must regenerate
everything (the old file is kept beside, renamed), never report the old accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_chat_model

from eval import gsm8k
from eval.results import meta_path

torch.set_num_threads(1)

QUESTIONS = [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"question": "What is 7 - 4?", "answer": "#### 3"}]


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests of these throw-away models stay out of the user's cache (only explicit paths are used)."""
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


def _adapter(base: Path, out: Path, seed: int) -> Path:
    """A LoRA adapter whose B matrices are random, so that it changes what the base generates."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from qerl.load.lora import lora_config

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, lora_config(r=2, target_modules=("q_proj", "v_proj", "o_proj")))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft.save_pretrained(out)
    return out


def _eval(base: Path, adapter: Path, data: Path, out: Path) -> list[str]:
    gsm8k.main(
        [
            "--model",
            str(base),
            "--lora",
            str(adapter),
            "--data",
            str(data),
            "--output",
            str(out),
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def test_weights_changed_at_the_same_path_are_evaluated_afresh(
    smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_tiny_chat_model(tmp_path / "base", smollm2_dir, seed=0)
    adapter = _adapter(base, tmp_path / "run" / "adapter", seed=1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "eval" / "gsm8k.jsonl"
    first = _eval(base, adapter, data, out)
    capsys.readouterr()
    assert _eval(base, adapter, data, out) == first  # same weights: resumed, nothing regenerated
    assert "resuming, 2 samples done, 0 to generate" in capsys.readouterr().out

    _adapter(base, adapter, seed=2)  # "retrained" into the same directory
    retrained = _eval(base, adapter, data, out)
    assert retrained == _eval(base, adapter, data, tmp_path / "fresh-adapter.jsonl")  # what these weights generate
    assert retrained != first
    note = capsys.readouterr().out
    assert "lora_sha256" in note and "starting afresh" in note
    stale = sorted(out.parent.glob("gsm8k.stale-*.jsonl"))
    assert len(stale) == 1 and [json.loads(x)["completion"] for x in stale[0].read_text().splitlines()] == first
    assert meta_path(stale[0]).exists()  # kept with its settings, nothing lost

    make_tiny_chat_model(base, smollm2_dir, seed=3)  # the base model rewritten in place
    rebased = _eval(base, adapter, data, out)
    assert "model_sha256" in capsys.readouterr().out
    assert rebased == _eval(base, adapter, data, tmp_path / "fresh-base.jsonl") and rebased != retrained
    assert len(list(out.parent.glob("gsm8k.stale-*.jsonl"))) == 2


def test_changed_settings_start_afresh_and_keep_the_old_file(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(QUESTIONS[0]) + "\n")
    out = tmp_path / "out.jsonl"
    record = {
        "index": 0,
        "sample": 0,
        "question": QUESTIONS[0]["question"],
        "gold": "5",
        "completion": "#### 5",
        "extracted": "5",
        "method": "####",
        "correct": True,
        "finish_reason": "stop",
        "completion_tokens": 3,
    }
    out.write_text(json.dumps(record) + "\n")
    meta_path(out).write_text(json.dumps({"benchmark": "gsm8k", "model": str(tiny_dense_dir), "temperature": 1.0}))
    result = gsm8k.main(
        [
            "--model",
            str(tiny_dense_dir),
            "--data",
            str(data),
            "--output",
            str(out),
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert result.correct == 0  # a random tiny model, not the hand-written "correct" record
    assert "starting afresh" in capsys.readouterr().out
    (stale,) = tmp_path.glob("out.stale-*.jsonl")
    assert stale.read_text() == json.dumps(record) + "\n"
    assert json.loads(meta_path(stale).read_text())["temperature"] == 1.0
    assert json.loads(meta_path(out).read_text())["temperature"] == 0.0
