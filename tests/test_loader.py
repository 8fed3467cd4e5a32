"""Loading NVFP4 checkpoints packed: interoperability, memory, quality, and load-mode errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.load.linear import NVFP4Linear
from qerl.load.loader import load_model, load_tokenizer

TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
# The first three GSM8K training question+answer texts (MIT licence).
GSM8K_TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?\nNatalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?\nWeng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?\nIn the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
]


def _ids(model_dir: Path) -> torch.Tensor:
    return load_tokenizer(model_dir)(TEXT, return_tensors="pt").input_ids


def test_nvfp4_layers_are_packed_and_small(smollm2_nvfp4_dir: Path):
    model = load_model(smollm2_nvfp4_dir, device="cpu")
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(linears) == 210
    packed = sum(b.numel() * b.element_size() for m in linears for b in m.buffers())
    dense_bf16 = sum(m.in_features * m.out_features * 2 for m in linears)
    assert packed / dense_bf16 <= 0.30, packed / dense_bf16
    assert not any(p.dtype == torch.uint8 for p in model.parameters())  # packed tensors are buffers
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_transformers_loads_our_checkpoint_with_same_logits(smollm2_nvfp4_dir: Path):
    pytest.importorskip("compressed_tensors")
    ids = _ids(smollm2_nvfp4_dir)
    ours = load_model(smollm2_nvfp4_dir, device="cpu", dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(smollm2_nvfp4_dir, dtype=torch.bfloat16)
    assert type(theirs.model.layers[0].self_attn.q_proj).__name__ != "NVFP4Linear"
    with torch.no_grad():
        a = ours(ids).logits.float()
        b = theirs(ids).logits.float()
    diff = (a - b).abs().max().item()
    print(f"max |logit diff| ours vs transformers+compressed-tensors (bf16): {diff}")
    # Both dequantize to the same bf16 weights and run the same bf16 forward on CPU: measured 0.0, so
    # anything but bit-equal logits is a real difference in how the checkpoint is read.
    assert torch.equal(a, b), diff


def test_our_loader_reads_llmcompressor_checkpoint(smollm2_dir: Path, smollm2_nvfp4_dir: Path, tmp_path: Path):
    pytest.importorskip("llmcompressor")
    from qerl.quantize.pipeline import quantize_checkpoint

    lc = quantize_checkpoint(smollm2_dir, tmp_path / "lc", backend="llmcompressor")
    ids = _ids(smollm2_nvfp4_dir)
    with torch.no_grad():
        a = load_model(smollm2_nvfp4_dir, device="cpu")(ids).logits
        b = load_model(lc, device="cpu")(ids).logits
    diff = (a - b).abs().max().item()
    print(f"max |logit diff| our loader: our checkpoint vs llm-compressor's: {diff}")
    assert diff == 0.0


def test_nvfp4_quality_close_to_bf16(smollm2_dir: Path, smollm2_nvfp4_dir: Path):
    """benchmarks/quality.py measures this on 50 texts for the README; here a 3-text check."""
    tok = load_tokenizer(smollm2_dir)
    dense_model, quant_model = load_model(smollm2_dir, device="cpu"), load_model(smollm2_nvfp4_dir, device="cpu")
    agree = total = 0
    nll = {"dense": 0.0, "quant": 0.0}
    with torch.no_grad():
        for text in GSM8K_TEXTS:
            ids = tok(text, return_tensors="pt").input_ids
            dense, quant = dense_model(ids).logits[0, :-1], quant_model(ids).logits[0, :-1]
            agree += (dense.argmax(-1) == quant.argmax(-1)).sum().item()
            total += ids.shape[1] - 1
            nll["dense"] += torch.nn.functional.cross_entropy(dense, ids[0, 1:], reduction="sum").item()
            nll["quant"] += torch.nn.functional.cross_entropy(quant, ids[0, 1:], reduction="sum").item()
    assert agree / total >= 0.7, agree / total
    assert nll["quant"] / nll["dense"] < 1.3  # perplexity ratio below exp(0.3 * log ppl)
    # and quantization did change the function (a test that could fail if we loaded dense weights)
    assert nll["quant"] != nll["dense"]


def test_load_modes(smollm2_dir: Path, smollm2_nvfp4_dir: Path):
    with pytest.raises(ValueError, match="not an NVFP4 checkpoint"):
        load_model(smollm2_dir, load="nvfp4", device="cpu")
    with pytest.raises(ValueError, match="is an NVFP4 checkpoint"):
        load_model(smollm2_nvfp4_dir, load="bf16", device="cpu")
    dense = load_model(smollm2_dir, device="cpu")
    assert not any(isinstance(m, NVFP4Linear) for m in dense.modules())


def test_missing_tensor_and_missing_path(smollm2_nvfp4_dir: Path, tmp_path: Path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(smollm2_nvfp4_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.3.self_attn.o_proj.weight_scale"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.3.self_attn.o_proj.weight_scale"):
        load_model(broken, device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere", device="cpu")


def test_tokenizer_has_right_eos_and_pad(smollm2_dir: Path):
    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert tok.chat_template


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_load_verdicts_name_the_damaged_tensor_and_pass_a_negative_zero_scale(device: str) -> None:
    """A GPU load queues each tensor's verdict and reads them once at the end; the tensor named is the damaged
    one, and a -0.0 FP8 block scale (suspect by its byte, harmless) passes on both devices."""
    from qerl.load.integrity import DamagedTensor, Verdicts

    verdicts = Verdicts("ckpt")
    verdicts.add("a.weight", torch.ones(4, device=device))
    verdicts.add("b.weight_scale", torch.tensor([-0.0, 1.0], device=device).to(torch.float8_e4m3fn))
    verdicts.add("c.weight_packed", torch.zeros(4, dtype=torch.uint8, device=device))
    with pytest.raises(DamagedTensor, match=r"^ckpt: tensor 'd.weight' has 1 NaN or Inf values"):
        verdicts.add("d.weight", torch.tensor([1.0, float("nan")], device=device))
        verdicts.finish()


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [8, 1 << 25], ids=["flushed-midway", "one-bucket-each"])
@pytest.mark.parametrize("damage", ["bias", "weight_scale", "weight_global_scale"])
def test_gpu_verdicts_in_buckets_name_the_damaged_tensor(
    bucket: int, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the tensors are checked in buckets of their kind (flushed at ``BUCKET_ELEMENTS``; a tensor that
    large is checked alone): wherever the damaged tensor falls, it is the one named, and the -0.0 FP8 scales
    that make every scale bucket suspect still pass."""
    import qerl.load.integrity as integrity

    monkeypatch.setattr(integrity, "BUCKET_ELEMENTS", bucket)
    why = {"bias": "NaN or Inf values", "weight_scale": "NaN or negative FP8", "weight_global_scale": "global scales"}
    bad = {"bias": float("inf"), "weight_scale": float("nan"), "weight_global_scale": 0.0}
    for damaged in range(5):
        verdicts = integrity.Verdicts("ckpt")
        for i in range(5):
            last = {suffix: bad[suffix] if i == damaged and suffix == damage else 1.0 for suffix in bad}
            verdicts.add(f"l{i}.bias", torch.tensor([1.0, 1.0, last["bias"]], dtype=torch.bfloat16, device="cuda"))
            scale = torch.tensor([-0.0, 2.0, last["weight_scale"]], device="cuda").to(torch.float8_e4m3fn)
            verdicts.add(f"l{i}.weight_scale", scale)
            verdicts.add(f"l{i}.weight_global_scale", torch.tensor([last["weight_global_scale"]], device="cuda"))
            verdicts.add(f"l{i}.weight_packed", torch.full((4,), 0xFF, dtype=torch.uint8, device="cuda"))
        verdicts.add("big.weight", torch.ones(16, device="cuda"))
        with pytest.raises(integrity.DamagedTensor, match=rf"^ckpt: tensor 'l{damaged}\.{damage}' has 1 {why[damage]}"):
            verdicts.finish()
    sound = integrity.Verdicts("ckpt")
    sound.add("l0.weight_scale", torch.tensor([-0.0, 2.0], device="cuda").to(torch.float8_e4m3fn))
    sound.add("big.weight", torch.ones(16, device="cuda"))
    sound.finish()
