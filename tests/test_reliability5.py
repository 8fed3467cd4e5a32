"""Reliability of export and evaluation on hostile input (issue 60, the eval/export side): one test per
class of defect, each seen to fail before its fix."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import MARKER, VOCAB, make_adapter
from test_reliability3 import (
    EVAL_FLAGS,
    GOOD,
    _data,
    _one_error,
    _with_config,
    qtiny,  # noqa: F401 (a fixture: a tiny NVFP4 chat Llama)
)
from tiny_models import make_tiny_llama

from qerl import export
from qerl.quantize.pipeline import quantize_checkpoint

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
    code, err = _export(merge, tmp_path / "out", capsys, "--allow-base-mismatch", model=model)  # a copy: other weights
    assert expected in _one_error(code, err)
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["damaged"]


# --- one-line errors that name their file; no empty output ----------------------------------------------------


def _full_disk(*args: object, **kwargs: object) -> None:
    """A full disk as ``write()`` or ``fsync()`` report it: an errno and no file name."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_export_full_disk_names_the_file(merge, tmp_path: Path, capsys, monkeypatch) -> None:
    """``error: cannot write: no space left on device`` named no file; now the file, under the output's own name."""
    real = Path.write_text
    monkeypatch.setattr(
        Path, "write_text", lambda self, *a, **k: _full_disk() if self.name == "config.json" else real(self, *a, **k)
    )
    code, err = _export(merge, tmp_path / "out", capsys)
    assert _one_error(code, err) == f"error: cannot write {tmp_path / 'out' / 'config.json'}: no space left on device"
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []


def test_export_to_a_symlink_is_refused_before_the_merge(merge, tmp_path: Path, capsys, monkeypatch) -> None:
    """--output LINK --overwrite, LINK pointing at an earlier export: a traceback after the whole merge; now one line
    before any work, the earlier export untouched."""
    assert _export(merge, tmp_path / "real", capsys)[0] == 0
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setattr(export, "merge_to_dense", lambda *a, **k: pytest.fail("merged before checking --output"))
    code, err = _export(merge, tmp_path / "link", capsys, "--overwrite")
    assert "is a symbolic link" in _one_error(code, err)
    assert (tmp_path / "real" / MARKER).is_file() and (tmp_path / "link").is_symlink()


def test_eval_stopped_at_its_first_write_leaves_no_empty_output(qtiny, tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: F811
    """A full disk at eval's first write left a 0-byte JSONL (and its meta file) and named no file; now nothing
    is left and the message names the results file."""
    from eval import gsm8k
    from qerl.cli import run

    out = tmp_path / "r.jsonl"
    argv = ["--model", str(qtiny), "--data", str(_data(tmp_path, [GOOD])), "--output", str(out), *EVAL_FLAGS]
    monkeypatch.setattr(os, "fsync", _full_disk)
    error = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["d.jsonl"]
    assert error == f"error: cannot write {out}: no space left on device"


# --- leftovers ------------------------------------------------------------------------------------------------

#: An export killed (SIGKILL: nothing of it runs on the way out) after its dense merge, inside the re-quantization.
_KILLED_EXPORT = """
import os, signal, sys
from qerl import export
export.requantize = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
sys.exit(export.main(sys.argv[1:]))
"""


def test_rerun_removes_what_a_killed_nvfp4_export_left(merge, tmp_path: Path, capsys) -> None:
    """A killed --format nvfp4 export left a dense copy of the model (``.NAME.bf16-*``) and its partial output
    (``.NAME.tmp-*``) that no rerun removed; now the rerun removes them, and only them: a look-alike directory
    without our mark, and a link to a marked one, stay."""
    from qerl.fsutil import SCRATCH_MARK

    out = tmp_path / "out"
    argv = ["--model", str(merge["model"]), "--lora", str(merge["adapter"]), "--output", str(out), "--format", "nvfp4"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr
    left = sorted(p.name.rpartition("-")[0] for p in tmp_path.glob(".out.*-*"))
    assert left == [".out.bf16", ".out.tmp"] and not out.exists()
    foreign = tmp_path / ".out.tmp-notours"
    foreign.mkdir()
    (foreign / "keep").write_text("mine")
    marked = tmp_path / "elsewhere"
    marked.mkdir()
    (marked / SCRATCH_MARK).touch()
    (tmp_path / ".out.bf16-link").symlink_to(marked)

    assert export.main(argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(".out.*-*")) == [".out.bf16-link", ".out.tmp-notours"]
    assert (foreign / "keep").read_text() == "mine" and (marked / SCRATCH_MARK).exists()
    assert not (out / SCRATCH_MARK).exists()


# --- chat templates and prompts held to bounds -----------------------------------------------------------------

#: SmolLM2's chat template, as the tiny chat model has it.
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Each a template that works but past one bound: a 2 MB file (a comment pads it), a loop of about a minute
#: before any output, two megabytes of its own text per prompt.
TEMPLATES = {
    "file size": ("{# " + "x" * (2 << 20) + " #}" + _TEMPLATE, "larger than 1048576 bytes"),
    "time": (
        "{% for i in range(100000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}" + _TEMPLATE,
        "took longer than 2 s",
    ),
    "output": ("{% for i in range(2000) %}{{ 'x' * 1000 }}{% endfor %}" + _TEMPLATE, "it adds 2000"),
}


@pytest.mark.parametrize("bound", sorted(TEMPLATES))
def test_eval_chat_template_past_its_bounds_is_named(qtiny, tmp_path: Path, capsys, bound: str) -> None:  # noqa: F811
    """A 200 MB template file was accepted, a looping one ran on, and one writing megabytes per prompt had the
    question blamed for the prompt's length; now each is refused in one line naming the template, within seconds."""
    from eval import gsm8k
    from qerl.cli import run

    text, expected = TEMPLATES[bound]
    template = tmp_path / "t.jinja"
    template.write_text(text)
    out = tmp_path / "r.jsonl"
    argv = [
        "--model",
        str(qtiny),
        "--data",
        str(_data(tmp_path, [GOOD])),
        "--output",
        str(out),
        "--chat-template",
        str(template),
        *EVAL_FLAGS,
    ]
    start = time.monotonic()
    error = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert error.startswith(f"error: --chat-template {template}: ") and expected in error, error
    assert time.monotonic() - start < 20 and not out.exists()


def test_eval_question_bound_does_not_grow_with_the_context(qtiny, tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: F811
    """With a 128K context the character bound let an 8 MB question through to the tokenizer (22 s, 2.7 GB, Ctrl-C
    heard after 13.7 s); now no tokenizer call sees more than half a million characters, whatever the context."""
    from eval import gsm8k, prompting
    from qerl.cli import run

    model = _with_config(qtiny, tmp_path / "long", max_position_embeddings=131072)
    seen: list[int] = []
    real = prompting.render
    monkeypatch.setattr(
        prompting, "render", lambda tok, question, style: seen.append(len(question)) or real(tok, question, style)
    )
    huge = {**GOOD, "question": "What is 2 + 3? " * (8 << 16)}  # 8 MB
    argv = [
        "--model",
        str(model),
        "--data",
        str(_data(tmp_path, [huge])),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
        "--allow-base-mismatch",
    ]
    error = _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert "record 1's prompt (7864320 characters)" in error and max(seen) <= 600_000, (error, seen)
