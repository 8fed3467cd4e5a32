"""--method mse and --method gptq (issue 13): the same checkpoint format as rtn, closer to bf16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama

from qerl import nvfp4
from qerl.hub import SIDE_FILES
from qerl.quantize import mse
from qerl.quantize import run as cli
from qerl.quantize.calibration import Calibration
from qerl.quantize.pipeline import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _block_errors(weight: torch.Tensor, q: nvfp4.NVFP4Tensors) -> torch.Tensor:
    deq = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32)
    return (deq - weight.float()).square().reshape(weight.shape[0], -1, nvfp4.GROUP_SIZE).sum(-1)


def test_mse_never_worse_per_block_and_better_overall():
    torch.manual_seed(0)
    w = (torch.randn(256, 512) * 0.02).to(torch.bfloat16)
    w[3, :16] = torch.linspace(-0.05, 0.05, 16).to(torch.bfloat16)
    g = nvfp4.global_scale(w)
    rtn, searched = nvfp4.quantize(w, g), mse.quantize(w, g)
    assert torch.equal(searched.weight_global_scale, rtn.weight_global_scale)
    e_rtn, e_mse = _block_errors(w, rtn), _block_errors(w, searched)
    assert (e_mse <= e_rtn + 1e-12).all()
    assert e_mse.sum() < 0.9 * e_rtn.sum()
    # each block's scale is one of the candidates: rtn's (amax -> 6) or amax -> 4
    four = nvfp4.block_scales(w, g, 4.0).view(torch.uint8)
    picked = searched.weight_scale.view(torch.uint8)
    assert ((picked == rtn.weight_scale.view(torch.uint8)) | (picked == four)).all()
    assert (picked == four).any() and (picked != four).any()
    # the block maximum is never clipped: it decodes within one E2M1 step of its value
    deq = nvfp4.dequantize(searched.weight_packed, searched.weight_scale, searched.weight_global_scale, torch.float32)
    blocks = w.float().reshape(256, -1, 16)
    top = blocks.abs().argmax(-1, keepdim=True)
    step = (searched.weight_scale.float() / g).unsqueeze(-1)
    assert ((deq.reshape(256, -1, 16).gather(-1, top) - blocks.gather(-1, top)).abs() <= step).all()


def _same_format(a: Path, b: Path) -> tuple[dict, dict]:
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
    return ta, tb


def test_mse_checkpoint(tiny_llama_dir: Path, tmp_path: Path):
    from qerl.load.loader import load_model

    rtn = quantize_checkpoint(tiny_llama_dir, tmp_path / "rtn")
    out = quantize_checkpoint(tiny_llama_dir, tmp_path / "mse", method="mse")
    t_rtn, t_mse = _same_format(rtn, out)
    assert json.loads((out / "config.json").read_text()) == json.loads((rtn / "config.json").read_text())
    dense = load_file(tiny_llama_dir / "model.safetensors")
    err = {"rtn": 0.0, "mse": 0.0}
    for k in (k for k in t_rtn if k.endswith(".weight_packed")):
        layer = k[: -len(".weight_packed")]
        assert torch.equal(t_mse[f"{layer}.weight_global_scale"], t_rtn[f"{layer}.weight_global_scale"])
        for name, t in (("rtn", t_rtn), ("mse", t_mse)):
            q = nvfp4.NVFP4Tensors(
                *(t[f"{layer}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
            )
            err[name] += _block_errors(dense[f"{layer}.weight"], q).sum().item()
    assert err["mse"] < 0.9 * err["rtn"], err
    assert load_model(out, device="cpu")(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


@pytest.fixture
def tiny_with_tokenizer(tmp_path: Path, smollm2_dir: Path) -> Path:
    """A tiny random Llama that speaks the embedded model's tokenizer (so it can calibrate on text).

    Its norm weights are log-normal, so input channels differ in scale as in trained LLMs; with
    isotropic activations GPTQ's Hessian is a multiple of the identity and it reduces to rtn.
    """
    src = make_tiny_llama(tmp_path / "tiny-tok", hidden=256, intermediate=512, vocab=49152)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for k, t in tensors.items():
        if k.endswith("norm.weight"):
            tensors[k] = torch.randn(t.shape, generator=gen).exp().to(t.dtype)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    for f in smollm2_dir.iterdir():
        if any(f.match(p) for p in SIDE_FILES) and f.name != "generation_config.json":
            shutil.copy(f, src / f.name)
    return src


#: Scored texts: GSM8K rows from the start of the split, disjoint from the bundled calibration rows at its end.
HELD_OUT = [json.loads(line) for line in (ROOT / "tests" / "data" / "gsm8k_train30.jsonl").read_text().splitlines()[:6]]


@torch.no_grad()
def _kl_to(dense_dir: Path, quant_dir: Path) -> float:
    """Mean per-token KL(bf16 || quantized) over the held-out texts."""
    from qerl.load.loader import load_model, load_tokenizer

    tok, dense, quant = (
        load_tokenizer(dense_dir),
        load_model(dense_dir, device="cpu"),
        load_model(quant_dir, device="cpu"),
    )
    kl = tokens = 0.0
    for row in HELD_OUT:
        ids = tok(f"{row['question']}\n{row['answer']}", return_tensors="pt").input_ids
        ref, logp = dense(ids).logits[0].log_softmax(-1), quant(ids).logits[0].float().log_softmax(-1)
        kl += (ref.exp() * (ref - logp)).sum().item()
        tokens += ids.shape[1]
    return kl / tokens


def test_gptq_checkpoint(tiny_with_tokenizer: Path, tmp_path: Path):
    pytest.importorskip("llmcompressor")
    rtn = quantize_checkpoint(tiny_with_tokenizer, tmp_path / "rtn")
    out = quantize_checkpoint(
        tiny_with_tokenizer, tmp_path / "gptq", method="gptq", calibration=Calibration(samples=32, max_tokens=128)
    )
    t_rtn, t_gptq = _same_format(rtn, out)
    cfg_rtn = json.loads((rtn / "config.json").read_text())["quantization_config"]
    cfg_gptq = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg_gptq["config_groups"]["group_0"]["weights"].pop("actorder")
    cfg_rtn["config_groups"]["group_0"]["weights"].pop("actorder")
    assert cfg_gptq == cfg_rtn
    packed = [k for k in t_rtn if k.endswith("weight_packed")]
    for k in t_rtn:  # GPTQ keeps the min/max scales; only the codes move
        if not k.endswith("weight_packed"):
            a, b = t_rtn[k], t_gptq[k]
            assert torch.equal(
                a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
            ), k
    assert sum(not torch.equal(t_rtn[k], t_gptq[k]) for k in packed) == len(packed)
    # GPTQ's objective, on held-out text: layer 0's q_proj sees RMSNorm(embedding), whatever else is quantized
    from qerl.load.loader import load_model, load_tokenizer

    dense = load_model(tiny_with_tokenizer, device="cpu")
    tok = load_tokenizer(tiny_with_tokenizer)
    ids = torch.cat([tok(f"{r['question']}\n{r['answer']}", return_tensors="pt").input_ids[0] for r in HELD_OUT])
    with torch.no_grad():
        x = dense.model.layers[0].input_layernorm(dense.model.embed_tokens(ids)).float()
        w = dense.model.layers[0].self_attn.q_proj.weight.float()
        out_err = {}
        for name, t in (("rtn", t_rtn), ("gptq", t_gptq)):
            p = "model.layers.0.self_attn.q_proj."
            w_hat = nvfp4.dequantize(
                t[p + "weight_packed"], t[p + "weight_scale"], t[p + "weight_global_scale"], torch.float32
            )
            out_err[name] = (x @ (w - w_hat).T).square().sum().item()
    kl_rtn, kl_gptq = _kl_to(tiny_with_tokenizer, rtn), _kl_to(tiny_with_tokenizer, out)
    print(
        f"held-out: q_proj output error rtn {out_err['rtn']:.4g}, gptq {out_err['gptq']:.4g}; "
        f"KL to bf16 rtn {kl_rtn:.5f}, gptq {kl_gptq:.5f}"
    )
    assert out_err["gptq"] < 0.85 * out_err["rtn"]
    assert kl_gptq < kl_rtn


def _run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--skip_generation"])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--method", "gptq", "--backend", "qerl"], "--method gptq runs on --backend llmcompressor"),
        (["--method", "mse", "--backend", "llmcompressor"], "--method mse runs on --backend qerl"),
        (["--calibration-samples", "8"], "apply to --method gptq"),
        (["--method", "gptq", "--calibration-data", "/nonexistent/calib.jsonl"], "does not exist"),
        (["--method", "gptq", "--calibration-samples", "100000"], "has 256 rows"),
        (["--method", "gptq", "--calibration-max-tokens", "0"], "must be positive"),
    ],
)
def test_method_errors(tiny_with_tokenizer: Path, tmp_path: Path, capsys, args: list[str], expect: str):
    if "gptq" in args and "qerl" not in args:
        pytest.importorskip("llmcompressor")
    code, err = _run(["--model", str(tiny_with_tokenizer), "--output", str(tmp_path / "o"), *args], capsys)
    assert code == 2 and err.splitlines()[-1].startswith("error:") and expect in err, err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
