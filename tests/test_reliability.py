"""Reliability of the commands on hostile input and machines (issue 53): one test per numbered item
that failed before the fix (items 6 and 7 are in test_train_cli.py / test_train_resume.py, item 8 in
test_export.py, the fault injection in test_faults.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval import gsm8k
from eval.results import meta_path
from qerl import export
from qerl.cli import run
from qerl.fsutil import atomic_file
from qerl.load.fingerprint import model_sha256, write_base_record
from qerl.load.loader import load_model
from qerl.runlock import lock_path, run_lock

torch.set_num_threads(1)
GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
EVAL_FLAGS = ["--engine", "hf", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3", "--temperature", "0"]


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    """Two different tiny chat Llamas (``qtiny``, ``qtiny2``), NVFP4, and an adapter bound to ``qtiny``."""
    from peft import get_peft_model
    from tiny_models import make_tiny_chat_model

    from qerl.load.lora import lora_config
    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("reliability")
    qtiny = quantize_checkpoint(make_tiny_chat_model(root / "tiny", smollm2_dir, seed=0), root / "qtiny")
    qtiny2 = quantize_checkpoint(make_tiny_chat_model(root / "tiny2", smollm2_dir, seed=1), root / "qtiny2")
    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(qtiny, device="cpu", dtype=torch.float32), lora_config(r=2))
    peft_model.save_pretrained(root / "adapter")
    write_base_record(root / "adapter", str(qtiny), model_sha256(qtiny))  # what qerl.train.run's save_adapter writes
    return {"qtiny": qtiny, "qtiny2": qtiny2, "adapter": root / "adapter"}


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------ item 1: one writer per output


def test_second_writer_is_refused_naming_the_holder(chat_models, tmp_path: Path, capsys) -> None:
    """Item 1: an evaluation (and an export) into an output another live run holds stops in one line
    naming that run's PID, and touches nothing."""
    data = _data(tmp_path, [GOOD])
    out = tmp_path / "r.jsonl"
    with run_lock(out):
        code = run(
            gsm8k.main, ["--model", str(chat_models["qtiny"]), "--data", str(data), "--output", str(out), *EVAL_FLAGS]
        )
        assert f"another run (PID {os.getpid()}) is writing it" in _one_error(code, capsys.readouterr().err)
        code = export.main(
            [
                "--model",
                str(chat_models["qtiny"]),
                "--lora",
                str(chat_models["adapter"]),
                "--output",
                str(tmp_path / "r.jsonl"),
            ]
        )
        assert "another run (PID" in _one_error(code, capsys.readouterr().err)
    assert not out.exists() and not meta_path(out).exists() and not lock_path(out).exists()


