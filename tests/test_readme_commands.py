"""README's command blocks run as written (issue 78): a newcomer copies them top to bottom.

Every fenced ``bash`` block of README.md is read line by line (``\\``-continued lines joined, ``&&`` chains split)
and each command is checked against the tree, without running its work:

* the program exists: ``python -m MODULE`` imports (ours: its file is in the tree), ``python PATH`` and
  ``bash PATH`` name a file of the tree, and ``.venv/bin/TOOL`` lies in the venv ``setup_env.sh`` makes;
* its flags are accepted: the command's own parser runs on them (stopped right after parsing); the scripts of
  ``training/`` pass theirs on to ``python -m qerl.train``, except ``--num-gpus``;
* every path it reads (a model, an adapter, a data file, a recipe, a run) is in the tree, written by an earlier
  command of the README, the embedded default model, the user's own (an upper-case name such as ``DIR``), or a hub
  id, and a command that reads the Hugging Face hub says so in its line's comment;
* no placeholder stands where a value goes (``...``, ``<run>``, ``[--flag]``, ``a|b``);
* what it writes inside the clone is ignored by git, and it does not write into an output an earlier command wrote
  when that command refuses to (quantize and export stop with "already exists" without ``--overwrite``);
* one block spells python one way (``python`` after ``source .venv/bin/activate``, or ``.venv/bin/python``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ("python", "python3", ".venv/bin/python")
OURS = ("qerl", "eval", "benchmarks")
#: Parsed fields that name something a command reads, and those that name what it writes.
READ_FIELDS = (
    *("model", "model_name", "lora", "data", "dataset_path", "gguf_file", "calibration_data", "chat_template", "runs"),
)
WRITE_FIELDS = ("output", "output_dir", "out")
#: What a script with no flags of its own writes: the defaults of these variables in it.
SCRIPT_OUTPUTS = {"setup_env.sh": ("QERL_VENV",), "training/quickstart.sh": ("QMODEL", "QERL_OUT")}
PLACEHOLDER = re.compile(r"\.\.\.|[<>\[\]|]")
YOURS = re.compile(r"[A-Z][A-Z0-9_]*")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass
class Command:
    line: int  # README line where it starts
    block: int
    argv: list[str]
    comment: str


@dataclass
class Check:
    """What the README's commands wrote so far, and what is wrong with them."""

    written: dict[str, int] = field(default_factory=dict)  # path -> README line that wrote it
    problems: list[str] = field(default_factory=list)

    def fail(self, command: Command, text: str) -> None:
        self.problems.append(f"README line {command.line}: `{' '.join(command.argv)}`: {text}")


def commands(text: str) -> list[Command]:
    """The commands of the fenced ``bash`` blocks, in order."""
    found, block, start, pending, in_block = [], 0, 0, "", False
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```"):
            in_block = raw.strip() == "```bash"
            block += in_block
            continue
        if not in_block or (not pending and not raw.strip()):
            continue
        start = start if pending else number
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        code, comment = _split_comment(pending)
        pending = ""
        words: list[str] = []
        for token in [*shlex.split(code), "&&"]:
            if token != "&&":
                words.append(token)
            elif words:
                found.append(Command(start, block, words, comment))
                words = []
    return found


def _split_comment(line: str) -> tuple[str, str]:
    """(the command, its trailing ``# comment``): the first ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


class _Parsed(BaseException):
    """Raised by the parser stand-in once the flags parsed: the command stops before any work."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def _stop_after(real: Callable[..., Any]) -> Callable[..., Any]:
    def parse(*args: Any, **kwargs: Any) -> Any:
        raise _Parsed(real(*args, **kwargs))

    return parse


def parse(target: str, args: list[str], trainer: bool) -> tuple[Any, str]:
    """(what the command's parser made of ``args``, or None; the error it printed): ``target`` is a module (run as
    ``python -m``) or a script path; ``trainer``: its flags go to ``qerl.train``'s parser."""
    import qerl.train.args

    if trainer:
        patch = mock.patch.object(qerl.train.args, "parse_args", _stop_after(qerl.train.args.parse_args))
    else:
        patch = mock.patch.object(
            argparse.ArgumentParser, "parse_args", _stop_after(argparse.ArgumentParser.parse_args)
        )
    err = io.StringIO()
    with patch, mock.patch.object(sys, "argv", [target, *args]), contextlib.redirect_stderr(err):
        try:
            if target.endswith(".py"):
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except _Parsed as done:
            return done.value, ""
        except SystemExit as e:
            return None, err.getvalue().strip() or str(e.code)
    return None, "ran without parsing any flags"


