"""--method mse's importance weighting (issue 13): data-free input moments and the weighted block search."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model

from qerl import checkpoint, nvfp4
from qerl.quantize import importance, mse
from qerl.quantize.pipeline import quantize_checkpoint
from qerl.quantize.source import SourceModel


def _checkpoint(tmp_path: Path, arch: str) -> Path:
    """A tiny random checkpoint with log-normal norm weights (so channels differ) and, for qwen2, v biases."""
    model = tiny_model(arch, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen).exp())
            elif name.endswith("v_proj.bias"):
                p.normal_(0, 0.5, generator=gen)
    out = tmp_path / arch
    model.save_pretrained(out)
    return out


def _moments(
    src: Path, names: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    source = SourceModel.from_dir(src)
    names = names if names is not None else source.linears()[0]
    return (
        importance.input_moments(checkpoint.TensorIndex(src), source.config, names),
        load_file(src / "model.safetensors"),
        source.config,
    )


def _relative(x: torch.Tensor) -> torch.Tensor:
    return x / x.mean()


def test_activation_moment_matches_sampling():
    z = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    std = torch.tensor([0.1, 1.0, 3.0])
    sampled = torch.stack([(torch.nn.functional.silu(s * z)).square().mean() for s in std.double()]).float()
    assert torch.allclose(importance.activation_moment("silu", std), sampled, rtol=0.02)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_input_moments_of_layer0(tmp_path: Path, arch: str):
    """Layer 0 by hand: q/k/v and gate/up read gamma^2 times the normalised residual moments; o_proj's
    channels of query head h are the value moments of KV head h // 2 (4 heads over 2), bias included."""
    src = _checkpoint(tmp_path, arch)
    got, t, _ = _moments(src)
    p = "model.layers.0."
    residual = t["model.embed_tokens.weight"].float().square().mean(0)
    attn_in = t[p + "input_layernorm.weight"].float().square() * _relative(residual)  # RMSNorm, then gamma
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert torch.allclose(got[p + "self_attn." + leaf], _relative(attn_in), rtol=1e-5)
    values = t[p + "self_attn.v_proj.weight"].float().square() @ attn_in
    if arch == "qwen2":
        values = values + t[p + "self_attn.v_proj.bias"].float().square()
    heads = values.reshape(2, -1)
    o_in = torch.cat([heads[0], heads[0], heads[1], heads[1]])
    assert torch.allclose(got[p + "self_attn.o_proj"], _relative(o_in), rtol=1e-5)
    residual = residual + t[p + "self_attn.o_proj.weight"].float().square() @ o_in
    mlp_in = t[p + "post_attention_layernorm.weight"].float().square() * _relative(residual)
    assert torch.allclose(got[p + "mlp.gate_proj"], _relative(mlp_in), rtol=1e-5)
    gate = t[p + "mlp.gate_proj.weight"].float().square() @ mlp_in
    up = t[p + "mlp.up_proj.weight"].float().square() @ mlp_in
    down = importance.activation_moment("silu", gate.sqrt()) * up
    assert torch.allclose(got[p + "mlp.down_proj"], _relative(down), rtol=1e-4)
    # every quantized Linear gets one positive value per input column, mean 1
    assert all(torch.isfinite(v).all() and (v > 0).all() and abs(v.mean().item() - 1) < 1e-5 for v in got.values())


def test_input_moments_only_for_known_layouts(tmp_path: Path):
    src = _checkpoint(tmp_path, "llama")
    got, _, config = _moments(src, ["model.layers.1.mlp.down_proj", "lm_head"])
    assert set(got) == {"model.layers.1.mlp.down_proj", "lm_head"}
    source = SourceModel.from_dir(src)
    assert (
        importance.input_moments(checkpoint.TensorIndex(src), {**config, "model_type": "gemma"}, source.linears()[0])
        == {}
    )


def test_weighted_search():
    """Each block gets whichever of amax->6 / amax->4 has the smaller importance-weighted error; the
    weights change some choices, a constant weight changes none, and the block max is never clipped."""
    torch.manual_seed(0)
    w = (torch.randn(128, 256) * 0.02).to(torch.bfloat16)
    g = nvfp4.global_scale(w)
    imp = torch.randn(256, generator=torch.Generator().manual_seed(1)).mul(2).exp()
    weighted = mse.search_scales(w, g, imp)
    assert torch.equal(
        mse.search_scales(w, g, torch.full((256,), 3.0)).view(torch.uint8), mse.search_scales(w, g).view(torch.uint8)
    )
    assert not torch.equal(weighted.view(torch.uint8), mse.search_scales(w, g).view(torch.uint8))
    errs = [mse.block_errors(w, nvfp4.block_scales(w, g, t), g, imp) for t in mse.TARGETS]
    assert torch.allclose(mse.block_errors(w, weighted, g, imp), torch.minimum(*errs))
    q = nvfp4.quantize(w, g, weighted)
    deq = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32).reshape(128, -1, 16)
    blocks = w.float().reshape(128, -1, 16)
    top = blocks.abs().argmax(-1, keepdim=True)
    step = (weighted.float() / g).unsqueeze(-1)
    assert ((deq.gather(-1, top) - blocks.gather(-1, top)).abs() <= step).all()
    with pytest.raises(ValueError, match="one value per input column"):
        mse.search_scales(w, g, imp[:128])


def test_mse_checkpoint_uses_the_moments(tmp_path: Path):
    """The streaming quantizer's mse scales are the weighted search's, with rtn's global scales."""
    src = _checkpoint(tmp_path, "qwen2")
    rtn = load_file(quantize_checkpoint(src, tmp_path / "rtn") / "model.safetensors")
    out = load_file(quantize_checkpoint(src, tmp_path / "mse", method="mse") / "model.safetensors")
    assert set(out) == set(rtn)
    moments, dense, _ = _moments(src)
    differs = 0
    for name, x2 in moments.items():
        g = out[f"{name}.weight_global_scale"]
        assert torch.equal(g, rtn[f"{name}.weight_global_scale"])
        expected = mse.search_scales(dense[f"{name}.weight"], g, x2).view(torch.uint8)
        assert torch.equal(out[f"{name}.weight_scale"].view(torch.uint8), expected), name
        differs += not torch.equal(expected, mse.search_scales(dense[f"{name}.weight"], g).view(torch.uint8))
    assert differs > 0
