"""Training on hostile input (issue 72, the training side): where a run may write, what it resumes from, which
flag values and data it takes. Each test was seen to fail before its fix. Tiny random dense model with SmolLM2's
tokenizer (``tiny_dense_dir``), 1-2 steps: a few seconds per run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import copy_run, one_error, train_argv

from qerl.cli import run
from qerl.train.run import main

pytestmark = pytest.mark.usefixtures("own_digest_cache")


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a training run that must stop (exit status 2) before any work."""
    capsys.readouterr()
    return one_error(run(main, argv), capsys.readouterr().err)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory): what a refused run must leave as it was."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


# --- where a run may write ------------------------------------------------------------------------------------


def test_output_dir_holding_other_files_is_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-empty --output_dir holding no run (a project checkout: README.md, heldout.jsonl, plots/) had its files
    overwritten with rc 0, and ``--output_dir .`` replaced the checkout's README; now one line naming the flag, and
    every file is as it was."""
    mine = tmp_path / "mine"
    (mine / "plots").mkdir(parents=True)
    for name in ("README.md", "heldout.jsonl", "plots/reward.png"):
        (mine / name).write_text(f"my {name}\n")
    before = _tree(mine)
    line = _refused(train_argv(tiny_dense_dir, mine, "--heldout", "2", steps=1), capsys)
    assert line.startswith(f"error: --output_dir {mine}: ") and "holds no qerl run" in line, line
    monkeypatch.chdir(mine)
    line = _refused(train_argv(tiny_dense_dir, Path("."), steps=1), capsys)
    assert line.startswith("error: --output_dir .: ") and "holds no qerl run" in line, line
    assert _tree(mine) == before


def test_output_dir_that_is_a_link_or_a_loop_is_refused(tiny_dense_dir: Path, tmp_path: Path, capsys) -> None:
    """A symbolic link planted at --output_dir (in a shared parent such as /tmp) was followed and the run written
    through it; a loop of links was a traceback. Now each is one line naming the flag, the link's target untouched."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "run"
    link.symlink_to(target)
    line = _refused(train_argv(tiny_dense_dir, link, steps=1), capsys)
    assert line == f"error: --output_dir {link}: is a symbolic link; name the directory itself", line
    assert not any(target.iterdir())
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    line = _refused(train_argv(tiny_dense_dir, tmp_path / "a" / "run", steps=1), capsys)
    assert line.startswith(f"error: --output_dir {tmp_path / 'a' / 'run'}: cannot be resolved"), line


@pytest.mark.parametrize("planted", ["hard link", "directory"])
def test_lock_path_holding_a_hard_link_or_a_directory_is_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys, planted: str
) -> None:
    """A hard link planted at the run lock ``.NAME.lock`` had the file it shares overwritten with the PID; a
    directory there was a traceback. Now one line naming the lock, and what was planted is left as it was."""
    lock = tmp_path / ".run.lock"
    if planted == "hard link":
        (tmp_path / "precious").write_text("keep me\n")
        lock.hardlink_to(tmp_path / "precious")
    else:
        lock.mkdir()
    line = _refused(train_argv(tiny_dense_dir, tmp_path / "run", steps=1), capsys)
    assert line.startswith(f"error: --output_dir {tmp_path / 'run'}: its lock {lock} "), line
    assert lock.is_dir() if planted == "directory" else (tmp_path / "precious").read_text() == "keep me\n"
    assert not (tmp_path / "run").exists()


# --- what a run resumes from ----------------------------------------------------------------------------------


