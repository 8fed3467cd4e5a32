"""Benchmark problems from a local file or the Hugging Face hub, validated before any work starts.

Every failure here is a user error (wrong path, wrong field names, offline hub, a file that is not
text), so it surfaces as a one-line ``UsageError`` naming the flag or file; evaluation never starts on
half-valid data.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.cli import UsageError
from qerl.fsutil import read_small
from qerl.hub import path_shaped

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Problem:
    """One benchmark item: its position in the data set, the question shown to the model, the gold answer."""

    index: int
    question: str
    gold: str


#: The longest line (in characters) a JSONL record may take: a line is read whole before it is parsed.
MAX_LINE_CHARS = 16 << 20
#: The largest .json file read: a JSON array is one document, parsed whole whatever ``--limit`` asks for.
MAX_JSON_BYTES = 256 << 20


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` records (all without one), read line by line: nothing after them is read."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno in itertools.count(1):
            if limit is not None and len(rows) >= limit:
                break
            line = f.readline(MAX_LINE_CHARS + 1)
            if not line:
                break
            if len(line) > MAX_LINE_CHARS:
                raise UsageError(f"{path}:{lineno}: a line longer than {MAX_LINE_CHARS} characters; not a JSONL record")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON list of objects, refused unparsed above :data:`MAX_JSON_BYTES`."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise UsageError(
            f"{path}: larger than {MAX_JSON_BYTES} bytes, and a JSON array is parsed whole; convert it to .jsonl "
            "(one record per line, read only as far as --limit needs)"
        )
    try:
        rows = json.loads(read_small(path, MAX_JSON_BYTES).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UsageError(f"{path}: expected a JSON list of objects")
    return rows


def _read_local(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """Rows of a local file; a file that is not what its suffix says (binary, not UTF-8) is one line too."""
    try:
        return _read_by_suffix(path, limit)
    except UnicodeDecodeError:
        raise UsageError(f"--data {path}: not UTF-8 text (a binary file?); expected a {path.suffix} file") from None


def _read_parquet(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The rows of a parquet file; with ``limit``, only the first batch of that many (not the whole table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if limit is None:
            return pq.read_table(path).to_pylist()
        return next(pq.ParquetFile(path).iter_batches(batch_size=limit), pa.table({})).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise UsageError(
            f"--data {path}: not a readable parquet file ({str(e).strip().splitlines()[0][:200]})"
        ) from None


def _read_by_suffix(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, limit)
    if path.suffix == ".json":
        return _read_json(path)
    if path.suffix == ".parquet":
        return _read_parquet(path, limit)
    raise UsageError(
        f"--data {path}: unsupported file type {path.suffix!r}; expected one of {', '.join(LOCAL_SUFFIXES)}"
    )


def _read_hub(data: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a hub dataset split. Any failure (unknown id, no network, HF_HUB_OFFLINE=1 with no cache)
    becomes one line that says how to pass a local file instead."""
    import datasets

    try:
        return list(datasets.load_dataset(data, config, split=split))
    except Exception as e:  # datasets raises many unrelated types for "cannot get it"
        offline = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--data {data}: not a local file and the hub dataset could not be loaded{offline}: {reason[:200]}; "
            f"pass a local {'/'.join(LOCAL_SUFFIXES)} path"
        ) from None


def load_problems(
    data: str,
    *,
    question_field: str,
    answer_field: str,
    gold: Callable[[str], str],
    split: str = "test",
    config: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Read ``data`` (a local .jsonl/.json/.parquet path or a hub id) into problems.

    ``gold`` turns a raw answer field into the gold string and raises ValueError when it cannot
    (e.g. a GSM8K answer without ``####``). ``limit`` keeps the first N problems, as listed.
    """
    path = Path(data).expanduser()
    if path.is_file():
        rows, where = _read_local(path, limit), str(path)
    elif path.is_dir():
        raise UsageError(
            f"--data {data}: is a directory; expected a {'/'.join(LOCAL_SUFFIXES)} file or a hub dataset id"
        )
    elif path_shaped(data, LOCAL_SUFFIXES):
        raise UsageError(
            f"--data {data}: no such file (expected a {'/'.join(LOCAL_SUFFIXES)} file or a hub dataset id)"
        )
    else:
        rows, where = _read_hub(data, config, split), f"{data}[{split}]"
    if not rows:
        raise UsageError(f"--data {where}: no records")
    if limit is not None:
        rows = rows[:limit]
    problems = []
    for i, row in enumerate(rows):
        for field in (question_field, answer_field):
            if row.get(field) is None:
                raise UsageError(
                    f"{where}: record {i + 1} has no {field!r} field (expected fields {question_field!r} and "
                    f"{answer_field!r}; see --question-field/--answer-field)"
                )
        try:
            gold_answer = gold(str(row[answer_field]))
        except ValueError as e:
            raise UsageError(f"{where}: record {i + 1}: {e}") from None
        problems.append(Problem(index=i, question=str(row[question_field]), gold=gold_answer))
    return problems
