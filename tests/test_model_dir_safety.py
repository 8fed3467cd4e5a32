"""A model directory is data (issue 72): its code is never run unasked, its links never lead out of it into an
output, its index never names weights outside it, its special files (a FIFO, a device) never hang or exhaust a
command, and a crafted GGUF header is one line. Each test was seen to fail before its fix."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
from helpers import eval_argv, one_error, run_module
from tiny_models import make_tiny_llama

from qerl.cli import run

pytestmark = pytest.mark.usefixtures("own_caches")


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("dense") / "bf16")


def _quantize(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from qerl.quantize.run import main

    capsys.readouterr()
    code = main([*argv, "--skip_generation"])
    return code, capsys.readouterr().err


def _export(merge: dict[str, Path], model: Path, out: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from qerl import export

    capsys.readouterr()
    argv = ["--model", str(model), "--lora", str(merge["adapter"]), "--output", str(out), "--allow-base-mismatch"]
    return export.main(argv), capsys.readouterr().err


# --- model code: never run without --trust-remote-code, never copied -----------------------------------------

#: A tokenizer whose class is the model directory's own code; importing it leaves the file {mark}.
_EVIL = (
    "import pathlib\n"
    "pathlib.Path({mark!r}).touch()\n"
    "from transformers import PreTrainedTokenizerFast\n\n\n"
    "class EvilTokenizer(PreTrainedTokenizerFast):\n"
    "    pass\n"
)


def _with_code(model: Path, out: Path, where: str) -> Path:
    """A copy of ``model`` whose ``where`` (tokenizer_config.json or config.json) maps an Auto class to a .py file
    in the directory."""
    shutil.copytree(model, out)
    path = out / where
    config = json.loads(path.read_text())
    if where == "tokenizer_config.json":
        config["tokenizer_class"] = "EvilTokenizer"
        config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    else:
        config["auto_map"] = {"AutoModelForCausalLM": "tokenization_evil.EvilTokenizer"}
    path.write_text(json.dumps(config))
    (out / "tokenization_evil.py").write_text(_EVIL.format(mark=str(out / "RAN")))
    return out


def test_eval_and_train_run_no_model_code_unasked(qtiny, tmp_path: Path, capsys, monkeypatch) -> None:
    """A tokenizer auto_map made transformers ask "[y/N]" on stdin, and `echo y |` ran the directory's code in eval and
    train; now both refuse in one line naming the file and --trust-remote-code, whatever stdin says."""
    import io

    from eval import gsm8k
    from qerl.train import run as train

    model = _with_code(qtiny, tmp_path / "coded", "tokenizer_config.json")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    line = one_error(run(gsm8k.main, eval_argv(model, tmp_path)), capsys.readouterr().err)
    assert "tokenizer_config.json" in line and "auto_map" in line and "--trust-remote-code" in line, line
    argv = ["--model-name", str(model), "--dataset", "arithmetic", "--output-dir", str(tmp_path / "run")]
    line = one_error(run(train.main, [*argv, "--report-to", "none", "--max_steps", "1"]), capsys.readouterr().err)
    assert "auto_map" in line and "--trust-remote-code" in line, line
    assert not (model / "RAN").exists() and not (tmp_path / "r.jsonl").exists() and not (tmp_path / "run").exists()


def test_trust_remote_code_is_what_runs_it(qtiny, tmp_path: Path, capsys) -> None:
    """--trust-remote-code is passed on to transformers: the directory's tokenizer class is used, and eval finishes."""
    from eval import gsm8k

    model = _with_code(qtiny, tmp_path / "coded", "tokenizer_config.json")
    assert run(gsm8k.main, eval_argv(model, tmp_path, "--trust-remote-code")) == 0, capsys.readouterr().err
    assert (model / "RAN").exists() and (tmp_path / "r.jsonl").exists()


def test_quantize_and_export_copy_no_model_code(dense, merge, tmp_path: Path, capsys) -> None:
    """quantize and export copied an auto_map config into their outputs (rc 0); now they refuse such a model in one
    line: they never run a directory's code, so they do not hand it on either."""
    source = shutil.copytree(dense, tmp_path / "source")
    (source / "tokenizer_config.json").write_text("{}")
    for where in ("config.json", "tokenizer_config.json"):
        coded = _with_code(source, tmp_path / f"coded-{where}", where)
        code, err = _quantize(["--model", str(coded), "--output", str(tmp_path / "q")], capsys)
        assert where in one_error(code, err) and "auto_map" in err, err
    coded = _with_code(merge["model"], tmp_path / "coded-nvfp4", "config.json")
    code, err = _export(merge, coded, tmp_path / "x", capsys)
    assert "config.json" in one_error(code, err) and "auto_map" in err, err
    assert not (tmp_path / "q").exists() and not (tmp_path / "x").exists()


# --- links among the side files ------------------------------------------------------------------------------


def _with_link(model: Path, out: Path, target: Path, name: str = "special_tokens_map.json") -> Path:
    shutil.copytree(model, out)
    (out / name).symlink_to(target)
    return out


