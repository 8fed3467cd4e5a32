"""What eval reads and where it writes: results never go through a planted link, the data file is read only as far as
--limit needs (a JSON array is bounded in size), and every input is bounded before the model loads: a question too
long for the context, a model without a chat template, a --chat-template file that does not parse, raises, drops
the question or passes its bounds (size, time, output per prompt), numbers out of range. Each test was seen to fail
before its fix."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from helpers import EVAL_FLAGS, GOOD, data_file, eval_argv, one_error, with_config

from eval import gsm8k
from eval.results import meta_path
from qerl.cli import run
from qerl.runlock import lock_path

pytestmark = pytest.mark.usefixtures("own_caches")


def test_eval_refuses_a_linked_output(qtiny, tmp_path: Path, capsys) -> None:
    """--output planted as a link to an (empty) file of someone else's: eval appended its results through it; now
    it refuses the link in one line, as export and quantize do, and the target stays as it was."""
    from eval import gsm8k

    victim = tmp_path / "authorized_keys"
    victim.write_text("")
    link = tmp_path / "r.jsonl"
    link.symlink_to(victim)
    argv = [*eval_argv(qtiny, tmp_path), "--output", str(link)]  # the last --output counts
    line = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert line == f"error: --output {link}: is a symbolic link; name the file itself", line
    assert victim.read_text() == "" and link.is_symlink()


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)]


def _load(path: Path, limit: int | None):
    from eval.data import load_problems
    from eval.gsm8k import GSM8K

    return load_problems(str(path), question_field="question", answer_field="answer", gold=GSM8K.gold, limit=limit)


def test_jsonl_is_read_only_as_far_as_the_limit(tmp_path: Path, monkeypatch) -> None:
    """--limit 5 on a 1 GiB JSONL parsed the whole file (killed at 6 GiB); now reading stops after the fifth record:
    what follows it (here a line that is not JSON, then a line longer than any record) is never read."""
    from eval import data

    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(5)) + "not json\n" + "x" * 4096 + "\n")
    assert [p.gold for p in _load(path, 5)] == ["1", "2", "3", "4", "5"]
    monkeypatch.setattr(data, "MAX_LINE_CHARS", 1024)
    with pytest.raises(SystemExit, match=r"big\.jsonl:6: not valid JSON"):
        _load(path, None)
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(5)) + "x" * 4096 + "\n")
    with pytest.raises(SystemExit, match=r"big\.jsonl:6: a line longer than 1024 characters"):
        _load(path, None)


def test_json_array_over_the_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    """A JSON array is one document, parsed whole whatever --limit says: above MAX_JSON_BYTES it is refused in one
    line that points to JSONL, before a byte of it is parsed."""
    from eval import data

    path = tmp_path / "big.json"
    path.write_text(json.dumps(_rows(200)))
    monkeypatch.setattr(data, "MAX_JSON_BYTES", 1024)
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed a JSON file over the bound"))
    with pytest.raises(SystemExit, match=r"big\.json: larger than 1024 bytes.*\.jsonl"):
        _load(path, 5)


# --- bounded inputs: prompts, chat templates, numbers ---------------------------------------------------------------


def test_huge_question_is_refused_before_any_model_work(
    chat_models, tmp_path: Path, capsys, monkeypatch, caplog
) -> None:
    """Item 5: an 8 MB question ran for minutes to 14 GB; now it is refused in seconds, before the
    model loads, and leaves no meta file; ``--long-prompts truncate`` cuts it and says so."""
    data = data_file(tmp_path, [GOOD, {"question": "What is 1 + 1? " * 530_000, "answer": "#### 2"}])
    out = tmp_path / "r.jsonl"
    argv = ["--model", str(chat_models["qtiny"]), "--data", str(data), "--output", str(out), *EVAL_FLAGS]
    start = time.perf_counter()
    with monkeypatch.context() as m:
        m.setattr("eval.loading.load_base", lambda *a, **k: pytest.fail("model loaded for a refused prompt"))
        line = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert "record 2's prompt" in line and "--long-prompts truncate" in line, line
    assert time.perf_counter() - start < 20
    assert not out.exists() and not meta_path(out).exists() and not lock_path(out).exists()
    with caplog.at_level(logging.WARNING, logger="eval.prompting"):
        result = gsm8k.main(argv + ["--long-prompts", "truncate"])
    assert result.questions == 2 and "record 2's question cut" in caplog.text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]


def test_model_without_chat_template_is_one_line(chat_models, tmp_path: Path, capsys) -> None:
    """Item 10: a checkpoint saved without chat_template.jinja made eval die in transformers with a
    ValueError traceback; now one line says what is missing and how to pass one (--chat-template)."""
    bare = tmp_path / "bare"
    shutil.copytree(chat_models["qtiny"], bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    data = data_file(tmp_path, [GOOD])
    argv = ["--model", str(bare), "--data", str(data), "--output", str(tmp_path / "r.jsonl"), *EVAL_FLAGS]
    line = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
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
    data = data_file(tmp_path, [GOOD])
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
    line = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert f"--chat-template {template}" in line and expected in line, line
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--samples", "100000000"], "--samples"),
    ],
)
def test_eval_numbers_out_of_range_are_one_line(qtiny, tmp_path: Path, capsys, flags: list[str], expected: str) -> None:
    """--samples 100000000 ran out of memory before any output; --temperature nan was recorded as invalid JSON."""
    from eval import gsm8k
    from qerl.cli import run

    out = tmp_path / "r.jsonl"
    argv = eval_argv(qtiny, tmp_path, *flags)
    assert one_error(run(gsm8k.main, argv), capsys.readouterr().err).startswith(f"error: {expected}")
    assert not out.exists()


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
def test_eval_chat_template_past_its_bounds_is_named(qtiny, tmp_path: Path, capsys, bound: str) -> None:
    """A 200 MB template file was accepted, a looping one ran on, and one writing megabytes per prompt had the
    question blamed for the prompt's length; now each is refused in one line naming the template, within seconds."""
    from eval import gsm8k
    from qerl.cli import run

    text, expected = TEMPLATES[bound]
    template = tmp_path / "t.jinja"
    template.write_text(text)
    out = tmp_path / "r.jsonl"
    argv = eval_argv(qtiny, tmp_path, "--chat-template", str(template))
    start = time.monotonic()
    error = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert error.startswith(f"error: --chat-template {template}: ") and expected in error, error
    assert time.monotonic() - start < 20 and not out.exists()


def test_eval_question_bound_does_not_grow_with_the_context(qtiny, tmp_path: Path, capsys, monkeypatch) -> None:
    """With a 128K context the character bound let an 8 MB question through to the tokenizer (22 s, 2.7 GB, Ctrl-C
    heard after 13.7 s); now no tokenizer call sees more than half a million characters, whatever the context."""
    from eval import gsm8k, prompting
    from qerl.cli import run

    model = with_config(qtiny, tmp_path / "long", max_position_embeddings=131072)
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
        str(data_file(tmp_path, [huge])),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
        "--allow-base-mismatch",
    ]
    error = one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    assert "record 1's prompt (7864320 characters)" in error and max(seen) <= 600_000, (error, seen)
