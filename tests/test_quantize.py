"""The quantize CLI: byte-identical to llm-compressor, atomic output, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.quantize import run as cli
from qerl.quantize.pipeline import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def llmcompressor_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("llmcompressor")
    return quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("lc") / "smollm2-lc", backend="llmcompressor")


def test_bit_exact_with_llmcompressor(smollm2_nvfp4_dir: Path, llmcompressor_dir: Path):
    ours = load_file(smollm2_nvfp4_dir / "model.safetensors")
    theirs = load_file(llmcompressor_dir / "model.safetensors")
    assert set(ours) == set(theirs)
    quantized = [k for k in ours if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    assert len(quantized) == 3 * 7 * 30  # every decoder Linear of SmolLM2, three tensors each
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert torch.equal(_bytes(ours[name]), _bytes(theirs[name])), name
    # one shared global scale for q/k/v and for gate/up, as vLLM's fused layers need
    p = "model.layers.7."
    assert ours[p + "self_attn.q_proj.weight_global_scale"] == ours[p + "self_attn.v_proj.weight_global_scale"]
    assert ours[p + "mlp.gate_proj.weight_global_scale"] == ours[p + "mlp.up_proj.weight_global_scale"]
    ours_cfg = json.loads((smollm2_nvfp4_dir / "config.json").read_text())
    theirs_cfg = json.loads((llmcompressor_dir / "config.json").read_text())
    assert ours_cfg["quantization_config"] == theirs_cfg["quantization_config"]
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "model_type"):
        assert ours_cfg[key] == theirs_cfg[key]


def test_streaming_output_is_sharded_and_loadable(tiny_llama_dir: Path, tmp_path: Path, monkeypatch):
    from qerl import checkpoint

    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 20_000)  # force several shards on a tiny model
    out = quantize_checkpoint(tiny_llama_dir, tmp_path / "out")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    from qerl.load.loader import load_model

    model = load_model(out, device="cpu")
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(args)
    return code, capsys.readouterr().err.strip()


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_missing_model_path(tmp_path: Path, capsys):
    code, err = _run_cli(
        ["--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o"), "--skip_generation"], capsys
    )
    assert code == 2 and err.count("\n") == 0 and "does not exist" in err
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_flag_errors_are_one_line_and_never_abbreviated(tmp_path: Path, capsys):
    """Like every qerl command (issue 16 item 6): argparse's usage block becomes one ``error:`` line, exit 2,
    and a prefix of a flag is not taken for the flag (``--mod`` is not ``--model``)."""
    for args in (["--mod", str(tmp_path)], ["--model", str(tmp_path), "--method", "awq"], []):
        code, err = _run_cli(args, capsys)
        assert code == 2 and err.count("\n") == 0 and err.startswith("error:"), (args, err)
    assert not _leftovers(tmp_path)


def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path, capsys):
    f = tiny_llama_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, err = _run_cli(["--model", str(tiny_llama_dir), "--output", str(tmp_path / "o"), "--skip_generation"], capsys)
    assert code == 2 and err.count("\n") == 0 and "model.safetensors" in err and "truncated" in err
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_checkpoint_missing_a_tensor(tiny_llama_dir: Path, tmp_path: Path, capsys):
    f = tiny_llama_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    code, err = _run_cli(["--model", str(tiny_llama_dir), "--output", str(tmp_path / "o"), "--skip_generation"], capsys)
    assert code == 2 and err.count("\n") == 0 and "model.layers.1.mlp.down_proj.weight" in err
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_in_features_not_multiple_of_16(tmp_path: Path, capsys):
    from tiny_models import make_tiny_llama

    src = make_tiny_llama(tmp_path / "odd", hidden=64, intermediate=120)  # down_proj in_features = 120
    code, err = _run_cli(["--model", str(src), "--output", str(tmp_path / "o"), "--skip_generation"], capsys)
    assert code == 2 and err.count("\n") == 0 and "down_proj" in err and "multiple of 16" in err
    assert not (tmp_path / "o").exists()
    code, _ = _run_cli(
        ["--model", str(src), "--output", str(tmp_path / "o"), "--skip_generation", "--ignore", "lm_head", "down_proj"],
        capsys,
    )
    assert code == 0 and "model.layers.0.mlp.down_proj.weight" in load_file(tmp_path / "o" / "model.safetensors")


def test_existing_output_needs_overwrite(tiny_llama_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _run_cli(["--model", str(tiny_llama_dir), "--output", str(out), "--skip_generation"], capsys)
    assert code == 2 and err.count("\n") == 0 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, err = _run_cli(
        ["--model", str(tiny_llama_dir), "--output", str(out), "--skip_generation", "--overwrite"], capsys
    )
    assert code == 2 and "not a checkpoint written by this tool" in err  # --overwrite replaces only our own outputs
    assert (out / "keep.txt").read_text() == "mine"


def test_crash_mid_write_leaves_nothing(tiny_llama_dir: Path, tmp_path: Path, monkeypatch):
    from qerl.checkpoint import ShardWriter

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "finish", boom)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(tiny_llama_dir, tmp_path / "o")
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_the_script_and_the_module_run_one_command(tmp_path: Path) -> None:
    """``python llm-compressor/quantize_nvfp4.py`` (the command users run) is a thin front of ``python -m
    qerl.quantize``: the same flags and the same one-line refusal, without reaching the package through sys.path."""
    assert "sys.path" not in (ROOT / "llm-compressor" / "quantize_nvfp4.py").read_text()
    argv = ["--model", str(tmp_path / "nothing"), "--output", str(tmp_path / "q"), "--skip_generation"]
    runs = [
        subprocess.run([sys.executable, *command, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        for command in (["-m", "qerl.quantize"], [str(ROOT / "llm-compressor" / "quantize_nvfp4.py")])
    ]
    for done in runs:
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: "), done.stderr
    assert runs[0].stderr.strip().splitlines()[-1] == runs[1].stderr.strip().splitlines()[-1]
    assert not (tmp_path / "q").exists()


def test_default_output_name():
    assert str(cli.default_output("Qwen/Qwen2.5-7B-Instruct")) == "qmodel/Qwen2.5-7B-Instruct-NVFP4A16"
    assert str(cli.default_output("smollm2-135m")) == "qmodel/smollm2-135m-NVFP4A16"


def test_cli_sample_generation(smollm2_nvfp4_dir: Path, tmp_path: Path, capsys):
    shutil.copytree(smollm2_nvfp4_dir, tmp_path / "q")
    text = cli.sample_generation(tmp_path / "q")
    assert isinstance(text, str) and len(text.strip()) > 0


def _write_big_checkpoint(out: Path, layers: int = 6, hidden: int = 2048, inter: int = 5632) -> int:
    """A ~0.6 GB random Llama checkpoint written layer by layer (never whole in memory)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        tie_word_embeddings=True,
    )
    out.mkdir()
    cfg.save_pretrained(out)
    kv = hidden // 4
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    weight_map, total = {}, 0
    for i in range(layers):
        shard = {f"model.layers.{i}.{k}.weight": torch.randn(s, dtype=torch.bfloat16) * 0.02 for k, s in shapes.items()}
        shard[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        shard[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        if i == 0:
            shard["model.embed_tokens.weight"] = torch.randn(1024, hidden, dtype=torch.bfloat16)
            shard["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(t.numel() * 2 for t in shard.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def test_streaming_peak_memory_is_bounded(tmp_path: Path):
    """Quantizing a checkpoint much larger than one output shard keeps the process's peak RSS near
    its import baseline plus one shard, not near the model size."""
    import subprocess

    size = _write_big_checkpoint(tmp_path / "big")
    probe = (
        "import resource, sys, torch; torch.set_num_threads(1); import qerl.quantize.pipeline as q; import transformers; "
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "q.quantize_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=64 << 20); "
        "print(base * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "big"), str(tmp_path / "q")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    base, peak = int(out[-2]), int(out[-1])
    growth = peak - base
    print(f"checkpoint {size / 2**20:.0f} MiB, RSS baseline {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
    assert growth < 0.5 * size, (growth, size)
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) > 1