def test_side_file_linked_out_of_the_model_is_not_copied(dense, merge, tmp_path: Path, capsys) -> None:
    """A side file linked to a secret outside the model directory was copied into quantize and export outputs as a
    regular file holding the secret; now both refuse it in one line naming the link, and write nothing."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hunter2"}')
    linked = _with_link(dense, tmp_path / "linked", secret)
    code, err = _quantize(["--model", str(linked), "--output", str(tmp_path / "q")], capsys)
    assert "special_tokens_map.json" in one_error(code, err) and "outside" in err, err
    code, err = _export(merge, _with_link(merge["model"], tmp_path / "linked-nvfp4", secret), tmp_path / "x", capsys)
    assert "special_tokens_map.json" in one_error(code, err) and "outside" in err, err
    assert not (tmp_path / "q").exists() and not (tmp_path / "x").exists()


def test_hub_snapshot_links_are_followed(dense, tmp_path: Path, capsys) -> None:
    """A Hugging Face cache snapshot is all links into its repository's blobs: those stay within the model."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in [*dense.iterdir(), tmp_path / "special_tokens_map.json"]:
        if not f.exists():
            f.write_text("{}")
        blob = repo / "blobs" / f.name
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    code, err = _quantize(["--model", str(snapshot), "--output", str(tmp_path / "q")], capsys)
    assert code == 0, err
    assert (tmp_path / "q" / "special_tokens_map.json").read_text() == "{}"


# --- the index names weights in the directory only -----------------------------------------------------------


@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_index_naming_weights_outside_the_model_is_refused(merge, tmp_path: Path, capsys, spelling: str) -> None:
    """model.safetensors.index.json whose weight_map names ../elsewhere/model.safetensors (or an absolute path) loaded
    weights the model's digest does not cover, and export called them verified; now refused in one line."""
    from safetensors import safe_open

    from qerl.load.loader import load_model

    model = shutil.copytree(merge["model"], tmp_path / "model")
    (tmp_path / "elsewhere").mkdir()
    weights = Path(shutil.move(model / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors"))
    name = str(weights) if spelling == "absolute" else "../elsewhere/model.safetensors"
    with safe_open(weights, framework="pt") as st:
        index = {"metadata": {}, "weight_map": dict.fromkeys(st.keys(), name)}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json.*outside the model directory"):
        load_model(model, device="cpu")
    code, err = _export(merge, model, tmp_path / "x", capsys)
    assert "outside the model directory" in one_error(code, err)
    assert not (tmp_path / "x").exists()


# --- special files: never read whole, never waited on ---------------------------------------------------------


def _special(model: Path, name: str, kind: str) -> None:
    (model / name).unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(model / name)
    else:
        (model / name).symlink_to("/dev/zero")


@pytest.mark.parametrize(
    "name, kind",
    [("config.json", "device"), ("model.safetensors", "fifo"), ("tokenizer_config.json", "fifo")],
)
def test_special_files_in_a_model_are_one_line(qtiny, tmp_path: Path, name: str, kind: str) -> None:
    """config.json -> /dev/zero was read whole (killed at 6 GiB); a FIFO as the weights or the tokenizer config hung
    eval. Now each is refused in one line naming the file, in seconds."""
    model = shutil.copytree(qtiny, tmp_path / "model")
    _special(model, name, kind)
    code, err = run_module(["eval.gsm8k", *eval_argv(model, tmp_path)], tmp_path, timeout=120)
    line = one_error(code, err)
    assert str(model / name) in line and "not a regular file" in line, line


def test_small_files_are_read_within_a_bound(qtiny, tmp_path: Path, monkeypatch) -> None:
    """Every small file of a model (its config here, padded past the bound) is refused by one helper's bound."""
    from qerl import fsutil
    from qerl.load.loader import check_supported

    model = shutil.copytree(qtiny, tmp_path / "model")
    bound = 3 << 20  # above the tokenizer's 2 MB
    with (model / "config.json").open("a") as f:
        f.write(" " * (bound + 1 - f.tell()))
    monkeypatch.setattr(fsutil, "SMALL_FILE_BYTES", bound)
    with pytest.raises(ValueError, match=rf"config\.json: larger than {bound} bytes"):
        check_supported(model)


# --- GGUF -----------------------------------------------------------------------------------------------------

_GGUF = {
    "cut short": b"GGUF" + struct.pack("<IQQ", 3, 1, 5) + b"\x05\x00",
    "not a GGUF": b"PK\x03\x04" + bytes(60),
    "a billion keys": b"GGUF" + struct.pack("<IQQ", 3, 0, 10**9) + bytes(64),
}


@pytest.mark.parametrize("case", sorted(_GGUF))
def test_crafted_gguf_header_is_one_line(tmp_path: Path, capsys, case: str) -> None:
    """A crafted GGUF header was a struct.error traceback out of quantize; now one line naming the file."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(_GGUF[case])
    code, err = _quantize(
        ["--model", str(tmp_path), "--gguf-file", "model.gguf", "--output", str(tmp_path / "q")], capsys
    )
    assert str(gguf) in one_error(code, err), err
    assert not (tmp_path / "q").exists()