def _state(out: Path, **change: object) -> Path:
    """Checkpoint 2's trainer_state.json with ``change`` made to it."""
    file = out / "checkpoint-2" / "trainer_state.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    return file


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(global_step=-5), "global_step: expected an integer >= 0, got -5"),
        (dict(global_step=1), "global_step is 1, expected 2"),
        (dict(best_model_checkpoint="/"), "best_model_checkpoint '/' is outside"),
        (dict(global_step="2"), "global_step: expected an integer"),
        (dict(epoch=[1]), "epoch: expected a number"),
        (dict(log_history={"step": 1}), "log_history: expected a list of mappings"),
        (dict(surprise=1), "unknown field surprise"),
    ],
)
def test_crafted_trainer_state_is_refused_before_resuming(
    trained: Path,
    tiny_dense_dir: Path,
    tmp_path: Path,
    capsys,
    change: dict,
    expected: str,
) -> None:
    """trainer_state.json was restored as found: global_step -5 created checkpoint--2 and deleted the metrics of
    the steps after it, a best_model_checkpoint outside the run had --save_total_limit 1 delete every checkpoint of
    the run, and values of the wrong type were tracebacks. Now one line naming the file; the run is left as it was."""
    out = copy_run(trained, tmp_path)
    file = _state(out, **change)
    before = _tree(out)
    line = _refused(train_argv(tiny_dense_dir, out, "--save_total_limit", "1", steps=4), capsys)
    assert line.startswith(f"error: {file}: {expected}"), line
    assert _tree(out) == before


