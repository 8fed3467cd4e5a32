"""The context-table search (``benchmarks/context_table.py``, issue 79): the longest length that runs, found with
few trials from either side of the start (doubling, or a smaller growth from the memory estimate's start), the
estimate's start itself, one real search in ``--tiny`` mode writing its JSON and merged into a table of other
shapes, and the flags refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import grpo_step
from benchmarks.context_table import estimated_start, longest_that_fits, main, parse
from qerl.train.memory import GB, ModelShape, RunShape, estimate
from qerl.train.recompute import HEADROOM


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


def test_a_smaller_growth_from_a_close_start_takes_fewer_trials() -> None:
    """From a start just below the limit, growing by 1.25 brackets it at once (4 trials where doubling takes 6); a
    growth that rounds to the same multiple still moves up by one step."""
    assert longest_that_fits(lambda n: n <= 20_000, 16384, 1024, 65536, 1.25) == (
        19456,
        20480,
        [16384, 20480, 18432, 19456],
    )
    assert len(longest_that_fits(lambda n: n <= 20_000, 16384, 1024, 65536)[2]) == 6
    assert longest_that_fits(lambda n: n <= 3000, 1024, 1024, 65536, 1.01)[2] == [1024, 2048, 3072]


@pytest.mark.parametrize("shape", ["7b", "32b"])
def test_the_estimated_start_is_the_longest_the_estimate_fits(shape: str) -> None:
    """On an 80 GB card with all of it free: the start fits by the estimate (with the engine's cache freed for the
    pass), one step more does not, or the start is the ceiling (7B: 65,536 new tokens fit by the estimate)."""
    args = parse(["--tiny", "--start", "1", "--n", "8", "--prompt", "1024", "--micro-batch", "1"])
    total = int(80 * GB)
    start = estimated_start(shape, args, total, total)
    config = {**grpo_step.SHAPES[shape], "vocab_size": grpo_step.vocab_size(shape)}
    model = ModelShape.from_config(config, nvfp4=True)

    def peak(length: int) -> float:
        run = RunShape(8, 1, 1024, length, 16, masked=False, fused=True, release_engine=True)
        return estimate(model, run).peak

    room = total - HEADROOM * total
    assert start % 1024 == 0 and peak(start) <= room
    assert start == 65536 if shape == "7b" else room < peak(start + 1024)


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


def test_a_search_is_merged_into_a_table_of_other_shapes(tmp_path: Path) -> None:
    """``--merge-into``: the earlier table's other shapes kept, this one's added, both commands named; a table of
    another setup is refused in one line and nothing is written."""
    flags = ["--tiny", "--n", "2", "--prompt", "8", "--start", "8", "--step", "8", "--ceiling", "16"]
    earlier = main([*flags, "--out", str(tmp_path / "earlier.json")])
    earlier["results"][0]["shape"] = "7b"  # stands for a shape measured in an earlier command
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    doc = main([*flags, "--out", str(tmp_path / "table.json"), "--merge-into", str(tmp_path / "earlier.json")])
    assert [r["shape"] for r in doc["results"]] == ["7b", "tiny"] and doc["command"].count(" ; ") == 1
    other = [*flags[:4], "16", *flags[5:]]  # another prompt length
    with pytest.raises(SystemExit, match=r"^--merge-into .*earlier\.json: expected a context table of the same setup"):
        main([*other, "--out", str(tmp_path / "other.json"), "--merge-into", str(tmp_path / "earlier.json")])
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--start", "long"], "--start: expected a positive integer or 'estimate', got 'long'"),
        (["--start", "8", "--grow", "1"], "--grow: expected a factor above 1, got 1.0"),
        ([], "--start estimate: the estimate is of the real shapes; give --tiny a length"),
    ],
)
def test_bad_flags_are_refused_in_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--tiny", *flags])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