def test_dead_holders_lock_is_taken_over(tmp_path: Path, caplog) -> None:
    """Item 1: a lock file left by a process that died (the kernel dropped its flock) does not block."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "out"
    lock_path(out).write_text(f"{dead.pid}\n")
    with caplog.at_level(logging.WARNING, logger="qerl.runlock"), run_lock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert f"taking over the lock of PID {dead.pid}" in caplog.text and not lock_path(out).exists()


def test_two_atomic_writers_of_one_file_do_not_collide(tmp_path: Path) -> None:
    """Item 1: two writers of the same file (two runs drawing one plot) each get their own temp file;
    the shared temp name made the second rename fail with FileNotFoundError."""
    target = tmp_path / "plot.csv"
    with atomic_file(target) as first, atomic_file(target) as second:
        assert first != second
        first.write_text("a\n")
        second.write_text("b\n")
    assert target.read_text() == "a\n" and [p.name for p in tmp_path.iterdir()] == ["plot.csv"]


# ----------------------------------------------------------------------- item 2: integrity of loaded weights


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
    data = _data(tmp_path, [GOOD])
    code = run(
        gsm8k.main, ["--model", str(broken), "--data", str(data), "--output", str(tmp_path / "r.jsonl"), *EVAL_FLAGS]
    )
    assert name in _one_error(code, capsys.readouterr().err) and not (tmp_path / "r.jsonl").exists()
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
    assert name in _one_error(code, capsys.readouterr().err) and not (tmp_path / "x").exists()


def test_nan_adapter_is_refused(chat_models, tmp_path: Path, capsys) -> None:
    """Item 2: the same for an adapter's tensors, in export and eval."""
    adapter = tmp_path / "adapter"
    shutil.copytree(chat_models["adapter"], adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("inf")
    save_file(tensors, adapter / "adapter_model.safetensors")
    code = export.main(["--model", str(chat_models["qtiny"]), "--lora", str(adapter), "--output", str(tmp_path / "x")])
    assert name in _one_error(code, capsys.readouterr().err)
    code = run(
        gsm8k.main,
        [
            "--model",
            str(chat_models["qtiny"]),
            "--lora",
            str(adapter),
            "--data",
            str(_data(tmp_path, [GOOD])),
            "--output",
            str(tmp_path / "r.jsonl"),
            *EVAL_FLAGS,
        ],
    )
    assert name in _one_error(code, capsys.readouterr().err) and not (tmp_path / "r.jsonl").exists()


# --------------------------------------------------------------------- item 3: adapters bound by content


def test_adapter_is_refused_on_another_base(chat_models, tmp_path: Path, capsys) -> None:
    """Item 3: export merged an adapter into another model with rc 0, and eval accepted another model
    under the right directory name; both now compare the recorded digest, and --allow-base-mismatch waives it."""
    adapter = chat_models["adapter"]
    code = export.main(["--model", str(chat_models["qtiny2"]), "--lora", str(adapter), "--output", str(tmp_path / "x")])
    assert "--allow-base-mismatch" in _one_error(code, capsys.readouterr().err) and not (tmp_path / "x").exists()
    record = export.export(chat_models["qtiny2"], adapter, tmp_path / "x", allow_base_mismatch=True)
    assert record["base_verified"] is False
    assert export.export(chat_models["qtiny"], adapter, tmp_path / "y")["base_verified"] is True

    impostor = tmp_path / "other" / "qtiny"  # qtiny2's weights under qtiny's directory name
    shutil.copytree(chat_models["qtiny2"], impostor)
    data = _data(tmp_path, [GOOD])
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
    assert "was trained on" in _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    copy = tmp_path / "copy" / "renamed"  # the same weights under any name are accepted
    shutil.copytree(chat_models["qtiny"], copy)
    argv[1] = str(copy)
    assert gsm8k.main(argv).questions == 1


# ------------------------------------------------------------------------- item 4: OS errors in one line


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_is_one_line(chat_models, tmp_path: Path, capsys, monkeypatch, code: int) -> None:
    """Item 4: safetensors' ``SafetensorError: ... No space left on device`` (and EROFS) was a traceback
    with rc 1; now ``error: cannot write FILE: reason``, rc 2, and no output under its final name."""
    from safetensors import SafetensorError

    def failing(tensors, filename, metadata=None):
        raise SafetensorError(
            f'Error while serializing: IoError(Os {{ code: {code}, kind: Other, message: "{os.strerror(code)}" }})'
        )

    monkeypatch.setattr("safetensors.torch.save_file", failing)
    rc = export.main(
        ["--model", str(chat_models["qtiny"]), "--lora", str(chat_models["adapter"]), "--output", str(tmp_path / "x")]
    )
    line = _one_error(rc, capsys.readouterr().err)
    assert line.startswith(f"error: cannot write {tmp_path}") and line.endswith(os.strerror(code).lower()), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


# ----------------------------------------------------------------------- item 5: inputs bounded before work


def test_huge_question_is_refused_before_any_model_work(
    chat_models, tmp_path: Path, capsys, monkeypatch, caplog
) -> None:
    """Item 5: an 8 MB question ran for minutes to 14 GB; now it is refused in seconds, before the
    model loads, and leaves no meta file; ``--long-prompts truncate`` cuts it and says so."""
    data = _data(tmp_path, [GOOD, {"question": "What is 1 + 1? " * 530_000, "answer": "#### 2"}])
    out = tmp_path / "r.jsonl"
    argv = ["--model", str(chat_models["qtiny"]), "--data", str(data), "--output", str(out), *EVAL_FLAGS]
    start = time.perf_counter()
    with monkeypatch.context() as m:
        m.setattr("eval.loading.load_base", lambda *a, **k: pytest.fail("model loaded for a refused prompt"))
        line = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert "record 2's prompt" in line and "--long-prompts truncate" in line, line
    assert time.perf_counter() - start < 20
    assert not out.exists() and not meta_path(out).exists() and not lock_path(out).exists()
    with caplog.at_level(logging.WARNING, logger="eval.prompting"):
        result = gsm8k.main(argv + ["--long-prompts", "truncate"])
    assert result.questions == 2 and "record 2's question cut" in caplog.text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]


# ------------------------------------------------------------------ item 10: a model without a chat template


def test_model_without_chat_template_is_one_line(chat_models, tmp_path: Path, capsys) -> None:
    """Item 10: a checkpoint saved without chat_template.jinja made eval die in transformers with a
    ValueError traceback; now one line says what is missing and how to pass one (--chat-template)."""
    bare = tmp_path / "bare"
    shutil.copytree(chat_models["qtiny"], bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    data = _data(tmp_path, [GOOD])
    argv = ["--model", str(bare), "--data", str(data), "--output", str(tmp_path / "r.jsonl"), *EVAL_FLAGS]
    line = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert "has no chat template" in line and "--chat-template FILE" in line, line
    assert not (tmp_path / "r.jsonl").exists()
    assert gsm8k.main(argv + ["--chat-template", str(chat_models["qtiny"] / "chat_template.jinja")]).questions == 1


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{% for m in messages %}{{ m['content'] }", "not a usable Jinja chat template"),
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "does not contain the user's message"),
    ],
)
def test_broken_chat_template_file_is_one_line(chat_models, tmp_path: Path, capsys, text: str, expected: str) -> None:
    """A --chat-template file that does not parse, raises, or drops the question is refused in one line
    naming the file before the model loads (it used to fail at the first question, or score 0)."""
    template = tmp_path / "broken.jinja"
    template.write_text(text)
    data = _data(tmp_path, [GOOD])
    argv = [
        "--model",
        str(chat_models["qtiny"]),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
        "--chat-template",
        str(template),
    ]
    line = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert f"--chat-template {template}" in line and expected in line, line
    assert not (tmp_path / "r.jsonl").exists()


def test_full_disk_mid_append_leaves_no_part_of_a_line(tmp_path: Path, monkeypatch) -> None:
    """Item 4: results and metrics are appended; a write cut short by a full disk is rolled back to the
    last whole line instead of leaving half a record for the next reader."""
    from qerl.fsutil import append_whole

    path = tmp_path / "m.jsonl"
    append_whole(path, '{"step": 1}\n')
    real_write, calls = os.write, []

    def short_then_full(fd: int, data) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:4]))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError, match="No space left"):
        append_whole(path, '{"step": 2}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n' and len(calls) == 2