def test_refused_forced_resume_writes_nothing_first(
    trained: Path,
    tiny_dense_dir: Path,
    tmp_path: Path,
    capsys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--resume force into a run whose checkpoint is then refused rewrote heldout.jsonl and ran the held-out
    evaluation before the refusal; now every check comes before the first write, and the run is as it was."""
    out = copy_run(trained, tmp_path)
    _state(out, global_step=1)
    before = _tree(out)
    monkeypatch.setattr("qerl.train.run.heldout_accuracy", lambda *a, **k: pytest.fail("evaluated before the checks"))
    argv = train_argv(tiny_dense_dir, out, "--heldout", "3", "--resume", "force", steps=3)
    line = _refused(argv, capsys)
    assert line.startswith(f"error: {out / 'checkpoint-2' / 'trainer_state.json'}: global_step is 1"), line
    assert _tree(out) == before


# --- flag values ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("max_completion_length", "1000000000"),
        ("top_p", "nan"),
        ("beta", "nan"),
        ("max_grad_norm", "nan"),
        ("epsilon", "nan"),
        ("lora_dropout", "nan"),
        ("lora_dropout", "1.5"),
        ("learning_rate", "inf"),
        ("num_generations", "1000000"),
        ("heldout_max_tokens", "0"),
        ("seed", "99999999999"),
    ],
)
def test_number_flags_out_of_range_are_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys, flag: str, value: str
) -> None:
    """--max_completion_length 1000000000, --top_p nan and --beta nan were tracebacks (or NaN gradients);
    --max_grad_norm, --epsilon and --lora_dropout nan were taken without a word (nan epsilon trained with loss 0).
    Now every number flag is held to its range in one place (``qerl.train.bounds``): one line naming the flag,
    before anything is written."""
    out = tmp_path / "run"
    line = _refused(train_argv(tiny_dense_dir, out, f"--{flag}", value, steps=1), capsys)
    got = int(value) if value.isdigit() else float(value)
    assert line.startswith(f"error: --{flag}: expected ") and line.endswith(f", got {got!r}"), line
    assert not out.exists()


# --- training data --------------------------------------------------------------------------------------------

QUESTIONS = [f"What is {a} + {b}?" for a in range(1, 4) for b in range(1, 5)]


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rows(questions: list) -> list[dict]:
    return [{"question": q, "answer": "#### 5"} for q in questions]


def _gsm8k_argv(model: Path, out: Path, data: Path, *extra: str) -> list[str]:
    argv = train_argv(model, out, "--dataset_path", str(data), *extra, steps=1)
    argv[argv.index("arithmetic")] = "gsm8k"
    i = argv.index("--num-samples")
    return argv[:i] + argv[i + 2 :]


def test_training_data_line_past_the_record_bound_is_refused(
    tiny_dense_dir: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 1 GiB line was read whole (the run was killed for memory); now no line is read past
    ``qerl.train.data.MAX_RECORD_BYTES`` (patched small here): one line naming the file and the line."""
    from qerl.train import data

    monkeypatch.setattr(data, "MAX_RECORD_BYTES", 4096)
    monkeypatch.setattr(data, "READ_CHUNK", 1000)  # the line spans several chunks, as a 1 GiB one spans 1 MiB reads
    path = _data(tmp_path, _rows([*QUESTIONS, "What is " + "1 + " * 2000 + "1?"]))
    line = _refused(_gsm8k_argv(tiny_dense_dir, tmp_path / "run", path), capsys)
    assert line == f"error: --dataset_path {path}: line 13 is longer than 4096 bytes (one record per line)", line


def test_fewer_rows_than_one_generation_are_refused(tiny_dense_dir: Path, tmp_path: Path, capsys) -> None:
    """One row, and a generation of 2 prompts (4 completions per device, 2 per prompt): 0 steps trained, rc 0.
    Now one line naming the flags."""
    argv = train_argv(tiny_dense_dir, tmp_path / "run", "--per-device-train-batch-size", "4", steps=1)
    argv[argv.index("--num-samples") + 1] = "1"
    line = _refused(argv, capsys)
    assert "1 training row(s), fewer than the 2 prompts one generation takes" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("question", [["What is", "2 + 3?"], {"text": "What is 2 + 3?"}])
def test_question_that_is_not_text_is_refused(tiny_dense_dir: Path, tmp_path: Path, capsys, question) -> None:
    """A list of strings as ``question`` was a traceback, a mapping was trained on as its Python repr; now one line
    naming the row."""
    path = _data(tmp_path, _rows([question, question]))
    line = _refused(_gsm8k_argv(tiny_dense_dir, tmp_path / "run", path), capsys)
    assert f"--dataset_path {path}: row 0's question is a {type(question).__name__}" in line, line


def test_repeated_rows_stay_out_of_the_heldout_split(tiny_dense_dir: Path, tmp_path: Path, caplog) -> None:
    """Every question twice and --heldout 4: the split put copies of held-out questions into the training rows
    without a word. Now repeats are dropped before the split (one warning), so the two share no question."""
    path = _data(tmp_path, _rows(QUESTIONS + QUESTIONS))
    out = tmp_path / "run"
    summary = main(_gsm8k_argv(tiny_dense_dir, out, path, "--heldout", "4"))
    assert (summary["train_rows"], summary["heldout_rows"]) == (len(QUESTIONS) - 4, 4)
    assert f"dropped 12 of 24 rows of --dataset_path {path} that repeat an earlier prompt" in caplog.text


def test_local_data_leaves_no_copy_in_the_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a local file left its arrow copy in the datasets cache for good (706 MB for a 700 MB file); now the
    copy is made in a temporary directory of the run's, removed once the rows are in memory."""
    import tempfile

    import datasets

    from qerl.train import data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    rows = data.load_dataset("gsm8k", str(_data(tmp_path, _rows(QUESTIONS))))
    assert len(rows) == len(QUESTIONS) and rows.cache_files == []
    assert not (tmp_path / "hf").exists() and not any((tmp_path / "tmp").iterdir())


# --- smaller ones ---------------------------------------------------------------------------------------------


def test_empty_qerl_cache_means_the_default(tiny_dense_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``QERL_CACHE=`` (set, empty) put the digest cache into the current directory; now empty means unset."""
    from qerl.fingerprint import model_sha256

    monkeypatch.setenv("QERL_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    model_sha256(str(tiny_dense_dir))
    assert not any((tmp_path / "cwd").iterdir())
    assert any((tmp_path / "home" / ".cache" / "qerl").iterdir())


COMMANDS_THAT_IMPORT = {
    "train": ["-m", "qerl.train", "--output_dir", "{tmp}/run"],
    "export": ["-m", "qerl.export", "--model", "{tmp}/m", "--lora", "{tmp}/a", "--output", "{tmp}/out"],
    "quantize -m": ["-m", "qerl.quantize", "--model", "{tmp}/m", "--output", "{tmp}/out"],
    "quantize script": ["llm-compressor/quantize_nvfp4.py", "--model", "{tmp}/m", "--output", "{tmp}/out"],
    "eval.gsm8k": ["-m", "eval.gsm8k", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl", "--output", "{tmp}/o.jsonl"],
    "eval.math": ["-m", "eval.math", "--benchmark", "math500", "--model", "{tmp}/m", "--data", "{tmp}/d.jsonl"],
}


@pytest.mark.parametrize("command", COMMANDS_THAT_IMPORT)
def test_ctrl_c_during_the_imports_is_one_line(tmp_path: Path, command: str) -> None:
    """Ctrl-C while a command was still importing torch, transformers and trl (seconds) printed a 40-60 line
    traceback (``qerl.train`` was fixed first; export and quantize, by either name, still did; the evals import
    torch within ``qerl.cli.run`` and are held to it here); now ``interrupted`` and status 130, as once the command
    runs, and nothing written. ``-X importtime`` reports each import as it finishes:
    the signal comes once torch has begun to import, before the command looks at its model."""
    import signal
    import subprocess
    import sys
    import threading

    (tmp_path / "d.jsonl").write_text('{"question": "1+1?", "problem": "1+1?", "answer": "#### 2"}\n')
    argv = [a.format(tmp=tmp_path) for a in COMMANDS_THAT_IMPORT[command]]
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *argv],
        cwd=Path(__file__).resolve().parents[1],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(
            signal.SIGINT, signal.SIG_DFL
        ),  # as from a terminal, suite in background or not
    )
    guard = threading.Timer(120, proc.kill)
    guard.start()
    lines: list[str] = []
    for line in proc.stderr:
        if "torch" in line and not any("torch" in seen for seen in lines):
            proc.send_signal(signal.SIGINT)
        lines.append(line)
    guard.cancel()
    assert proc.wait() == 130, "".join(lines)
    assert [line for line in lines if not line.startswith("import time:")] == ["interrupted\n"], "".join(lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


@pytest.mark.parametrize("form", ["yaml", "json", "flag"])
def test_deeply_nested_settings_are_one_line(tmp_path: Path, capsys, form: str) -> None:
    """A recipe nested 100,000 deep (YAML or JSON), or a --rollout_engine_kwargs as deep, was a RecursionError
    traceback; now one line naming the recipe or the flag."""
    from qerl.train.args import parse_args

    deep = "[" * 100_000 + "]" * 100_000
    recipe = tmp_path / f"recipe.{form}"
    recipe.write_text({"yaml": f"rewards: {deep}\n", "json": f'{{"rewards": {deep}}}', "flag": "seed: 1\n"}[form])
    argv = ["--config", str(recipe), "--output_dir", str(tmp_path / "out")]
    argv += ["--rollout_engine_kwargs", '{"a": ' + deep + "}"] if form == "flag" else []
    capsys.readouterr()
    line = one_error(run(parse_args, argv), capsys.readouterr().err)
    where = "--rollout_engine_kwargs" if form == "flag" else f"--config {recipe}"
    assert line.startswith(f"error: {where}: ") and "nested" in line, line


def test_deeply_nested_run_record_is_one_line(tiny_dense_dir: Path, tmp_path: Path, capsys) -> None:
    """A run_config.json nested 100,000 deep was a RecursionError traceback; now it is no settings record."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_config.json").write_text("[" * 100_000 + "]" * 100_000)
    line = _refused(train_argv(tiny_dense_dir, out, steps=1), capsys)
    assert line.startswith(f"error: --output_dir {out}: run_config.json is not a settings record"), line


def test_rerun_removes_what_a_killed_adapter_save_left(
    trained: Path,
    tiny_dense_dir: Path,
    tmp_path: Path,
) -> None:
    """A run killed while writing its final adapter leaves ``.adapter.tmp-*`` (marked scratch) beside it, which the
    successful rerun kept; now the rerun removes it, and only it: a look-alike without the mark stays."""
    from qerl.fsutil import SCRATCH_MARK

    out = copy_run(trained, tmp_path)
    shutil.rmtree(out / "adapter")
    (out / "summary.json").unlink()  # killed before these: the run is not finished
    killed = out / ".adapter.tmp-killed"
    killed.mkdir()
    (killed / SCRATCH_MARK).touch()
    (killed / "adapter_model.safetensors").write_bytes(b"half")
    lookalike = out / ".adapter.tmp-notours"
    lookalike.mkdir()
    (lookalike / "keep").write_text("mine")
    assert main(train_argv(tiny_dense_dir, out, steps=2))["global_step"] == 2
    assert sorted(p.name for p in out.glob(".adapter.*")) == [".adapter.tmp-notours"]
    assert (lookalike / "keep").read_text() == "mine" and (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_vespo_with_a_sequence_level_correction_is_refused(tmp_path: Path, capsys, mode: str) -> None:
    """trl refuses loss_type vespo with a sequence-level importance-sampling mode, but only for its own vLLM: the
    correction qerl switches on for every engine trained with it. Now refused in one line, as trl words it."""
    from qerl.train.args import parse_args

    argv = ["--loss_type", "vespo", "--vllm_importance_sampling_mode", mode, "--output_dir", str(tmp_path / "out")]
    capsys.readouterr()
    line = one_error(run(parse_args, argv), capsys.readouterr().err)
    assert line.startswith("error: --loss_type vespo: needs --vllm_importance_sampling_mode token_truncate or "), line
    parse_args([*argv, "--vllm_importance_sampling_correction", "False"])  # no correction: nothing to refuse


# --- prompts, chat template and data text -----------------------------------------------------------------------------


QUESTIONS = [f"What is {a} + {b}?" for a in range(1, 4) for b in range(1, 5)]


def _questions_file(tmp_path: Path, questions: list[str]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n" for q in questions))
    return path


def _gsm8k_argv(model: Path, out: Path, data: Path, *extra: str) -> list[str]:
    argv = train_argv(model, out, "--dataset_path", str(data), *extra, steps=1)
    argv[argv.index("arithmetic")] = "gsm8k"
    i = argv.index("--num-samples")
    return argv[:i] + argv[i + 2 :]


def test_training_prompts_are_bounded_without_max_prompt_length(tiny_dense_dir: Path, tmp_path: Path) -> None:
    """Without --max_prompt_length nothing bounded a prompt (four 64 KB questions ran to an OOM kill): by default a
    prompt must fit the model's context (2048 positions here) less the completion budget, and longer ones are
    dropped, as --max_prompt_length drops them."""
    huge = "1 + 1 = ? " * 600  # about 3,600 tokens: past the tiny model's 2,048 positions
    data = _questions_file(tmp_path, QUESTIONS + [huge])
    summary = main(_gsm8k_argv(tiny_dense_dir, tmp_path / "run", data))
    assert summary["train_rows"] == len(QUESTIONS)
    from qerl.train.data import DEFAULT_MAX_PROMPT_TOKENS, prompt_budget

    assert prompt_budget(None, 4, tiny_dense_dir) == 2044 < DEFAULT_MAX_PROMPT_TOKENS


def test_model_without_a_chat_template_is_one_line_and_leaves_nothing(
    tiny_dense_dir: Path, tmp_path: Path, capsys
) -> None:
    """A 32-line traceback, and files left in the output directory; now one line naming the model, no output."""
    model = tmp_path / "plain"
    shutil.copytree(tiny_dense_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    capsys.readouterr()
    line = one_error(run(main, train_argv(model, out)), capsys.readouterr().err)
    assert f"--model_name {model}" in line and "chat template" in line, line
    assert not out.exists() or not any(out.iterdir())


def test_training_data_that_is_not_utf8_is_one_line_naming_the_file(
    tiny_dense_dir: Path, tmp_path: Path, capsys
) -> None:
    data = _questions_file(tmp_path, QUESTIONS)
    data.write_bytes(data.read_bytes() + b'{"question": "What is \xff?", "answer": "#### 1"}\n')
    capsys.readouterr()
    line = one_error(run(main, _gsm8k_argv(tiny_dense_dir, tmp_path / "run", data)), capsys.readouterr().err)
    assert f"--dataset_path {data}" in line and "UTF-8" in line, line
