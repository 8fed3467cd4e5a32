"""The FP4 GEMM dispatcher: which NVFP4 x BF16/FP16 kernel runs a GEMM of a given shape, and the checks of its operands.

Callers (``ops``, ``nvfp4_group_decode``, the benchmarks) reach every FP4 kernel through ``matmul`` (the forward,
with the rollout engine's bias, LoRA-expand and segmented-layout epilogue) and ``matmul_t`` (grad_x); the kernels
sit one family a module below it:

* decode-sized M (<= ``schedule.DECODE_MAX_M``): on Hopper, for x in the Gluon K order (``gluon_layout``),
  ``fp4_direct`` (mma.sync, up to ``schedule.DIRECT_MAX_M`` rows) or ``fp4_gluon`` (TMA/wgmma, above
  ``schedule.GLUON_MIN_M`` rows, above ``DIRECT_MAX_M`` for GEMMs of at least ``schedule.GLUON_MIN_WEIGHTS`` weights,
  at any row count for those ``fp4_direct.refills``): ``gluon_kernel``; everything else ``fp4_decode`` (Triton);
* larger M: ``fp4_dequant.dequantize`` once into a transient bf16/fp16 copy, then cuBLAS;
* grad_x: ``fp4_backward`` up to ``schedule.FUSED_BWD_MAX_M`` rows, dequantize + cuBLAS above.

H200, 7B down_proj (N=3584, K=18944), benchmarks/results/kernels.json: M=1 2.15x of bf16 cuBLAS (``fp4_direct``),
M=16 1.86x (``fp4_decode``), M=64 1.32x (``fp4_gluon``); M=1024 fwd 0.73x / bwd 0.75x; M=4096 0.94x / 0.93x.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from qerl.nvfp4 import NVFP4Tensors

from . import fp4_backward, fp4_decode, reference, schedule
from .epilogue import PLAIN, Epilogue
from .fp4_base import check_act, check_weight
from .fp4_dequant import dequantize
from .schedule import DECODE_MAX_M, FUSED_BWD_MAX_M, Config, DecodeConfig

try:  # the Gluon kernels need Gluon's Hopper API (Triton 3.5 and later); without it the Triton kernel serves
    from . import fp4_direct, fp4_gluon
except ImportError:
    HAS_GLUON = False
else:
    HAS_GLUON = True


class Request(NamedTuple):
    """What routes one forward GEMM (``ROUTES``) besides its operands."""

    m: int  #: x's rows
    config: DecodeConfig | None  #: an explicit Triton decode schedule (tests, tuning), else None
    gluon_k: bool  #: x is in the Gluon K order (``gluon_layout``)
    gluon: str | None  #: the Gluon kernel ``gluon_kernel`` gives the GEMM: "tma", "direct" or None
    pdl: bool  #: the caller allows programmatic dependent launch (``pdl.gemm_launch``)


Launcher = Callable[[torch.Tensor, NVFP4Tensors, Epilogue, "torch.Tensor | None", Request], torch.Tensor]


def _dequantized(x: torch.Tensor, weight: NVFP4Tensors, epi: Epilogue, out: torch.Tensor | None, _: Request):
    """One dequantize pass into a transient bf16/fp16 weight, then cuBLAS, the epilogue in torch."""
    y = reference.linear(x, dequantize(weight, x.dtype), epi)
    return y if out is None or epi.out_bounds is not None else out.copy_(y)


def _tma(x: torch.Tensor, weight: NVFP4Tensors, epi: Epilogue, out: torch.Tensor | None, req: Request):
    return fp4_gluon.matmul(x, weight, epilogue=epi, out=out, gluon_k=req.gluon_k, pdl=req.pdl)


def _direct(x: torch.Tensor, weight: NVFP4Tensors, epi: Epilogue, out: torch.Tensor | None, req: Request):
    return fp4_direct.matmul(x, weight, epilogue=epi, out=out, pdl=req.pdl)


def _triton(x: torch.Tensor, weight: NVFP4Tensors, epi: Epilogue, out: torch.Tensor | None, req: Request):
    return fp4_decode.matmul(x, weight, epilogue=epi, out=out, config=req.config)


#: The forward's routing, first match wins; docs/kernels.md#routing is this table in words, each row's "why" there.
ROUTES: tuple[tuple[Launcher, Callable[[Request], bool]], ...] = (
    (_dequantized, lambda r: r.m > DECODE_MAX_M),
    (_tma, lambda r: r.gluon == "tma"),
    (_direct, lambda r: r.gluon == "direct" and r.gluon_k),
    (_triton, lambda r: not r.gluon_k),
)


def matmul(
    x: torch.Tensor,
    weight: NVFP4Tensors,
    *,
    epilogue: Epilogue = PLAIN,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    gluon_k: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """y = x @ W_hat^T and the ``epilogue`` (bias, LoRA expand, segmented y / u) for 2-D bf16/fp16 x on CUDA, on the
    first kernel of ``ROUTES`` whose condition holds.

    An explicit ``DecodeConfig`` sets the Triton decode kernel's schedule (M <= DECODE_MAX_M only). ``out`` (a
    contiguous [M, N] tensor of x's dtype) lets tests hand in a poisoned buffer. ``gluon_k``: x is in the Gluon K
    order (``gluon_layout``); only for GEMMs a Gluon kernel takes (``gluon_kernel``). ``pdl``: the Gluon kernels launch with
    programmatic dependent launch where ``pdl.gemm_launch`` allows it (``qerl/kernels/pdl.py``); the caller vouches
    that no kernel still in flight writes the weight (a model's frozen base weights).
    """
    check_act(x)
    N, K = check_weight(weight)
    M = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}] for this weight, got {tuple(x.shape)}")
    epilogue.check(M, N)
    if M > DECODE_MAX_M and config is not None:
        raise ValueError(f"the decode kernel takes M <= {DECODE_MAX_M}, got {M}")
    decode = M <= DECODE_MAX_M and config is None
    req = Request(M, config, gluon_k, gluon_kernel(M, N, K, x.dtype, x.device) if decode else None, pdl)
    for launch, applies in ROUTES:
        if applies(req):
            return launch(x.contiguous(), weight, epilogue, out, req)
    raise ValueError(
        f"x in the Gluon K order (gluon_k) needs a GEMM a Gluon kernel takes, got M={M}, K={K}, {x.dtype}, "
        f"config={config}"
    )


def _tma_rows(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether the TMA/wgmma kernel is the Gluon kernel for this many rows of this GEMM (``gluon_kernel``)."""
    if not schedule.SWITCHES.gluon_decode:
        return False
    if M > schedule.GLUON_MIN_M or (M > schedule.DIRECT_MAX_M and N * K >= schedule.GLUON_MIN_WEIGHTS):
        return True
    if M > schedule.DIRECT_MAX_M or not schedule.SWITCHES.direct_decode or schedule.SWITCHES.direct_ring:
        return False
    return fp4_direct.refills(N, K, device)


def gluon_kernel(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The Gluon kernel ``matmul`` runs an [M, K] x [K, N] decode GEMM on, which reads x in the Gluon K order
    (``gluon_layout``), so the op producing x should write it so (the rollout engine asks ``kernels.reads_gluon_k``):

    * "tma" above ``GLUON_MIN_M`` rows, from ``DIRECT_MAX_M + 1`` rows for GEMMs of at least ``GLUON_MIN_WEIGHTS``
      weights, and at fewer rows for GEMMs whose split-K slices the mma.sync kernel would stream through its
      x ring (``fp4_direct.refills``: the 32B down), the TMA/wgmma kernel (``fp4_gluon``,
      ``schedule.SWITCHES.gluon_decode``: sm_90, bf16, M <= 128, whole 256-code K steps); ``matmul`` permutes an x that is
      not in that order itself;
    * "direct" at most ``DIRECT_MAX_M`` rows: the register-only ``mma.sync`` kernel (``fp4_direct``,
      ``schedule.SWITCHES.direct_decode``), for an x already in that order (``gluon_k``); an x in natural order
      takes ``fp4_decode`` (a direct kernel reading natural order was 2% faster at M=1 but ~48% slower at
      M=8: docs/kernels.md#direct-max-m).

    None for every other GEMM, and without a Triton that has Gluon."""
    if not HAS_GLUON:
        return None
    if _tma_rows(M, N, K, device):
        return "tma" if fp4_gluon.supports(M, K, dtype, device) else None
    if schedule.SWITCHES.direct_decode and M <= schedule.DIRECT_MAX_M and fp4_direct.supports(M, K, dtype, device):
        return "direct"
    return None


def matmul_t(
    grad_y: torch.Tensor, weight: NVFP4Tensors, *, out: torch.Tensor | None = None, config: Config | None = None
) -> torch.Tensor:
    """grad_x = grad_y @ W_hat for 2-D bf16/fp16 grad_y [M, N]; returns [M, K].

    The fused kernel (``fp4_backward``) for M <= FUSED_BWD_MAX_M or an explicit ``config``, dequantize + cuBLAS above.
    """
    N, K = check_weight(weight)
    check_act(grad_y, "grad_y")
    if grad_y.shape[1] != N:
        raise ValueError(f"grad_y must be [M, {N}], got {tuple(grad_y.shape)}")
    M = grad_y.shape[0]
    grad_y = grad_y.contiguous()
    if config is None and M > FUSED_BWD_MAX_M:
        gx = grad_y @ dequantize(weight, grad_y.dtype)
        return gx if out is None else out.copy_(gx)
    return fp4_backward.matmul_t(grad_y, weight, out=out, config=config)
