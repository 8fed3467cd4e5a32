"""Programmatic dependent launch (PDL, sm_90) for the decode step: a decode GEMM's programs start while the
kernel before it on the stream is still running, load the first weights of their K slice (which no kernel of the
step writes), and only then wait for that kernel (``griddepcontrol.wait``) before they touch x, u or any output.

Why: at M=1 the gaps between kernels and the queueing of a wave's first weight requests are a large share of a
decode GEMM's time (docs/kernels.md#pdl). With PDL the next GEMM's first loads overlap the kernel before it.
The kernels that feed a decode GEMM (``fused_step``'s RMSNorm, SiLU and attention-combine kernels, and the GEMMs
themselves) call ``griddepcontrol.launch_dependents`` as they start (``TRIGGER``), so the GEMM is scheduled as
soon as their programs are all resident, not after the last one exits.

The contract of a PDL launch (``enabled``): its weights, scales and global scale are not written by any kernel
still in flight on the stream (true of a model's frozen base weights, which the rollout engine passes; a weight
quantized or copied by the kernel just before the call is not, so ``fp4_gemm.matmul`` takes PDL only when asked).
Everything else (x, LoRA u and B, bias, tickets, partials, outputs) is read or written after the wait. Waiting is
transitive (a kernel finishes only after its own wait returns), so the GEMM is ordered after every kernel before
it; a kernel launched without PDL after it waits for it as usual. ``QERL_DECODE_PDL=0`` (``schedule.SWITCHES.decode_pdl``)
launches everything without it. The TMA/wgmma kernel's BM=32 launches take none: the engine at b=32 was slower with
it (``fp4_gluon.PDL_BM``, docs/kernels.md#pdl-bm).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from . import schedule


@cache
def _capable(device: torch.device) -> bool:
    """A CUDA device of sm_90 or later, not Triton's CPU interpreter (which has no grid-dependency ops)."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL and trigger their dependents early: ``schedule.SWITCHES.decode_pdl``
    (read at each launch; a CUDA graph keeps what it captured) on an sm_90+ device."""
    return schedule.SWITCHES.decode_pdl and _capable(torch.device(device))


def gemm_launch(requested: bool, device: torch.device, *weights: torch.Tensor) -> dict:
    """The launch keywords of a decode GEMM the caller asks to launch with PDL (``requested``, vouching for frozen
    weights): the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``, on where ``enabled`` and every weight tensor
    is already contiguous (the kernel reads them before its wait: not right after a ``.contiguous()`` copy, which would
    be the kernel before it, still in flight)."""
    on = requested and enabled(device) and all(w.is_contiguous() for w in weights)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
