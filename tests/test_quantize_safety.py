"""The quantize CLI refuses what would destroy data or write a broken checkpoint (issue 16, items
1, 4, 5 and 6): each case ends in a one-line error with nothing written, or in the documented
behaviour of --ignore / --quantize-lm-head, and a killed run's hidden folders are cleaned up."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama

from qerl.quantize import run as cli

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--skip_generation"])
    return code, capsys.readouterr().err.strip()


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --- item 1: --overwrite never deletes the source, the cwd, or a directory this tool did not write


def test_output_dot_with_overwrite_keeps_the_cwd(tiny_llama_dir: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the case: the cwd holds the source model
    before = _snapshot(tmp_path)
    code, err = _run(["--model", str(tiny_llama_dir), "--output", ".", "--overwrite"], capsys)
    assert code == 2 and err.count("\n") == 0 and "--output . is or contains the source model" in err, err
    assert _snapshot(tmp_path) == before
    earlier = tmp_path / "q"  # an earlier output is still not replaced while it is the cwd
    assert _run(["--model", str(tiny_llama_dir), "--output", str(earlier)], capsys)[0] == 0
    monkeypatch.chdir(earlier)
    before = _snapshot(earlier)
    code, err = _run(["--model", str(tiny_llama_dir), "--output", ".", "--overwrite"], capsys)
    assert code == 2 and err.count("\n") == 0 and "current directory" in err, err
    assert _snapshot(earlier) == before


def test_output_equal_to_model_with_overwrite_keeps_the_source(tiny_llama_dir: Path, capsys):
    before = _snapshot(tiny_llama_dir)
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(tiny_llama_dir), "--overwrite"], capsys)
    assert code == 2 and err.count("\n") == 0 and "source model" in err, err
    assert _snapshot(tiny_llama_dir) == before


def test_output_containing_the_source_is_refused(tmp_path: Path, capsys):
    parent = tmp_path / "outer"
    src = make_tiny_llama(parent / "src")
    (parent / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}})
    )  # looks like an output
    before = _snapshot(parent)
    code, err = _run(["--model", str(src), "--output", str(parent), "--overwrite"], capsys)
    assert code == 2 and err.count("\n") == 0 and "source model" in err, err
    assert _snapshot(parent) == before


def test_output_inside_the_source_is_refused(tiny_llama_dir: Path, capsys):
    """An output inside the source model's directory was written there (the source then held a second model under
    its digest); now one line, and the source is as it was. Export refuses an output inside its model the same way."""
    before = _snapshot(tiny_llama_dir)
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(tiny_llama_dir / "nvfp4")], capsys)
    assert code == 2 and err.count("\n") == 0 and "inside the source model directory" in err, err
    assert _snapshot(tiny_llama_dir) == before


def test_overwrite_replaces_only_an_earlier_nvfp4_output(tiny_llama_dir: Path, tmp_path: Path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a checkpoint")
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(mine), "--overwrite"], capsys)
    assert code == 2 and err.count("\n") == 0 and "not a checkpoint written by this tool" in err, err
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
    dense = tmp_path / "dense"  # a bf16 model directory is not an output of this tool either
    make_tiny_llama(dense)
    before = _snapshot(dense)
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(dense), "--overwrite"], capsys)
    assert code == 2 and "not an NVFP4 checkpoint" in err, err
    assert _snapshot(dense) == before
    out = tmp_path / "q"
    assert _run(["--model", str(tiny_llama_dir), "--output", str(out)], capsys)[0] == 0
    (out / "stale.txt").write_text("from the first run")
    assert _run(["--model", str(tiny_llama_dir), "--output", str(out), "--overwrite"], capsys)[0] == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()


# --- item 4: NaN/Inf weights and a config.json that disagrees with the tensors


@pytest.mark.parametrize(
    ("tensor", "value", "backend"),
    [
        ("model.layers.1.mlp.up_proj.weight", float("nan"), "qerl"),
        ("model.layers.0.input_layernorm.weight", float("inf"), "qerl"),
        ("model.layers.1.mlp.up_proj.weight", float("nan"), "llmcompressor"),
    ],
)
def test_non_finite_weight_is_refused(
    tiny_llama_dir: Path, tmp_path: Path, capsys, tensor: str, value: float, backend: str
):
    if backend == "llmcompressor":
        pytest.importorskip("llmcompressor")
    f = tiny_llama_dir / "model.safetensors"
    tensors = load_file(f)
    tensors[tensor].view(-1)[3] = value
    save_file(tensors, f, metadata={"format": "pt"})
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(tmp_path / "o"), "--backend", backend], capsys)
    err = err.splitlines()[-1]  # transformers may log a loading bar before it
    assert code == 2 and err.startswith("error:") and tensor in err and ("NaN" in err and "Inf" in err), err
    assert not (tmp_path / "o").exists() and not _hidden(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("intermediate_size", 96, "config.json: intermediate_size gives"),
        ("num_hidden_layers", 1, "config.json: num_hidden_layers is 1, but the weights hold layers 0-1"),
        ("num_hidden_layers", 3, "config.json: num_hidden_layers is 3, but the weights hold layers 0-1"),
    ],
)
def test_config_that_disagrees_with_the_tensors_is_refused(
    tiny_llama_dir: Path, tmp_path: Path, capsys, key: str, value: int, expect: str
):
    cfg_path = tiny_llama_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 0 and expect in err, err
    assert not (tmp_path / "o").exists() and not _hidden(tmp_path)


# --- item 5: --ignore adds to lm_head, both forms for both backends


@pytest.fixture
def untied_dir(tmp_path: Path) -> Path:
    """A tiny Llama with its own lm_head weight (tie_word_embeddings false), so lm_head is quantizable."""
    src = make_tiny_llama(tmp_path / "untied")
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"]) * 0.05
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_ignore_keeps_lm_head_and_accepts_regex(untied_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "o"
    code, err = _run(
        [
            "--model",
            str(untied_dir),
            "--output",
            str(out),
            "--backend",
            "qerl",
            "--ignore",
            "down_proj",
            r"re:model\.layers\.0\.self_attn\.[qk]_proj$",
        ],
        capsys,
    )
    assert code == 0, err
    t = load_file(out / "model.safetensors")
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_packed" not in t
    for kept in (
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
    ):
        assert f"{kept}.weight" in t and f"{kept}.weight_packed" not in t, kept
    assert "model.layers.0.self_attn.v_proj.weight_packed" in t and "model.layers.1.self_attn.q_proj.weight_packed" in t
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert sorted(ignore) == sorted(
        [
            "lm_head",
            "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.down_proj",
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
        ]
    )


def test_quantize_lm_head(untied_dir: Path, tmp_path: Path, capsys):
    from qerl.load.linear import NVFP4Linear
    from qerl.load.loader import load_model

    out = tmp_path / "o"
    assert _run(["--model", str(untied_dir), "--output", str(out), "--quantize-lm-head"], capsys)[0] == 0
    t = load_file(out / "model.safetensors")
    assert "lm_head.weight_packed" in t and "lm_head.weight" not in t
    assert "lm_head" not in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    model = load_model(out, device="cpu")
    assert isinstance(model.lm_head, NVFP4Linear) and model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_bad_ignore_entries(tiny_llama_dir: Path, tmp_path: Path, capsys):
    for args, expect in (
        (["--ignore", "dwon_proj"], "matches no Linear"),
        (["--ignore", "re:(unclosed"], "regular expression"),
        (["--quantize-lm-head"], "tie_word_embeddings"),
    ):
        code, err = _run(["--model", str(tiny_llama_dir), "--output", str(tmp_path / "o"), *args], capsys)
        assert code == 2 and err.count("\n") == 0 and expect in err, (args, err)
        assert not (tmp_path / "o").exists()


def test_both_backends_read_ignore_the_same(untied_dir: Path, tmp_path: Path, capsys):
    pytest.importorskip("llmcompressor")
    ignore = ["--ignore", "o_proj", r"re:.*layers\.1\.mlp\.(gate|up)_proj$"]
    outs = {}
    for backend in ("qerl", "llmcompressor"):
        outs[backend] = tmp_path / backend
        code, err = _run(
            ["--model", str(untied_dir), "--output", str(outs[backend]), "--backend", backend, *ignore], capsys
        )
        assert code == 0, err
    ours, theirs = load_file(outs["qerl"] / "model.safetensors"), load_file(outs["llmcompressor"] / "model.safetensors")
    assert set(ours) == set(theirs) and "lm_head.weight" in ours and "model.layers.0.self_attn.o_proj.weight" in ours
    assert "model.layers.1.mlp.up_proj.weight" in ours and "model.layers.0.mlp.up_proj.weight_packed" in ours
    for name in ours:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype and torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        ), name


# --- item 6: a run killed with SIGKILL leaves hidden folders; the next run for the target removes them

_KILLED_RUN = """
import os, signal, sys
import qerl.quantize.pipeline as q
from qerl.quantize import run as cli
from qerl.checkpoint import ShardWriter
def die(self):
    os.kill(os.getpid(), signal.SIGKILL)
