"""The NVFP4 format in plain torch: rounding, packing, scales, round trip."""

from __future__ import annotations

import pytest
import torch

from qerl import nvfp4


def test_e2m1_rounding_matches_the_tie_rules():
    # Each midpoint ties to the even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, -0.75, -5.01, -0.1])
    decoded = nvfp4.e2m1_to_float(nvfp4.round_to_e2m1(x))
    expected = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0, -0.0])
    assert torch.equal(decoded, expected)
    # small negatives keep their sign bit (code 8 = -0.0), as compressed-tensors packs them
    assert nvfp4.round_to_e2m1(torch.tensor([-0.1])).item() == 8


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = nvfp4.pack_fp4(codes)
    assert packed.shape == (5, 16)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])  # even column in the low nibble
    assert torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)


def test_quantize_dequantize_error_and_scales():
    torch.manual_seed(0)
    w = (torch.randn(64, 128) * 0.05).to(torch.bfloat16)
    w[3, :16] = 0  # an all-zero block gets the 0.125 scale, not 0
    q = nvfp4.quantize(w)
    assert q.weight_packed.dtype == torch.uint8 and q.weight_packed.shape == (64, 64)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (64, 8)
    assert q.weight_global_scale.dtype == torch.float32 and q.weight_global_scale.shape == (1,)
    assert q.weight_scale[3, 0].float().item() == 0.125
    assert q.weight_global_scale.item() == pytest.approx(2688 / w.float().abs().max().item(), rel=1e-2)
    w_hat = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32)
    rel = (w_hat - w.float()).norm() / w.float().norm()
    assert 0 < rel < 0.12  # 4-bit RTN on Gaussian weights: ~9% relative error
    assert torch.all(w_hat[3, :16] == 0)


def test_fused_layers_share_the_minimum_global_scale():
    a, b = torch.randn(16, 32), torch.randn(16, 32) * 3
    g = nvfp4.min_global_scale([nvfp4.global_scale(a), nvfp4.global_scale(b)])
    assert g.item() == min(nvfp4.global_scale(a).item(), nvfp4.global_scale(b).item())


def test_in_features_must_be_multiple_of_16():
    with pytest.raises(ValueError, match="not a multiple of 16"):
        nvfp4.quantize(torch.randn(8, 24))


def test_packed_size_is_4_5_bits_per_weight():
    assert nvfp4.packed_nbytes(1024, 4096) * 8 / (1024 * 4096) == pytest.approx(4.5, abs=1e-4)


def test_nvfp4linear_keeps_packed_dtypes_under_to_dtype():
    from qerl.load.linear import NVFP4Linear

    layer = NVFP4Linear.from_linear(torch.nn.Linear(32, 8, bias=True))
    before = layer.dequantized_weight(torch.float32)
    layer.to(torch.bfloat16)
    assert layer.weight_packed.dtype == torch.uint8
    assert layer.weight_scale.dtype == torch.float8_e4m3fn
    assert layer.weight_global_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16  # the bias is an ordinary parameter and follows
    assert torch.equal(layer.dequantized_weight(torch.float32), before)
    x = torch.randn(3, 32)
    assert layer.to(torch.float32)(x).shape == (3, 8)
