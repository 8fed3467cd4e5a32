"""``--method mse``: data-free choice of each block's FP8 scale by importance-weighted error.

Round-to-nearest maps every 16-element block's largest magnitude to 6, the largest E2M1 value.
Mapping it to 4 instead (the "4/6" choice) gives the block's large values a finer grid
(..., 2, 3, 4 against ..., 3, 4, 6 of the same maximum) at the price of range, and wins on blocks
whose values crowd near their maximum. Per block we keep whichever of the candidate scales
(:data:`TARGETS`) reconstructs the block with the smaller squared error, each input column's error
weighted by the estimated second moment of that input channel (:mod:`qerl.quantize.importance`,
computed from the checkpoint's weights alone): an error where activations are large costs more.
The block maximum is representable under every candidate, so no weight is clipped. The global
scale stays the min/max one, shared by fused layers exactly as in rtn.

Measured on the embedded SmolLM2-135M (benchmarks/quality.py texts, 50 GSM8K rows, 9,601 tokens;
bf16 perplexity 6.29, rtn 7.33 / KL to bf16 0.219 / top-1 agreement 0.791), perplexity / KL / top-1:

* plain squared error (this method before the weighting): 7.20 / 0.183 / 0.808;
* weighted by the norm weights only (``gamma^2`` for q/k/v and gate/up, cruder proxies for o and
  down): 7.14 / 0.174 / 0.810; by ``gamma^2`` on q/k/v and gate/up alone, plain error on o and down:
  7.26 / 0.184 / 0.803; by the propagated moments (kept): 7.06 / 0.162 / 0.823, a quarter of
  rtn's gap; the moments raised to the power 0.5 or 1.5: 7.05 / 0.166 / 0.817 and 7.07 / 0.163 / 0.823;
* every fp8 scale between amax/6 and amax/4 as candidates, which leaves the block maximum off the
  grid: plain error 7.28 / 0.182 / 0.807; weighted by ``gamma^2`` 7.67 / 0.196 / 0.795; by the
  propagated moments 7.33 / 0.159 / 0.819; adding amax/3 to {6, 4}: 7.06 / 0.162 / 0.821;
* two Lloyd steps after the weighted choice (the weighted least-squares scale for the block's
  codes, its two fp8 neighbours and itself as candidates, codes re-rounded): 7.05 / 0.154 / 0.821;
  left out, 1 % of the gap for twice the search time;
* GPTQ-style error feedback with a data-free input covariance (propagated like the moments, from
  the embeddings' covariance): 7.62 / 0.196 / 0.803 (damping 1 % of the mean diagonal) and
  7.21 / 0.159 / 0.821 (damping 100 %); the estimated covariance misleads the feedback;
* earlier: candidates below amax/6, which clip the block maximum, lowered the weight error but gave
  perplexity 7.59; a search over the global scale (x1 and x2/3 per fused group) gave 7.61.

The ceiling of a per-block scale choice, measured with input moments taken from text (32 bundled
calibration rows: not data-free, for comparison only), is 6.96 / 0.148 / 0.827 with {6, 4} and
6.93 / 0.123 / 0.843 with every scale up to amax/4: neither reaches 40 % of rtn's gap (6.87), so the
data-free method cannot either; moving the codes themselves with real activations is what gptq does.
"""

from __future__ import annotations

import torch

from qerl import nvfp4

#: E2M1 magnitudes a block's largest value may map to: 6 is round-to-nearest's min/max scale.
TARGETS = (6.0, 4.0)
#: Rows are searched in slices of about this many elements, bounding the temporaries (fp32 copies).
_CHUNK = 1 << 22


def block_errors(
    weight: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, importance: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared reconstruction error of each block (``[N, K/16]``) under the given scales, each input
    column's error weighted by ``importance[j]`` (``[K]``) when given."""
    n, k = weight.shape
    codes = nvfp4.round_blocks(weight, scale, gscale)
    step = (scale.float() / gscale.float()).unsqueeze(-1)
    values = nvfp4.e2m1_to_float(codes).reshape(n, k // nvfp4.GROUP_SIZE, nvfp4.GROUP_SIZE) * step
    err = (values - weight.detach().float().reshape(values.shape)).square()
    if importance is not None:
        err = err * importance.float().reshape(1, k // nvfp4.GROUP_SIZE, nvfp4.GROUP_SIZE)
    return err.sum(-1)


def _search_rows(weight: torch.Tensor, gscale: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    best_scale = best_err = None
    for target in TARGETS:
        scale = nvfp4.block_scales(weight, gscale, target)
        err = block_errors(weight, scale, gscale, importance)
        if best_scale is None:
            best_scale, best_err = scale, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        # float8 has no torch.where kernel on every build: select on the raw bytes.
        best_scale = torch.where(better, scale.view(torch.uint8), best_scale.view(torch.uint8)).view(scale.dtype)
    return best_scale


def search_scales(weight: torch.Tensor, gscale: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 block scales ``[N, K/16]`` minimising each block's (importance-weighted) squared error
    over :data:`TARGETS`.

    Ties keep the earlier candidate, so a block where 4 gains nothing keeps rtn's scale.
    """
    nvfp4.check_quantizable(weight.shape)
    if importance is not None and tuple(importance.shape) != (weight.shape[1],):
        raise ValueError(
            f"importance has shape {tuple(importance.shape)}, expected ({weight.shape[1]},) "
            "(one value per input column)"
        )
    rows = max(1, _CHUNK // weight.shape[1])
    return torch.cat([_search_rows(weight[i : i + rows], gscale, importance) for i in range(0, weight.shape[0], rows)])


def quantize(
    weight: torch.Tensor, gscale: torch.Tensor | None = None, importance: torch.Tensor | None = None
) -> nvfp4.NVFP4Tensors:
    """:func:`qerl.nvfp4.quantize` with searched block scales (same format, same global scale);
    ``importance`` (``[K]``, :func:`qerl.quantize.importance.input_moments`) weighs the input columns."""
    g = nvfp4.global_scale(weight) if gscale is None else gscale.float().reshape(1)
    return nvfp4.quantize(weight, g, search_scales(weight, g, importance))
