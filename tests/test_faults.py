"""Fault injection (issue 53): every file write a command makes, failed in turn, and kills at random points.

Each command (quantize, export, eval, and train on a seeded sample of its writes, ``TRAIN_FAULTS``)
first runs undisturbed in-process, counting its file writes under the test's directory: every
``open``/``os.open`` for writing, ``mkdir`` of a new directory, ``rename``/``replace``, and
safetensors / ``torch.save`` call (files that Rust code opens itself, such as ``tokenizer.json``, are not
seen). Then, for each k, the k-th of those writes raises ``OSError`` (ENOSPC and EROFS in turn) and the
test asserts:

* exit status 2 and one ``error: cannot write FILE: reason`` line, no traceback;
* no partial file under a final name: every visible file of the output is the undisturbed run's, a
  whole-line prefix of it (the append-only results JSONL), or whole (training files that carry
  timings or paths), and a visible ``checkpoint-N`` has its completion marker;
* a re-run without the fault completes with the undisturbed run's output (byte-identical but for those
  training files).

Then forked runs are killed with SIGKILL at seeded random times (the re-run takes over the dead run's
lock and completes likewise), and interrupted with SIGINT mid-work (status 130 within a second). Each
test prints the number of fault points it covered (``pytest -s``).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import peft.peft_model
import pytest
import safetensors.torch
import torch

from qerl.cli import run
from qerl.quantize.run import command as quantize_command

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a, b in ((2, 3), (7, 5), (11, 4))
]
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


KILL_SEED = 53


class Injector:
    """Counts the file writes under ``root`` and fails the ``fail_at``-th (1-based) with ``code``."""

    def __init__(self, root: Path, fail_at: int | None = None, code: int = errno.ENOSPC) -> None:
        self.root, self.fail_at, self.code = str(root), fail_at, code
        self.count = 0

    def hit(self, path: object) -> None:
        """One write to ``path``: counted when under the root, and failed when it is the chosen one."""
        try:
            text = os.fspath(path)
        except TypeError:
            return
        text = text.decode() if isinstance(text, bytes) else text
        if not os.path.abspath(text).startswith(self.root):
            return
        self.count += 1
        if self.count == self.fail_at:
            raise OSError(self.code, os.strerror(self.code), text)

    def counted(self, real: Callable[..., object], target: Callable[..., object | None]) -> Callable[..., object]:
        """``real`` with :meth:`hit` on the path ``target`` finds in its arguments (None: not a write)."""

        def fake(*args: object, **kwargs: object) -> object:
            path = target(*args, **kwargs)
            if path is not None:
                self.hit(path)
            return real(*args, **kwargs)

        return fake

    @contextmanager
    def active(self) -> Iterator[Injector]:
        """Wrap the write entry points for the block."""

        def opened(file, mode="r", *args, **kwargs):
            return file if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") else None

        writes = [  # (module, name, which argument is the path written)
            (builtins, "open", opened),
            (io, "open", opened),
            (os, "open", lambda path, flags, *a, **k: path if flags & _WRITE_FLAGS else None),
            # an existing name fails with EEXIST first, even on a full disk
            (os, "mkdir", lambda path, *a, **k: None if os.path.lexists(path) else path),
            (os, "replace", lambda src, dst, *a, **k: dst),
            (os, "rename", lambda src, dst, *a, **k: dst),
            (safetensors.torch, "save_file", lambda tensors, filename, *a, **k: filename),
            (peft.peft_model, "safe_save_file", lambda tensors, filename, *a, **k: filename),
            (torch, "save", lambda obj, f, *a, **k: f),
        ]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in writes]
        try:
            for owner, name, target in writes:
                setattr(owner, name, self.counted(getattr(owner, name), target))
            yield self
        finally:
            for owner, name, real in saved:
                setattr(owner, name, real)


def visible_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` whose path has no hidden (dot) part: what a reader takes for output."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


def _whole(name: str, data: bytes) -> bool:
    """Whether ``data`` is a complete file of its kind (JSON parses; JSONL and CSV end with a whole line)."""
    try:
        if name.endswith(".json"):
            json.loads(data)
        elif name.endswith(".jsonl"):
            [json.loads(line) for line in data.splitlines()]
        return not name.endswith((".jsonl", ".csv")) or not data or data.endswith(b"\n")
    except ValueError:
        return False


def assert_no_partial_file(
    got: dict[str, bytes], want: dict[str, bytes], where: str, volatile: frozenset[str] = frozenset()
) -> None:
    """Each visible file is the reference's, or a whole-line prefix of it (an append-only JSONL), or whole
    (a file in ``volatile``, whose content carries timings); a visible checkpoint has its completion marker."""
    for name, data in got.items():
        assert name in want, f"{where}: {name} is not an output of the undisturbed run"
        checkpoint = name.split("/")[0]
        assert not checkpoint.startswith("checkpoint-") or f"{checkpoint}/qerl_checkpoint.json" in got, (
            f"{where}: {checkpoint} is visible without its completion marker"
        )
        if data == want[name]:
            continue
        prefix = name.endswith(".jsonl") and want[name].startswith(data)
        assert (prefix or Path(name).name in volatile) and _whole(name, data), f"{where}: {name} holds part of a file"


def same_output(
    got: dict[str, bytes], want: dict[str, bytes], volatile: frozenset[str], optional: frozenset[str] = frozenset()
) -> bool:
    """The same files, byte for byte except the content of ``volatile`` ones (timings); ``optional`` ones
    may be missing from ``got``."""
    needed = {k for k in want if k not in optional}
    return needed <= got.keys() <= want.keys() and all(got[k] == want[k] for k in got if Path(k).name not in volatile)


class Command:
    """One CLI run in-process: ``argv`` into the directory ``output``, its visible files compared by bytes."""

    def __init__(
        self,
        name: str,
        main: Callable[[Sequence[str] | None], object],
        argv: Callable[[Path], list[str]],
        volatile: frozenset[str] = frozenset(),
        optional: frozenset[str] = frozenset(),
    ) -> None:
        self.name, self.main, self.argv, self.volatile, self.optional = name, main, argv, volatile, optional

    def run(self, output: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
        with redirect_stdout(io.StringIO()):
            code = run(self.main, self.argv(output))
        return code, capsys.readouterr().err

    @staticmethod
    def files(output: Path) -> dict[str, bytes]:
        return visible_files(output)


def check_every_write(
    command: Command, work: Path, capsys: pytest.CaptureFixture[str], sample: int | None = None
) -> int:
    """Run ``command`` once undisturbed, then once per file write with that write failed (or, with
    ``sample``, for that many seeded random writes and the last); return the number of fault points covered."""
    ref_out = work / "ref" / "out"
    with Injector(work).active() as counter:
        code, err = command.run(ref_out, capsys)
    assert code == 0, err
    want = command.files(ref_out)
    assert want, f"{command.name}: the undisturbed run wrote nothing"
    points = counter.count
    chosen = range(1, points + 1)
    if sample is not None and sample < points:
        chosen = sorted(random.Random(KILL_SEED).sample(range(1, points), sample) + [points])
    for k in chosen:
        code_name = (errno.ENOSPC, errno.EROFS)[k % 2]
        out = work / f"k{k}" / "out"
        with Injector(work, fail_at=k, code=code_name).active():
            code, err = command.run(out, capsys)
        where = f"{command.name}, write {k}/{points} failed with {errno.errorcode[code_name]}"
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and lines and lines[-1].startswith("error: cannot write"), f"{where}: rc {code}, {err[-2000:]}"
        assert os.strerror(code_name).lower() in lines[-1] and "Traceback" not in err, f"{where}: {err[-2000:]}"
        assert_no_partial_file(command.files(out), want, where, command.volatile)
        code, err = command.run(out, capsys)
        assert code == 0, f"{where}; the re-run: {err[-2000:]}"
        assert same_output(command.files(out), want, command.volatile, command.optional), (
            f"{where}; the re-run's output differs"
        )
        shutil.rmtree(work / f"k{k}")
    print(f"{command.name}: {len(chosen)} of {points} write fault points covered")
    return len(chosen)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    """A tiny chat Llama, its NVFP4 checkpoint, an adapter on it and a 3-question data file."""
    from peft import get_peft_model
    from tiny_models import make_tiny_chat_model

    from qerl.fingerprint import model_sha256, write_base_record
    from qerl.load.loader import load_model
    from qerl.load.lora import lora_config
    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("fault-models")
    dense = make_tiny_chat_model(root / "tiny", smollm2_dir)
    nvfp4 = quantize_checkpoint(dense, root / "tiny-nvfp4")
    torch.manual_seed(0)
    peft_model = get_peft_model(
        load_model(nvfp4, device="cpu", dtype=torch.float32), lora_config(r=2, train_norms=True)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(root / "adapter")
    write_base_record(root / "adapter", str(nvfp4), model_sha256(nvfp4))
    data = root / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {"dense": dense, "nvfp4": nvfp4, "adapter": root / "adapter", "data": data}


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path_factory.mktemp("cache")))  # outside the injected tree


def test_quantize_every_write_fails_cleanly(models: dict[str, Path], tmp_path: Path, capsys) -> None:
    command = Command(
        "quantize",
        quantize_command,
        lambda out: ["--model", str(models["dense"]), "--output", str(out), "--skip_generation"],
    )
    assert check_every_write(command, tmp_path, capsys) >= 5


def test_export_every_write_fails_cleanly(models: dict[str, Path], tmp_path: Path, capsys) -> None:
    from qerl.export import command as export_command

    command = Command(
        "export",
        export_command,
        lambda out: ["--model", str(models["nvfp4"]), "--lora", str(models["adapter"]), "--output", str(out)],
    )
    assert check_every_write(command, tmp_path, capsys) >= 5


def test_eval_every_write_fails_cleanly(models: dict[str, Path], tmp_path: Path, capsys) -> None:
    assert check_every_write(_eval_command(models), tmp_path, capsys) >= 4


#: Training writes ~60 files (two checkpoints, adapter, metrics, plots) at ~6 s a run and its re-run, so
#: its write faults are a seeded sample of this many plus the last write; the other commands cover every write.
#: ``QERL_TRAIN_FAULTS=all`` fails every one of training's writes too (about 6 minutes on 2 cores).
TRAIN_FAULTS = None if os.environ.get("QERL_TRAIN_FAULTS") == "all" else int(os.environ.get("QERL_TRAIN_FAULTS", "10"))
#: Files of a training run whose content carries timings (runtimes, step times) or the output path
#: (run_config.json, training_args.bin): checked whole, not compared by bytes.
TRAIN_VOLATILE = frozenset(
    {
        "metrics.jsonl",
        "trainer_state.json",
        "summary.json",
        "curves.csv",
        "README.md",
        "run_config.json",
        "training_args.bin",
    }
)
#: A run that fails after its last checkpoint is finished by the re-run from that checkpoint without
#: training (qerl.train.trainer), so the end-of-training log row, and a metrics file holding only it, never comes.
TRAIN_OPTIONAL = frozenset({"metrics.jsonl"})
KILLS_PER_COMMAND = 2


def test_train_write_faults_fail_cleanly(models: dict[str, Path], tmp_path: Path, capsys) -> None:
    covered = check_every_write(_train_command(models), tmp_path, capsys, sample=TRAIN_FAULTS)
    assert covered == TRAIN_FAULTS + 1 if TRAIN_FAULTS is not None else covered > 40


def _signalled_at(command: Command, out: Path, at: float, sig: int = signal.SIGKILL) -> tuple[bool, int, float]:
    """Run ``command`` in a forked child (everything already imported, so the clock measures the work) and
    send it ``sig`` after ``at`` seconds: (whether it was still running then, its exit status, the seconds
    it took to exit after the signal)."""
    pid = os.fork()
    if pid == 0:  # the child: no output, no pytest teardown, just the command
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            # A forked child inherits torch's intra-op thread pool in a state it cannot use from the loader's worker
            # threads ("Invalid thread pool"); setting the thread count rebuilds it.
            torch.set_num_threads(torch.get_num_threads())
            # As a command started from a terminal: a suite run in the background (``cmd &``) ignores SIGINT.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os._exit(run(command.main, command.argv(out)))
        finally:
            os._exit(99)
    deadline = time.monotonic() + at
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return False, os.waitstatus_to_exitcode(status), 0.0
        time.sleep(0.005)
    os.kill(pid, sig)
    sent = time.monotonic()
    _, status = os.waitpid(pid, 0)
    return True, os.waitstatus_to_exitcode(status), time.monotonic() - sent


def _eval_command(models: dict[str, Path], max_new_tokens: int = 3) -> Command:
    from eval.gsm8k import main

    # Batches of one question, so that a fault can land between appends of the results file.
    return Command(
        "eval",
        main,
        lambda out: [
            "--model",
            str(models["nvfp4"]),
            "--lora",
            str(models["adapter"]),
            "--data",
            str(models["data"]),
            "--output",
            str(out / "r.jsonl"),
            "--engine",
            "hf",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-new-tokens",
            str(max_new_tokens),
            "--temperature",
            "0",
            "--batch-size",
            "1",
        ],
    )


def _train_command(models: dict[str, Path]) -> Command:
    from qerl.train.run import main

    return Command(
        "train",
        main,
        lambda out: [
            "--model-name",
            str(models["dense"]),
            "--dataset",
            "arithmetic",
            "--num-samples",
            "8",
            "--lora-rank",
            "2",
            "--max-steps",
            "2",
            "--save-steps",
            "1",
            "--per-device-train-batch-size",
            "2",
            "--num-generations",
            "2",
            "--max-completion-length",
            "4",
            "--output-dir",
            str(out),
            "--report-to",
            "none",
            "--disable-tqdm",
            "True",
            "--seed",
            "0",
        ],
        volatile=TRAIN_VOLATILE,
        optional=TRAIN_OPTIONAL,
    )


@pytest.mark.parametrize("which", ["eval", "train"])
def test_sigint_stops_within_a_second(models: dict[str, Path], tmp_path: Path, capsys, which: str) -> None:
    """Ctrl-C in the middle of the work (generation, a training step) ends the command within a second,
    with status 130 and nothing partial under a final name."""
    command = _eval_command(models, max_new_tokens=64) if which == "eval" else _train_command(models)
    start = time.perf_counter()
    assert command.run(tmp_path / "ref", capsys)[0] == 0
    elapsed = time.perf_counter() - start
    running, status, latency = _signalled_at(command, tmp_path / "out", 0.6 * elapsed, signal.SIGINT)
    assert running and status == 130 and latency < 1.0, (running, status, latency)
    assert_no_partial_file(
        command.files(tmp_path / "out"), command.files(tmp_path / "ref"), f"{which} after SIGINT", command.volatile
    )


def test_sigkill_at_random_points_then_rerun(models: dict[str, Path], tmp_path: Path, capsys) -> None:
    """quantize, export and eval killed with SIGKILL at seeded random times within their undisturbed
    run time: nothing partial under a final name, and the re-run (which takes over the dead run's lock)
    gives the undisturbed output."""
    from qerl.export import command as export_command

    commands = [
        Command(
            "quantize",
            quantize_command,
            lambda out: ["--model", str(models["dense"]), "--output", str(out), "--skip_generation"],
        ),
        Command(
            "export",
            export_command,
            lambda out: ["--model", str(models["nvfp4"]), "--lora", str(models["adapter"]), "--output", str(out)],
        ),
        _eval_command(models),
    ]
    rng = random.Random(KILL_SEED)
    kills = 0
    for command in commands:
        ref = tmp_path / command.name / "ref"
        start = time.perf_counter()
        assert command.run(ref, capsys)[0] == 0
        elapsed = time.perf_counter() - start
        want = command.files(ref)
        for i in range(KILLS_PER_COMMAND):
            out = tmp_path / command.name / f"killed{i}"
            at = rng.uniform(0.05, 1.0) * elapsed
            kills += _signalled_at(command, out, at)[0]
            where = f"{command.name} killed at {at:.3f}s of {elapsed:.3f}s"
            assert_no_partial_file(command.files(out), want, where, command.volatile)
            if command.files(out) != want:  # a finished output is not redone (export would need --overwrite)
                code, err = command.run(out, capsys)
                assert code == 0, f"{where}; the re-run: {err[-2000:]}"
            assert same_output(command.files(out), want, command.volatile, command.optional), (
                f"{where}: the re-run's output differs"
            )
    print(
        f"SIGKILL: {kills} of {len(commands) * KILLS_PER_COMMAND} runs killed mid-way, all re-ran to the "
        "undisturbed output"
    )
    assert kills >= len(commands)
