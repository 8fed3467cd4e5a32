"""The per-sample JSONL an evaluation writes as it goes, and resumes from.

One line per (question, sample), appended and flushed after each batch, so an interrupted run
loses at most the batch in flight; a crash mid-line leaves a truncated last line, which the next
run drops before appending. A sidecar ``<output>.meta.json`` (written atomically) records the
settings that determine the samples; resuming with different ones is refused, so one file never
mixes two models or two temperatures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qerl.fsutil import atomic_write_text

Key = tuple[int, str, int]  # (problem index, question, sample index)

def meta_path(output: Path) -> Path:
    return output.with_name(output.name + ".meta.json")


def record_key(record: dict[str, Any]) -> Key:
    return (int(record["index"]), str(record["question"]), int(record["sample"]))


class ResultFile:
    """Records already in ``path`` (by key) plus an appender for new ones.

    Constructing it only reads (and refuses a file made with other settings); ``start`` writes.
    """

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = dict(settings)
        self.records: dict[Key, dict[str, Any]] = {}
        self._whole_bytes: int | None = None  # where to cut a truncated last line, if any
        self._check_settings()
        if path.exists():
            self._load()

    def _check_settings(self) -> None:
        meta = meta_path(self.path)
        wanted = self.settings
        if meta.exists():
            try:
                previous = json.loads(meta.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                raise SystemExit(f"--output {self.path}: {meta} is not valid JSON; use a new --output") from None
            changed = sorted(k for k in wanted.keys() | previous.keys() if wanted.get(k) != previous.get(k))
            if changed:
                k = changed[0]
                raise SystemExit(
                    f"--output {self.path}: was written with {k}={previous.get(k)!r}, this run has {k}={wanted.get(k)!r}; "
                    "use a new --output (or the same settings to resume)"
                )
        elif self.path.exists() and self.path.stat().st_size > 0:
            raise SystemExit(f"--output {self.path}: exists without {meta.name}, so its settings are unknown; use a new --output")

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
                raise SystemExit(f"--output {self.path}:{lineno}: not a result record; use a new --output") from None
        self._whole_bytes = len(body) + len(newline) if tail else None

    def start(self) -> None:
        """Prepare for appending once all inputs are known to be good: create the directory and the meta
        file (atomically), and cut off a line a crash left unfinished. Nothing is written before this."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._whole_bytes is not None:
            with self.path.open("r+b") as f:
                f.truncate(self._whole_bytes)
            self._whole_bytes = None
        meta = meta_path(self.path)
        if not meta.exists():
            atomic_write_text(meta, json.dumps(self.settings, indent=1) + "\n")

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append whole lines and push them to disk, so a kill loses at most the batch in flight."""
        with self.path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for record in records:
            self.records[record_key(record)] = record
