"""What eval reads and where it writes (issue 72): results never go through a planted link, and the data file is
read only as far as --limit needs (a JSON array is bounded in size). Each test was seen to fail before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safety_fixtures as sf
import torch
from safety_fixtures import own_caches, qtiny  # noqa: F401 (fixtures)

from qerl.cli import run

torch.set_num_threads(1)


def test_eval_refuses_a_linked_output(qtiny, tmp_path: Path, capsys) -> None:  # noqa: F811
    """--output planted as a link to an (empty) file of someone else's: eval appended its results through it; now
    it refuses the link in one line, as export and quantize do, and the target stays as it was."""
    from eval import gsm8k

    victim = tmp_path / "authorized_keys"
    victim.write_text("")
    link = tmp_path / "r.jsonl"
    link.symlink_to(victim)
    argv = [*sf.eval_argv(qtiny, tmp_path), "--output", str(link)]  # the last --output counts
    line = sf.one_error(run(gsm8k.main, argv), capsys.readouterr().err)
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
