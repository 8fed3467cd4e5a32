"""qerl.export: LoRA + trained norms folded into a bf16 (or re-quantized NVFP4) checkpoint.

A tiny random Llama, quantized by qerl, carries a peft adapter made to matter: random LoRA B (peft
starts it at 0) and norms perturbed by 10%. Checked: the merged weights equal peft's own delta added
to the dequantized base (so scaling, rsLoRA and rank patterns are peft's), the export's logits equal
the adapter model's within bf16 rounding, the NVFP4 export stays within the re-quantization error,
re-quantization that erases a small adapter is reported, and bad input fails in one line without
leaving anything behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from tiny_models import make_adapter, make_tiny_llama

from qerl import nvfp4
from qerl.export import MARKER, export, main
from qerl.load.loader import load_model
from qerl.load.lora import load_adapter
from qerl.quantize.pipeline import quantize_checkpoint

VOCAB = 256
#: bf16 export vs the adapter model: the merge rounds each weight to bf16 once (relative step 2^-8),
#: so logits move by a small fraction of their scale. Measured on this model: mean 0.0013-0.0019,
#: max 0.009-0.016 at max |logit| ~2.1, i.e. well inside these bounds; the adapter's own effect
#: (mean 0.16) is 15x the mean bound, so a dropped LoRA or norm cannot pass.
BF16_MEAN_REL, BF16_MAX_REL = 0.005, 0.02


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    src = make_tiny_llama(root / "bf16", vocab=VOCAB)
    return {"root": root, "src": src, "nvfp4": quantize_checkpoint(src, root / "nvfp4", backend="qerl")}


@pytest.fixture(scope="module")
def adapter(dirs: dict[str, Path]) -> Path:
    return make_adapter(dirs["nvfp4"], dirs["root"] / "adapter")


@pytest.fixture(scope="module")
def exports(dirs: dict[str, Path], adapter: Path) -> dict[str, tuple[Path, dict]]:
    out = {}
    for fmt in ("bf16", "nvfp4"):
        path = dirs["root"] / f"export-{fmt}"
        out[fmt] = (path, export(dirs["nvfp4"], adapter, path, fmt=fmt))
    return out


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def adapter_model(base: Path, adapter: Path) -> torch.nn.Module:
    return load_adapter(load_model(base, device="cpu", dtype=torch.float32), str(adapter))


def test_merged_weights_are_peft_delta_plus_dequantized_base(dirs, adapter, exports) -> None:
    path, record = exports["bf16"]
    merged = load_file(path / "model.safetensors")
    model = adapter_model(dirs["nvfp4"], adapter)
    lora_layers = {n.removesuffix(".base_layer"): m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}
    assert len(lora_layers) == 14 and record["merged_layers"] == 14 and record["replaced_tensors"] == 4
    for name, layer in lora_layers.items():
        key = name.removeprefix("base_model.model.") + ".weight"
        want = layer.base_layer.dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
        assert merged[key].dtype == torch.bfloat16 and torch.equal(merged[key], want.to(torch.bfloat16)), key
    for name, param in model.named_parameters():
        if "modules_to_save.default" in name:  # the trained norms, not the checkpoint's
            key = name.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
            assert torch.equal(merged[key], param.detach().to(torch.bfloat16)), key
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in merged)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert json.loads((path / MARKER).read_text())["format"] == "bf16"


@pytest.mark.parametrize(
    "extra",
    [dict(use_rslora=True), dict(rank_pattern={"down_proj": 8}, alpha_pattern={"q_proj": 32})],
    ids=["rslora", "patterns"],
)
def test_scaling_follows_peft(dirs, tmp_path: Path, extra: dict) -> None:
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM", **extra)
    ad = make_adapter(dirs["nvfp4"], tmp_path / "ad", config=cfg)
    export(dirs["nvfp4"], ad, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    model = adapter_model(dirs["nvfp4"], ad)
    for layer in (
        model.base_model.model.model.layers[1].self_attn.q_proj,
        model.base_model.model.model.layers[0].mlp.down_proj,
    ):
        want = layer.base_layer.dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
        name = next(n for n, m in model.named_modules() if m is layer).removeprefix("base_model.model.")
        assert torch.equal(merged[f"{name}.weight"], want.to(torch.bfloat16)), name


def test_bf16_export_logits_match_the_adapter_model(dirs, adapter, exports) -> None:
    ref = logits(adapter_model(dirs["nvfp4"], adapter))
    base = logits(load_model(dirs["nvfp4"], device="cpu", dtype=torch.float32))
    got = logits(load_model(exports["bf16"][0], load="bf16", device="cpu", dtype=torch.float32))
    scale = ref.abs().max().item()
    diff = (got - ref).abs()
    assert diff.mean().item() <= BF16_MEAN_REL * scale and diff.max().item() <= BF16_MAX_REL * scale
    assert (ref - base).abs().mean().item() >= 10 * BF16_MEAN_REL * scale  # the adapter matters


def test_nvfp4_export_within_the_requantization_error(dirs, adapter, exports) -> None:
    """NVFP4 export vs adapter model: no more than the measured re-quantization error (NVFP4 export vs
    bf16 export) plus the bf16 bound; that re-quantization error no more than 2x what quantizing the
    source cost (same grid, weights of similar size); and the merged update survives it."""
    path, record = exports["nvfp4"]
    ref = logits(adapter_model(dirs["nvfp4"], adapter))
    got = logits(load_model(path, load="nvfp4", device="cpu", dtype=torch.float32))
    dense = logits(load_model(exports["bf16"][0], load="bf16", device="cpu", dtype=torch.float32))
    base = logits(load_model(dirs["nvfp4"], device="cpu", dtype=torch.float32))
    source = logits(load_model(dirs["src"], device="cpu", dtype=torch.float32))
    requant = (got - dense).abs().mean().item()
    quant = (base - source).abs().mean().item()
    assert 0 < requant <= 2 * quant
    assert (got - ref).abs().mean().item() <= requant + BF16_MEAN_REL * ref.abs().max().item()
    assert record["lora_delta_retained"] > 0.9 and record["method"] == "rtn"
    # The same bytes qerl's quantizer writes for the merged weights (shared q/k/v and gate/up scales).
    packed, merged = load_file(path / "model.safetensors"), load_file(exports["bf16"][0] / "model.safetensors")
    p = "model.layers.1.self_attn."
    gscale = nvfp4.min_global_scale([nvfp4.global_scale(merged[f"{p}{x}_proj.weight"]) for x in "qkv"])
    want = nvfp4.quantize(merged[f"{p}k_proj.weight"], gscale)
    assert torch.equal(packed[f"{p}k_proj.weight_packed"], want.weight_packed)
    assert torch.equal(packed[f"{p}k_proj.weight_global_scale"], want.weight_global_scale)


def test_nvfp4_export_with_the_mse_method(dirs, adapter, exports) -> None:
    """``--method mse`` (the quantize CLI's data-free block-scale search) re-quantizes the same merge:
    same tensors and global scales as rtn, codes chosen to reconstruct the merged weights no worse."""
    path = dirs["root"] / "export-nvfp4-mse"
    record = export(dirs["nvfp4"], adapter, path, fmt="nvfp4", method="mse")
    assert record["method"] == "mse" and record["lora_delta_retained"] > 0.9
    mse, rtn = load_file(path / "model.safetensors"), load_file(exports["nvfp4"][0] / "model.safetensors")
    merged = load_file(exports["bf16"][0] / "model.safetensors")
    assert set(mse) == set(rtn)
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(mse[f"{name}.weight_global_scale"], rtn[f"{name}.weight_global_scale"])

    def error(t: dict) -> float:
        w = nvfp4.dequantize(t[f"{name}.weight_packed"], t[f"{name}.weight_scale"], t[f"{name}.weight_global_scale"])
        return (w.float() - merged[f"{name}.weight"].float()).square().sum().item()

    assert error(mse) <= error(rtn)


def test_small_update_lost_to_requantization_is_reported(dirs, tmp_path: Path, caplog) -> None:
    ad = make_adapter(dirs["nvfp4"], tmp_path / "ad", lora_scale=0.002)
    record = export(dirs["nvfp4"], ad, tmp_path / "out", fmt="nvfp4")
    assert record["lora_delta_retained"] < 0.5
    assert "--format bf16 keeps all of it" in caplog.text


def test_dense_base_merges_too(dirs, tmp_path: Path) -> None:
    ad = make_adapter(dirs["src"], tmp_path / "ad")
    ref = logits(adapter_model(dirs["src"], ad))
    export(dirs["src"], ad, tmp_path / "out")
    got = logits(load_model(tmp_path / "out", device="cpu", dtype=torch.float32))
    assert (got - ref).abs().mean().item() <= BF16_MEAN_REL * ref.abs().max().item()


def test_dense_base_exports_to_nvfp4(dirs, tmp_path: Path) -> None:
    """A dense base has no quantization_config to take the kept modules from: the re-quantization keeps lm_head in
    bf16, as the quantize CLI does by default (it named a constant the quantizer no longer had: AttributeError)."""
    ad = make_adapter(dirs["src"], tmp_path / "ad")
    record = export(dirs["src"], ad, tmp_path / "out", fmt="nvfp4")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert record["quantized_source"] is False and config["quantization_config"]["ignore"] == ["lm_head"]
    assert load_model(tmp_path / "out", load="nvfp4", device="cpu") is not None


# ---------------------------------------------------------------------------------------------- bad input


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """(exit code, the ``error:`` line); building the bad input's fixtures may print progress bars."""
    code = main(args)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == (code != 0)
    return code, errors[0] if errors else ""


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_existing_output_rules(dirs, adapter, tmp_path: Path, capsys) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    code, err = run_cli(
        ["--model", str(dirs["nvfp4"]), "--lora", str(adapter), "--output", str(foreign), "--overwrite"], capsys
    )
    assert code == 2 and "not written by qerl.export" in err
    assert (foreign / "keep.txt").read_text() == "mine"

    out = tmp_path / "out"
    assert run_cli(["--model", str(dirs["nvfp4"]), "--lora", str(adapter), "--output", str(out)], capsys)[0] == 0
    code, err = run_cli(["--model", str(dirs["nvfp4"]), "--lora", str(adapter), "--output", str(out)], capsys)
    assert code == 2 and "pass --overwrite" in err
    args = [
        "--model",
        str(dirs["nvfp4"]),
        "--lora",
        str(adapter),
        "--output",
        str(out),
        "--overwrite",
        "--format",
        "nvfp4",
    ]
    assert run_cli(args, capsys)[0] == 0
    assert json.loads((out / MARKER).read_text())["format"] == "nvfp4"
    code, err = run_cli(["--model", str(dirs["nvfp4"]), "--lora", str(adapter), "--output", str(dirs["nvfp4"])], capsys)
    assert code == 2 and "is the model directory" in err
    assert leftovers(tmp_path) == []


def test_bad_adapters(dirs, adapter, tmp_path: Path, capsys) -> None:
    def fails(lora: Path, expected: str, *flags: str) -> None:
        # 10 kB shards: a mismatch found late comes after shards were written (none may remain).
        args = [
            "--model",
            str(dirs["nvfp4"]),
            "--lora",
            str(lora),
            "--output",
            str(tmp_path / "out"),
            "--max-shard-gb",
            "1e-5",
            *flags,
        ]
        code, err = run_cli(args, capsys)
        assert code == 2 and expected in err, err
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []

    fails(tmp_path / "missing", "not a directory")
    fails(dirs["nvfp4"], "no adapter_config.json")
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    fails(dora, "use_dora is set")
    # An adapter of another model is refused by the base name peft recorded (as eval does); past that check
    # (--allow-base-mismatch) a 3-layer one targets layers the 2-layer checkpoint lacks, and one with a wider
    # MLP only shows at the MLP's tensors, midway through the writing.
    for name, overrides, expected in (
        ("deeper", dict(layers=3), "does not have"),
        ("wider", dict(intermediate=192), "shape"),
    ):
        other = quantize_checkpoint(
            make_tiny_llama(tmp_path / f"{name}-src", vocab=VOCAB, **overrides), tmp_path / f"{name}-q"
        )
        fails(make_adapter(other, tmp_path / f"{name}-ad"), "adapter was made for base model")
        fails(tmp_path / f"{name}-ad", expected, "--allow-base-mismatch")
        for suffix in ("src", "q", "ad"):
            shutil.rmtree(tmp_path / f"{name}-{suffix}")


def test_bad_model_and_flags(adapter, tmp_path: Path, capsys) -> None:
    code, err = run_cli(
        ["--model", str(tmp_path / "nope"), "--lora", str(adapter), "--output", str(tmp_path / "o")], capsys
    )
    assert code == 2 and "does not exist" in err
    for flag, needle in (
        (["--format", "int4"], "--format: invalid choice: 'int4'"),
        (["--method", "gptq"], "--method: invalid choice: 'gptq'"),
        (["--max-shard-gb", "0"], "--max-shard-gb: expected a size in GB"),
    ):
        # Issue 53, item 8: one ``error:`` line, as every qerl CLI, not argparse's 3-line usage dump.
        assert main(["--model", "x", "--lora", "y", "--output", "z", *flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err and "usage:" not in err, err
