"""The NVFP4 weight format in plain torch, bit-compatible with compressed-tensors' NVFP4A16.

A quantized ``[N, K]`` weight ``W`` is stored as three tensors:

* ``weight_packed``       uint8 ``[N, K/2]``: two E2M1 codes per byte, even column in the low nibble;
* ``weight_scale``        float8_e4m3fn ``[N, K/16]``: one block scale per 16 input columns;
* ``weight_global_scale`` float32 ``[1]``: ``g = 448 * 6 / amax(|W|)``, a *divisor*.

Dequantization is ``W_hat[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) / g``.

Every rounding step below follows compressed-tensors (scale arithmetic in the weight's dtype,
then fp32) so that our checkpoints are byte-identical to llm-compressor's; the tests compare the
two on real weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.checkpoint import QUANTIZED_SUFFIXES

GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
#: compressed-tensors replaces a block scale that rounds to 0 by this value (the fp8 "eps").
ZERO_SCALE_REPLACEMENT = 0.125
#: E2M1 magnitudes indexed by the low three bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between consecutive magnitudes. A value exactly on a midpoint rounds to the
#: magnitude with the even mantissa: down at 0.25, 1.25, 2.5, 5.0 and up at 0.75, 1.75, 3.5.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


@dataclass(frozen=True)
class NVFP4Tensors:
    """The three tensors that stand for one quantized weight: in a checkpoint, and as the one weight operand of every
    FP4 kernel (``qerl.kernels``), which never takes them apart in its signatures."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor

    @property
    def out_features(self) -> int:
        """N, the weight's rows."""
        return self.weight_packed.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``[N, K]`` weight in ``dtype`` (module-level ``dequantize``)."""
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def as_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The checkpoint's ``{prefix}weight_packed`` / ``weight_scale`` / ``weight_global_scale`` tensors
        (the fields carry compressed-tensors' names, ``checkpoint.QUANTIZED_SUFFIXES``)."""
        return {f"{prefix}{name}": getattr(self, name) for name in QUANTIZED_SUFFIXES}


def check_quantizable(shape: torch.Size | tuple[int, ...], name: str = "weight") -> None:
    """Raise a one-line ValueError unless ``shape`` is a 2-D weight with in-features % 16 == 0."""
    if len(shape) != 2:
        raise ValueError(f"{name}: NVFP4 needs a 2-D [out, in] weight, got shape {tuple(shape)}")
    if shape[1] % GROUP_SIZE != 0:
        raise ValueError(
            f"{name}: in_features={shape[1]} is not a multiple of {GROUP_SIZE}; "
            "NVFP4 needs whole 16-element groups (add this layer to --ignore)"
        )


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """g = 448 * 6 / amax as fp32 ``[1]``, divided in amax's own dtype (bf16 weights give a bf16-rounded g,
    as compressed-tensors' observer does); a zero or non-finite amax gives 1.0."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (FP8_MAX * FP4_MAX) / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    """The per-tensor global scale of one weight."""
    return global_scale_from_amax(weight.detach().abs().amax())


def min_global_scale(scales: list[torch.Tensor]) -> torch.Tensor:
    """The scale layers that vLLM fuses (q/k/v, gate/up) must share: the minimum of their own."""
    return torch.stack([s.reshape(()) for s in scales]).min().reshape(1)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties as compressed-tensors), returning 4-bit codes as uint8."""
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for mid, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP, strict=True):
        idx += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    # The sign bit follows the input's sign bit even when the magnitude rounds to 0, so small
    # negative values become code 8 (-0.0), exactly as compressed-tensors packs them.
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 16-entry code -> value table, built once per device and dtype: a host-to-device copy on
    every call would be slow and cannot be captured in a CUDA graph."""
    key = (device, dtype)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=device)
    return _TABLES[key]


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode 4-bit codes (uint8 holding 0..15) to their values."""
    return _e2m1_table(codes.device, dtype)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] bytes, even column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def block_scales(weight: torch.Tensor, gscale: torch.Tensor, target: float = FP4_MAX) -> torch.Tensor:
    """FP8 block scales fp8(g * amax_block / target), zeros replaced by 0.125.

    ``target`` is the E2M1 magnitude a block's largest value maps to: 6 (the min/max scale every
    other tool uses) or less, which :mod:`qerl.quantize.mse` tries. amax_block / target is computed in
    the weight's own dtype before the fp32 multiply by g, because that is where compressed-tensors'
    observer rounds it.
    """
    n, k = weight.shape
    amax = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    local = amax / torch.tensor(target, dtype=amax.dtype)
    scaled = gscale.float() * local
    fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    fp8 = torch.where(fp8.float() == 0, torch.tensor(ZERO_SCALE_REPLACEMENT).to(torch.float8_e4m3fn), fp8)
    return fp8


def round_blocks(weight: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[N, K]`` of ``weight`` under block scales ``scale`` and global scale ``gscale``."""
    step = scale.float() / gscale.float()  # the quantization step of each block, fp32 as compressed-tensors
    n, k = weight.shape
    x = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE) / step.unsqueeze(-1)
    return round_to_e2m1(x.clamp(-FP4_MAX, FP4_MAX)).reshape(n, k)


def quantize(
    weight: torch.Tensor, gscale: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> NVFP4Tensors:
    """Quantize a ``[N, K]`` weight to NVFP4 by rounding to nearest.

    ``gscale`` lets fused layers (q/k/v, gate/up) share one global scale; by default the
    weight's own is used. ``scale`` gives the FP8 block scales (``[N, K/16]``, a search's result);
    by default they are the min/max ones, as llm-compressor's.
    """
    check_quantizable(weight.shape)
    weight = weight.detach()
    g = global_scale(weight) if gscale is None else gscale.float().reshape(1)
    scale = block_scales(weight, g) if scale is None else scale
    return NVFP4Tensors(pack_fp4(round_blocks(weight, scale, g)), scale, g.to(torch.float32))


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Packed NVFP4 -> dense ``[N, K]`` weight in ``dtype`` (arithmetic in fp32)."""
    codes = unpack_fp4(weight_packed)
    n, k = codes.shape
    step = weight_scale.float() / weight_global_scale.float()
    values = e2m1_to_float(codes).reshape(n, k // GROUP_SIZE, GROUP_SIZE) * step.unsqueeze(-1)
    return values.reshape(n, k).to(dtype)


def packed_nbytes(out_features: int, in_features: int) -> int:
    """Resident bytes of one quantized weight: 4.5 bits per element plus the fp32 global scale."""
    return out_features * in_features // 2 + out_features * in_features // GROUP_SIZE + 4
