"""The context-table search (``benchmarks/context_table.py``, issue 79): the longest length that runs, found with
few trials from either side of the start, and one real search in ``--tiny`` mode writing its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.context_table import longest_that_fits, main


@pytest.mark.parametrize(
    ("limit", "start", "want_tried"),
    [
        (20_000, 8192, [8192, 16384, 32768, 24576, 20480, 18432, 19456]),  # up, then bisect
        (3_000, 8192, [8192, 4096, 2048, 3072]),  # down, then bisect
        (70_000, 8192, [8192, 16384, 32768, 65536]),  # runs up to the ceiling: nothing failed
        (500, 8192, [8192, 4096, 2048, 1024]),  # nothing runs
    ],
)
def test_the_search_finds_the_longest_length_that_runs(limit: int, start: int, want_tried: list[int]) -> None:
    longest, failed, tried = longest_that_fits(lambda n: n <= limit, start, 1024, 65536)
    fitting = [n for n in range(1024, 65537, 1024) if n <= limit]
    assert longest == (max(fitting) if fitting else None)
    assert failed == next((n for n in range(1024, 65537, 1024) if n > limit), None)
    assert tried == want_tried


def test_a_tiny_search_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the tiny model every length runs on a CPU: the search climbs to the ceiling, one real step per trial."""
    out = tmp_path / "context.json"
    doc = main(
        ["--tiny", "--n", "2", "--prompt", "8", "--start", "8", "--step", "8", "--ceiling", "32", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == doc
    (result,) = doc["results"]
    assert result["shape"] == "tiny" and result["longest_new_tokens"] == 32 and result["shortest_that_failed"] is None
    assert [t["new_tokens"] for t in result["tried"]] == [8, 16, 32]
    assert all(
        r["status"] == "ok" and r["new_tokens"] == t["new_tokens"]
        for r, t in zip(result["rows"], result["tried"], strict=True)
    )
    assert result["step_s_at_longest"] > 0 and doc["command"].endswith("--out " + str(out))