def _default_output(target: str, ns: Any) -> str | None:
    """Where a command writes when no flag says."""
    if target == "llm-compressor/quantize_nvfp4.py":
        from qerl.quantize.pipeline import default_output

        return str(default_output(ns.gguf_file or ns.model))
    if target.startswith("eval."):
        from eval.runner import default_output

        return str(default_output(SimpleNamespace(name=getattr(ns, "benchmark", target.split(".")[1])), ns))
    return None


def _needs_hub(target: str, values: dict[str, Any]) -> bool:
    """Whether the command reads data from the hub although no flag value is a hub id (a data set's default)."""
    if target.startswith("eval.") and values.get("data") == "openai/gsm8k":
        return True
    if target == "qerl.train" and not values.get("dataset_path"):
        from qerl.train import data

        return data.spec(values["dataset"]).hub_id is not None
    return False


class Checker:
    """Walks the README's commands in order (see the module docstring)."""

    def __init__(self) -> None:
        self.state = Check()
        self.pythons: dict[int, set[str]] = {}

    def run(self, found: list[Command]) -> list[str]:
        for command in found:
            self.check(command)
        for block, spellings in self.pythons.items():
            if len(spellings) > 1:
                self.state.problems.append(f"README block {block} spells python {' and '.join(sorted(spellings))}")
        return self.state.problems

    def check(self, c: Command) -> None:
        bad = [t for t in c.argv if PLACEHOLDER.search(t)]
        if bad:
            self.state.fail(c, f"placeholder {bad[0]!r} where a value goes")
            return
        program, rest = c.argv[0], c.argv[1:]
        if program in PYTHONS:
            self.pythons.setdefault(c.block, set()).add(program)
            self.python(c, rest)
        elif program == "bash" and rest:
            self.script(c, rest[0], rest[1:])
        elif program == "source" and rest:
            self.reads(c, rest[0])
        elif program.startswith(".venv/bin/"):
            self.reads(c, program)
        else:
            self.state.fail(c, f"unknown program {program!r}")

    def python(self, c: Command, rest: list[str]) -> None:
        if program := (rest[1] if rest[:1] == ["-m"] and len(rest) > 1 else None):
            ours = program.split(".")[0] in OURS
            if (importlib.util.find_spec(program) if not ours else _module_file(program)) is None:
                self.state.fail(c, f"no module {program}")
                return
            if ours:
                self.command(c, program, rest[2:], trainer=program == "qerl.train")
        elif rest and (ROOT / rest[0]).is_file():
            self.command(c, rest[0], rest[1:], trainer=False)
        else:
            self.state.fail(c, f"no script {rest[:1]}")

    def script(self, c: Command, path: str, args: list[str]) -> None:
        text = (ROOT / path).read_text() if (ROOT / path).is_file() else None
        if text is None:
            self.state.fail(c, f"no script {path}")
        elif path in SCRIPT_OUTPUTS:
            if args:
                self.state.fail(c, f"{path} takes no flags")
            for variable in SCRIPT_OUTPUTS[path]:
                default = re.search(rf"\$\{{{variable}:-([^}}]+)\}}", text)
                self.writes(c, default.group(1), overwrite=True)
        elif "qerl_single_gpu" in text:  # training/dapo_*.sh: --num-gpus N, the rest goes to qerl.train
            args = [a for i, a in enumerate(args) if "--num-gpus" not in (a, args[i - 1] if i else "")]
            ns, error = parse("qerl.train", ["--model-name", "SCRIPT", *args], trainer=True)
            if error:
                self.state.fail(c, error)
            size = re.search(r"qerl_single_gpu (\S+) nvfp4", text)
            if size:  # mirrors training/_single_gpu.sh: qmodel/<the hub id's name>-NVFP4A16
                self.reads(c, f"qmodel/Qwen2.5-{size.group(1).upper()}-Instruct-NVFP4A16")
            self.hub(c, needed="--dataset" not in args)
        else:
            self.state.fail(c, f"README does not know what {path} reads and writes")

    def command(self, c: Command, target: str, args: list[str], trainer: bool) -> None:
        parsed, error = parse(target, args, trainer)
        if parsed is None:
            self.state.fail(c, f"its parser refuses the flags: {error}")
            return
        values = {**vars(parsed[0]), **vars(parsed[1])} if trainer else vars(parsed)
        if trainer and "--config" in args:
            self.reads(c, args[args.index("--config") + 1])
        hub = _needs_hub(target, values)
        for name in READ_FIELDS:
            for value in _as_list(values.get(name)):
                hub |= self.reads(c, str(value))
        self.hub(c, needed=hub)
        for name in WRITE_FIELDS:
            if values.get(name) is not None:
                self.writes(c, str(values[name]), overwrite=values.get("overwrite", True))
        default = None if any(values.get(n) for n in WRITE_FIELDS) else _default_output(target, parsed)
        if default is not None:
            self.writes(c, default, overwrite=values.get("overwrite", True))

    def hub(self, c: Command, needed: bool) -> None:
        if needed and "hub" not in c.comment:
            self.state.fail(c, "reads the Hugging Face hub and its comment does not say so")

    def reads(self, c: Command, value: str) -> bool:
        """Check one path read; True when it is a hub id."""
        from qerl.hub import EMBEDDED_NAME

        path = value.removeprefix("./")
        if value == EMBEDDED_NAME or YOURS.fullmatch(value) or self.written_before(path) or path in _tracked():
            return False
        top = path.split("/")[0]
        if HUB_ID.fullmatch(path) and top not in {w.split("/")[0] for w in self.state.written} | _tracked():
            return True
        self.state.fail(c, f"reads {value}, which no earlier command writes (nor the tree holds)")
        return False

    def written_before(self, path: str) -> bool:
        return any(path == w or path.startswith(w.rstrip("/") + "/") for w in self.state.written)

    def writes(self, c: Command, value: str, overwrite: bool) -> None:
        path = value.removeprefix("./")
        if path in self.state.written and not overwrite:
            self.state.fail(
                c,
                f"{path} exists by then (README line {self.state.written[path]} wrote it): it stops, 'already exists'",
            )
        self.state.written.setdefault(path, c.line)
        if not Path(path).is_absolute() and not path.startswith("..") and not _ignored(path):
            self.state.fail(c, f"writes {path} into the clone, and .gitignore does not cover it")


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()), None)


