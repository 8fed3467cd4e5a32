"""One way for every qerl command-line tool to report a user's mistake: ``error: <one line>`` on
stderr and exit status 2, never a traceback.

    from qerl.cli import ArgumentParser, UsageError, run

    def main(argv: list[str] | None = None) -> ...:
        args = ArgumentParser(prog="python -m tool").parse_args(argv)   # its errors: one line too
        if args.steps < 1:
            raise UsageError(f"--steps: expected a positive integer, got {args.steps}")

    if __name__ == "__main__":
        sys.exit(run(main))

``UsageError`` is a ``SystemExit``, so a ``main`` called as a library function (or in a test) still
stops with the message, and code written with the older ``raise SystemExit("message")`` is reported
the same way by :func:`run`. Exceptions that mean bad input but come from libraries (a
``FileNotFoundError`` for a missing path, say) are passed to :func:`run` as ``user_errors``. What the
machine refuses (a full disk, a read-only file system, no permission: :data:`ENVIRONMENT_ERRNOS`) is
one line too, whichever library raised it; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import _thread
import argparse
import errno
import itertools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

#: Exit status of a run stopped by a user error (argparse's own convention).
USAGE_EXIT = 2
#: Exit status of a run stopped by Ctrl-C (128 + SIGINT, what shells report).
INTERRUPTED_EXIT = 130
#: How long after a Ctrl-C that died in a finalizer it is raised again (the finalizer has long returned by then).
REDELIVERY_S = 0.01
#: I/O failures that are the machine's state, not a bug: reported as ``cannot write|access FILE: reason``.
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EROFS,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
        errno.EIO,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENAMETOOLONG,
    }
)


class UsageError(SystemExit):
    """Bad input (a flag, a file, a setting), reported by :func:`run` as one line without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def one_line(message: object) -> str:
    """The first non-blank line of ``message`` (a KeyError's key unquoted), stripped of an ``error:`` prefix."""
    if isinstance(message, KeyError) and message.args:
        message = message.args[0]
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    text = lines[0] if lines else type(message).__name__
    return text.removeprefix("error:").strip()


@contextmanager
def usage_errors(*types: type[BaseException]) -> Iterator[None]:
    """Within the block, exceptions of ``types`` are bad input reported by a library (a missing file,
    a value a config class refused) and become :class:`UsageError`. Meant for a command's setup phase
    only, so that the same exception types raised later, by a bug, keep their traceback."""
    try:
        yield
    except types as e:  # a full disk or a read-only output met during setup reads as it does anywhere else
        raise UsageError(environment_error(e) or one_line(e)) from e


class StrictParsing:
    """Mixin for ``argparse.ArgumentParser`` subclasses (trl's ``TrlParser`` included): no prefix
    matching of long flags (``--learning_rat`` must not silently mean ``--learning_rate``) and parse
    errors raised as :class:`UsageError` instead of argparse's usage dump."""

    prog: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


