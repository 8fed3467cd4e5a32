"""The per-sample JSONL an evaluation writes as it goes, and resumes from.

One line per (question, sample), appended and flushed after each batch, so an interrupted run
loses at most the batch in flight; a crash mid-line leaves a truncated last line, which the next
run drops before appending. A sidecar ``<output>.meta.json`` (written atomically) records what
determines the samples: the generation settings and content digests of the model and adapter weights
(``qerl.fingerprint``). A run resumes only when all of them match; otherwise (an adapter retrained into
the same directory, another temperature) it starts afresh and says so, after moving the old results
and their meta aside (``<name>.stale-<time>.jsonl``), so one file never mixes two models and no
result is lost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from qerl.cli import UsageError
from qerl.fsutil import append_whole, atomic_write_text, check_regular, read_json, refuse_link

Key = tuple[int, str, int]  # (problem index, question, sample index)


def meta_path(output: Path) -> Path:
    return output.with_name(output.name + ".meta.json")


def record_key(record: dict[str, Any]) -> Key:
    return (int(record["index"]), str(record["question"]), int(record["sample"]))


class ResultFile:
    """Records already in ``path`` (by key) plus an appender for new ones.

    Constructing it only reads: records of a file made with other settings or weights are not used
    (``stale`` names what changed); ``start`` writes, moving such a file aside first.
    """

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        try:  # appending through a planted link would write into its target; a FIFO would hang the read
            refuse_link(path, "--output", "file")
            if path.exists():
                check_regular(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.path = path
        self.settings = dict(settings)
        self.records: dict[Key, dict[str, Any]] = {}
        self._whole_bytes: int | None = None  # where to cut a truncated last line, if any
        self._started = False
        self.stale = self._changed_settings()
        if path.exists() and not self.stale:
            self._load()

    def _changed_settings(self) -> list[str]:
        """The settings (or weight digests) whose recorded values differ from this run's; refuses a
        file whose provenance is unknown, which might not be ours to move."""
        meta = meta_path(self.path)
        if not meta.exists():
            if self.path.exists() and self.path.stat().st_size > 0:
                raise UsageError(
                    f"--output {self.path}: exists without {meta.name}, so its settings are unknown; use a new --output"
                )
            return []
        try:
            previous = read_json(meta)
        except ValueError as e:  # not JSON, not a regular file, too large
            raise UsageError(f"--output {self.path}: {e}; use a new --output") from None
        if not isinstance(previous, dict):
            raise UsageError(f"--output {self.path}: {meta} is not a settings record; use a new --output")
        wanted = self.settings
        return sorted(k for k in wanted.keys() | previous.keys() if wanted.get(k) != previous.get(k))

    def _load(self) -> None:
        data = self.path.read_bytes()
        # Lines are written whole with their newline, so only bytes after the last newline can be a
        # line a crash cut short: those are dropped (and regenerated); any other bad line is corruption.
        body, newline, tail = data.rpartition(b"\n")
        for lineno, line in enumerate(body.split(b"\n") if newline else [], 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                self.records[record_key(record)] = record
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise UsageError(f"--output {self.path}:{lineno}: not a result record; use a new --output") from None
        self._whole_bytes = len(body) + len(newline) if tail else None

    def start(self) -> None:
        """Prepare for appending once all inputs are known to be good: move a stale file aside, create
        the directory and the meta file (atomically), and cut off a line a crash left unfinished.
        Nothing is written before this."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        meta = meta_path(self.path)
        if self.stale:
            aside = self._move_aside()
            print(
                f"note: {self.path} was made with other {', '.join(self.stale)}; starting afresh "
                f"(the old results are now {aside})"
            )
            self.stale = []
        if self._whole_bytes is not None:
            with self.path.open("r+b") as f:
                f.truncate(self._whole_bytes)
            self._whole_bytes = None
        if not meta.exists():
            atomic_write_text(meta, json.dumps(self.settings, indent=1) + "\n")
        self._started = True

    def _move_aside(self) -> Path:
        """Rename the results and their meta to an unused ``<stem>.stale-<time><suffix>`` beside them."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for n in range(1000):
            aside = self.path.with_name(f"{self.path.stem}.stale-{stamp}{f'-{n}' if n else ''}{self.path.suffix}")
            if not aside.exists() and not meta_path(aside).exists():
                break
        else:
            raise UsageError(f"--output {self.path}: too many stale copies beside it; use a new --output")
        if self.path.exists():
            os.replace(self.path, aside)
        os.replace(meta_path(self.path), meta_path(aside))
        return aside

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append whole lines and push them to disk, so a kill loses at most the batch in flight and a
        full disk none of a line; the first append calls :meth:`start`, so that a run stopped
        before its first result leaves nothing behind (not even the meta file). A new file's first batch
        is written beside it and renamed into place: a run stopped by that write (a full disk, Ctrl-C)
        leaves no empty results file, and the meta file written for them is removed again."""
        if not self._started:
            self.start()
        text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        if self.path.exists():
            append_whole(self.path, text)
        else:
            try:
                atomic_write_text(self.path, text, durable=True)
            except BaseException:
                meta_path(self.path).unlink(missing_ok=True)  # settings of results that do not exist
                self._started = False
                raise
        for record in records:
            self.records[record_key(record)] = record