ShardWriter.finish = die
q.quantize_checkpoint(sys.argv[1], sys.argv[2])
"""


def test_killed_run_leftovers_are_cleaned_by_the_next_run(tiny_llama_dir: Path, tmp_path: Path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "q"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(tiny_llama_dir), str(out)],
        cwd=ROOT,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9
    left = _hidden(work)
    assert any(n.startswith(".q.tmp-") for n in left) and any(n.startswith(".q.src-") for n in left), left
    (work / ".other.tmp-keep").mkdir()  # another target's folder is not ours to remove
    (work / ".q.tmp-notours").mkdir()  # nor is a look-alike without our scratch mark
    code, err = _run(["--model", str(tiny_llama_dir), "--output", str(out)], capsys)
    assert code == 0, err
    assert _hidden(work) == [".other.tmp-keep", ".q.tmp-notours"] and (out / "model.safetensors").exists()


def test_a_live_run_for_the_same_target_is_not_disturbed(tiny_llama_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "q"
    busy = tmp_path / ".q.tmp-live"
    busy.mkdir()
    with open(tmp_path / ".q.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a running quantize holds (qerl.runlock: its PID inside)
        held.write("4242\n")
        held.flush()
        code, err = _run(["--model", str(tiny_llama_dir), "--output", str(out)], capsys)
    assert code == 2 and err.count("\n") == 0 and "another run (PID 4242) is writing it" in err, err
    assert busy.is_dir() and not out.exists()
