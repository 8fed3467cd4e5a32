"""qerl.cli: user errors become one ``error: ...`` line and exit 2; bugs keep their traceback."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import one_error

from qerl.cli import ArgumentParser, UsageError, run


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--learning_rate", type=float, default=1.0)
    return parser


def test_usage_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    def main(argv: list[str] | None) -> None:
        raise UsageError("--steps: expected a positive integer, got 0\n(details)")

    assert run(main, []) == 2
    assert capsys.readouterr().err == "error: --steps: expected a positive integer, got 0\n"


def test_plain_string_system_exit_and_user_errors(capsys: pytest.CaptureFixture[str]) -> None:
    def old_style(argv: list[str] | None) -> None:
        raise SystemExit("--data x.jsonl: no such file")

    def missing(argv: list[str] | None) -> None:
        raise FileNotFoundError("model path 'a/b' does not exist")

    assert run(old_style) == 2
    assert capsys.readouterr().err == "error: --data x.jsonl: no such file\n"
    assert run(missing, user_errors=(FileNotFoundError,)) == 2
    assert capsys.readouterr().err == "error: model path 'a/b' does not exist\n"
    with pytest.raises(FileNotFoundError):  # not declared a user error: a bug, with its traceback
        run(missing)


def test_success_help_and_interrupt(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(lambda argv: None) == 0
    with pytest.raises(SystemExit) as info:
        run(lambda argv: _parser().parse_args(["--help"]))
    assert info.value.code == 0

    def interrupted(argv: list[str] | None) -> None:
        raise KeyboardInterrupt

    assert run(interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_parser_no_prefix_matching_and_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parser().parse_args(["--learning_rate", "2"]).learning_rate == 2.0
    with pytest.raises(UsageError, match=r"unrecognized arguments: --learning_rat 2 \(see tool --help\)"):
        _parser().parse_args(["--learning_rat", "2"])
    assert run(lambda argv: _parser().parse_args(argv), ["--learning_rate", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --learning_rate: invalid float value: 'fast'") and err.count("\n") == 1


def test_usage_errors_only_inside_the_block() -> None:
    from qerl.cli import usage_errors

    with pytest.raises(UsageError, match=r"^--rewards: unknown \['x'\]$"), usage_errors(ValueError):
        raise ValueError("--rewards: unknown ['x']\nmore")
    with pytest.raises(KeyError), usage_errors(ValueError):
        raise KeyError("a bug, not bad input")


def test_environment_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 53, item 4: a full or read-only disk is the machine's state, not a bug: ``error: cannot write
    FILE: reason`` and status 2, whether an OSError or a library's wrapper of one; a missing file stays a bug."""
    import errno
    import os

    def raises(error: BaseException):
        def main(argv: list[str] | None) -> None:
            raise error

        return main

    wrapped = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    for error, line in (
        (
            OSError(errno.EROFS, os.strerror(errno.EROFS), "/out/model.safetensors"),
            "error: cannot write /out/model.safetensors: read-only file system\n",
        ),
        (wrapped, "error: cannot write: no space left on device\n"),
        (
            PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/out"),
            "error: cannot access /out: permission denied\n",
        ),
    ):
        assert run(raises(error)) == 2
        assert capsys.readouterr().err == line
    with pytest.raises(FileNotFoundError):
        run(raises(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x")))


@contextmanager
def sigint(handler: Any) -> Iterator[None]:
    """SIGINT handled by ``handler`` within the block, the suite's own handler back after it."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def foreground() -> Iterator[None]:
    """SIGINT handled as in a command started from a terminal (a suite run in the background ignores it)."""
    with sigint(signal.default_int_handler):
        yield


def test_a_ctrl_c_dropped_in_a_finalizer_is_delivered_again(
    foreground: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C landing in a finalizer (tqdm's ``__del__``) was printed as ignored and dropped: the command ran
    on to exit status 0. It is raised again once the finalizer is done."""

    class ProgressBar:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the finalizer runs: its KeyboardInterrupt is dropped

    steps: list[int] = []

    def main(argv: list[str] | None) -> None:
        ProgressBar()  # dropped at once
        for step in range(200):
            steps.append(step)
            time.sleep(0.001)

    assert run(main) == 130 and len(steps) < 100  # stopped within about 10 ms, not after the 200 steps
    assert capsys.readouterr().err.endswith("interrupted\n")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_swallowed_by_a_library_still_reads_as_interrupted(
    foreground: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library's bare ``except:`` (datasets hashing a transform) swallows the KeyboardInterrupt without a
    trace; the command ends its work, but it reports what the user did: status 130, not 0."""

    def main(argv: list[str] | None) -> None:
        try:
            signal.raise_signal(signal.SIGINT)
        except:  # noqa: E722 (the library's habit, on purpose)
            pass

    assert run(main) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert run(lambda argv: None) == 0  # the next run starts clean


def test_an_ignored_sigint_stays_ignored() -> None:
    """A command started in the background of a script (``cmd &``) ignores SIGINT, as the shell set it up."""
    with sigint(signal.SIG_IGN):
        assert run(lambda argv: signal.raise_signal(signal.SIGINT)) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# --- numbers of the commands' flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["inf", "nan", "-1", "0", "1e9"])
def test_shard_size_out_of_range_is_one_line(size: str, tmp_path: Path, capsys) -> None:
    """--max-shard-gb inf: a traceback; -1: one shard per tensor; 0: silently 4 GB. Both commands refuse them."""
    from qerl import export
    from qerl.quantize import run as quantize_cli

    for main, argv in (
        (export.main, ["--model", "m", "--lora", "a", "--output", str(tmp_path / "o")]),
        (quantize_cli.main, ["--model", "m", "--output", str(tmp_path / "q")]),
    ):
        line = one_error(main([*argv, "--max-shard-gb", size]), capsys.readouterr().err)
        assert "--max-shard-gb" in line and "expected a size in GB" in line, line
    assert not any(tmp_path.iterdir())
