"""Programmatic dependent launch (PDL, sm_90) for the decode step: a decode GEMM's programs start while the
kernel before it on the stream is still running, load the first weights of their K slice (which no kernel of the
step writes), and only then wait for that kernel (``griddepcontrol.wait``) before they touch x, u or any output.

Why: at M=1 the mma.sync decode kernel spends ~1.9 us per call between kernels and 1-2 us while its whole wave's
first weight requests queue in the memory system, against a 9 us floor for 7B down (H200, per-program timelines,
b107c8a:benchmarks/results/timeline_s30.json). With PDL the next GEMM's first loads overlap the kernel before it.
The kernels that feed a decode GEMM (``fused_step``'s RMSNorm, SiLU and attention-combine kernels, and the GEMMs
themselves) call ``griddepcontrol.launch_dependents`` as they start (``TRIGGER``), so the GEMM is scheduled as
soon as their programs are all resident, not after the last one exits.

The contract of a PDL launch (``enabled``): its weights, scales and global scale are not written by any kernel
still in flight on the stream (true of a model's frozen base weights, which the rollout engine passes; a weight
quantized or copied by the kernel just before the call is not, so ``fp4_gemm.matmul`` takes PDL only when asked).
Everything else (x, LoRA u and B, bias, tickets, partials, outputs) is read or written after the wait. Waiting is
transitive (a kernel finishes only after its own wait returns), so the GEMM is ordered after every kernel before
it; a kernel launched without PDL after it waits for it as usual. ``QERL_DECODE_PDL=0`` (``schedule.DECODE_PDL``)
launches everything without it.

Measured (H200): the 7B engine at 256 tokens,
off / on / off, 2.480 / 2.420 / 2.447 ms a step at b=1, 2.677 / 2.607 / 2.664 at b=8, 3.159 / 3.152 / 3.093 at b=16,
4.872 / 4.750 / 4.909 at b=64, 7.242 / 7.261 / 7.250 at b=128 (b107c8a:benchmarks/results/rollout_pdl_ab_s33.json, b107c8a:benchmarks/results/rollout_pdl_ab_b16_32_s34.json);
at b=32 it lost 6% (3.579 / 3.780 / 3.554), so the TMA/wgmma kernel's BM=32 launches take none (``fp4_gluon.PDL_BM``).
A decode GEMM after another GEMM: -6% to -7% (geometric mean) at M = 1..16 and 64, but 7B down at M=1, the kernel
target's shape, +6% (16.16 -> 17.21 us, kernels.json): ``fp4_direct`` requests x behind its first weights, so the
wait for x ends when they arrive and the next step's loads go out later (with the wait first it is 16.15 us); after the
SiLU + shrink kernel, as the engine runs it, the same GEMM is 0.85 us shorter with PDL as it is (b107c8a:benchmarks/results/pdl_prologue_s34.json).
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
    """Whether kernels on ``device`` launch with PDL and trigger their dependents early: ``schedule.DECODE_PDL``
    (read at each launch; a CUDA graph keeps what it captured) on an sm_90+ device."""
    return schedule.DECODE_PDL and _capable(torch.device(device))


def gemm_launch(requested: bool, device: torch.device, *weights: torch.Tensor) -> dict:
    """The launch keywords of a decode GEMM the caller asks to launch with PDL (``requested``, vouching for frozen
    weights): the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``, on where ``enabled`` and every weight tensor
    is already contiguous (the kernel reads them before its wait: not right after a ``.contiguous()`` copy, which would
    be the kernel before it, still in flight)."""
    on = requested and enabled(device) and all(w.is_contiguous() for w in weights)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