class ArgumentParser(StrictParsing, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`StrictParsing`."""


#: The largest output shard ``--max-shard-gb`` takes: a shard is held in memory while it is written.
MAX_SHARD_GB = 1024.0


def shard_gb(text: str) -> float:
    """argparse type of ``--max-shard-gb``: a size in GB in (0, :data:`MAX_SHARD_GB`]. ``inf`` crashed the size
    arithmetic, ``0`` meant the default and a negative size one shard per tensor, all without a word."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SHARD_GB:  # false for nan
        raise argparse.ArgumentTypeError(f"expected a size in GB in (0, {MAX_SHARD_GB:g}], got {text!r}")
    return value


@contextmanager
def ctrl_c_kept() -> Iterator[list[bool]]:
    """Within the block, a Ctrl-C is not lost; yields a flag list, ``[True]`` once one came.

    Python raises ``KeyboardInterrupt`` in whatever the main thread runs when the signal arrives. In a finalizer
    (tqdm's ``__del__`` at the end of a progress bar) it is printed as "Exception ignored" and dropped, and a
    library's bare ``except:`` drops it silently: either way the command ran on to its end and exit status 0 (a
    sweep of ``test_faults``' SIGINT test: 2 of 97 signal times of an eval, 3 of 40 of a training). So the handler
    records each Ctrl-C, one that dies in a finalizer is delivered again at once, and :func:`run` reports any
    recorded one. A SIGINT handler already set by someone else (ignored, say) is left alone, as outside the main
    thread, where none can be set."""
    seen = [False]
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield seen
        return
    hook = sys.unraisablehook
    inside = [True]

    def on_ctrl_c(signum: int, frame: object) -> None:
        seen[0] = True
        raise KeyboardInterrupt

    def again() -> None:
        time.sleep(REDELIVERY_S)
        if inside[0]:
            _thread.interrupt_main()

    def on_unraisable(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # It died in a finalizer. Raised from here it would die in this hook too: from a thread, a moment later.
            threading.Thread(target=again, name="ctrl-c-again", daemon=True).start()
        else:
            hook(unraisable)

    signal.signal(signal.SIGINT, on_ctrl_c)
    sys.unraisablehook = on_unraisable
    try:
        yield seen
    finally:
        inside[0] = False
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = hook


def ctrl_c_ends_the_imports(package: str) -> None:
    """While ``python -m <package>.<command>`` imports its command (torch, transformers, trl: seconds), make a Ctrl-C
    end it as :func:`run` does once the command runs: ``interrupted`` and status 130, not a 40-60 line traceback from
    inside an import. Called from the ``qerl`` and ``eval`` packages' ``__init__``, which ``-m`` imports first
    (``sys.argv[0]`` is ``"-m"`` only then, as the docs of ``-m`` say), and from ``llm-compressor/quantize_nvfp4.py``
    with ``package=""`` (a script: always). Only an uncaught ``KeyboardInterrupt`` is handled, with ``os._exit``: no
    command has written anything while it imports; a library that imports ``qerl`` is left alone."""
    if package:
        module = next((b for a, b in itertools.pairwise(sys.orig_argv) if a == "-m"), "")
        if sys.argv[:1] != ["-m"] or module.partition(".")[0] != package:
            return
    previous = sys.excepthook

    def one_line(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            return
        sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT)

    sys.excepthook = one_line


def run(
    main: Callable[[Sequence[str] | None], Any],
    argv: Sequence[str] | None = None,
    *,
    user_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Call ``main(argv)`` and turn its outcome into an exit status for ``sys.exit``.

    0 when it returns; 2 with ``error: <one line>`` on stderr for a :class:`UsageError`, a
    ``SystemExit`` carrying a message, or one of ``user_errors``; 130 with ``interrupted`` on Ctrl-C,
    also when a library swallowed the ``KeyboardInterrupt`` and ``main`` went on (:func:`ctrl_c_kept`).
    A ``SystemExit`` with a numeric code (``--help``) passes through unchanged.
    """
    with ctrl_c_kept() as interrupted:
        try:
            main(argv)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                raise
            return _fail(e.code)
        except KeyboardInterrupt:
            interrupted[0] = True
        except user_errors as e:
            return _fail(e)
        except Exception as e:
            message = environment_error(e)
            if message is None:
                raise
            return _fail(message)
    if interrupted[0]:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


def environment_error(error: BaseException) -> str | None:
    """``cannot write FILE: reason`` when ``error`` (or what it was raised from) is an I/O failure of
    :data:`ENVIRONMENT_ERRNOS`, whether an ``OSError`` or a library's wrapper of one; else None."""
    from qerl.fsutil import os_errno

    seen: BaseException | None = error
    while seen is not None:
        code = os_errno(seen)
        if code in ENVIRONMENT_ERRNOS:
            name = getattr(seen, "filename", None)
            verb = "write" if code in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG) else "access"
            return f"cannot {verb}{f' {name}' if name else ''}: {os.strerror(code).lower()}"
        seen = seen.__cause__ or seen.__context__
    return None


def _fail(message: object) -> int:
    print(f"error: {one_line(message)}", file=sys.stderr)
    return USAGE_EXIT


__all__ = [
    "ArgumentParser",
    "shard_gb",
    "MAX_SHARD_GB",
    "StrictParsing",
    "UsageError",
    "run",
    "usage_errors",
    "one_line",
    "environment_error",
    "ENVIRONMENT_ERRNOS",
    "USAGE_EXIT",
    "INTERRUPTED_EXIT",
]