@functools.cache
def _tracked() -> frozenset[str]:
    """The tree's files and folders (git's list in a checkout: not what earlier runs left in it)."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        listed = None
    if listed is None or listed.returncode:
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    else:
        files = listed.stdout.splitlines()
    return frozenset(str(p) for f in files for p in [Path(f), *Path(f).parents] if str(p) != ".")


def _ignored(path: str) -> bool:
    """Whether git ignores ``path`` as a file or as a folder (``.venv/`` covers only a folder); True outside a git
    checkout, where there is no status to keep clean."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "check-ignore", path, f"{path}/_"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return done.returncode != 1  # 0: one of them is ignored; 128: not a git checkout


def readme_problems(text: str) -> list[str]:
    return Checker().run(commands(text))


def test_every_readme_command_runs_as_written() -> None:
    problems = readme_problems((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("block", "wanted"),
    [
        ("python -m eval.math --benchmark math500 --data x.jsonl --model ...", "placeholder"),
        ("python -m qerl.plot runs/<run>", "placeholder"),
        ("python -m qerl.nothing --x 1", "no module"),
        ("python -m qerl.export --model DIR --lora DIR --output runs/x --frmat nvfp4", "refuses the flags"),
        ("python -m eval.gsm8k --model smollm2-135m --data ../shared/data/x.jsonl --output runs/e.jsonl", "reads"),
        ("python -m eval.gsm8k --model smollm2-135m --limit 3 --output runs/e.jsonl", "hub"),
        ("python -m qerl.train --model-name qmodel/qwen7b --dataset arithmetic --output-dir runs/t", "reads"),
        ("python -m qerl.export --model DIR --lora DIR --output export/x", ".gitignore"),
        ("bash training/quickstart.sh\npython llm-compressor/quantize_nvfp4.py --model smollm2-135m", "already exists"),
        ("python -m qerl.plot runs/quickstart\n.venv/bin/python -m qerl.plot runs/quickstart", "spells python"),
    ],
)
def test_the_check_finds_each_kind_of_mistake(block: str, wanted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "_ignored", lambda path: not path.startswith("export"))
    problems = readme_problems(f"```bash\nbash training/quickstart.sh\n{block}\n```\n")
    assert any(wanted in p for p in problems), problems
