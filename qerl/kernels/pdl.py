"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's kernels.

Why: a 7B decode step at batch 1 is ~300 dependent launches of 2-40 us each (four FP4 GEMMs, RMSNorm,
RoPE, two attention kernels and SiLU per layer). Without PDL each kernel starts only after the one
before it has drained, and then waits a DRAM round trip for its first weight tile: per launch a few
microseconds in which HBM idles. With PDL a kernel's programs are launched while the kernel before it
still runs; they do what does not depend on it (address arithmetic, and for the FP4 GEMMs an L2
prefetch of their first weight tiles, which no kernel of the step writes), then block in
``griddepcontrol.wait`` until that kernel has finished and its writes are visible.

The rule every PDL kernel keeps: no load of another kernel's output and no global store before
:func:`enter`. Waiting is transitive (a kernel finishes only after its own wait), so a PDL kernel is
ordered after every kernel before it on the stream; kernels launched without PDL (cuBLAS, torch) keep
ordinary stream order. CUDA-graph capture records the launches as programmatic edges.

``QERL_PDL=0`` launches everything without it (A/B timing, debugging).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: Set to 0 to launch the decode-step kernels without programmatic dependent launch.
ENV_SWITCH = "QERL_PDL"
#: Read at each launch (benchmarks/rollout.py ``--ab pdl`` flips it between engines; a CUDA graph keeps
#: what it captured).
ENABLED = os.environ.get(ENV_SWITCH, "1") != "0"


@cache
def _capable(device: torch.device) -> bool:
    """sm_90 or later, and not Triton's CPU interpreter (which has no grid-dependency ops)."""
    return (os.environ.get("TRITON_INTERPRET", "0") != "1" and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)  # fmt: skip


def options(device: torch.device) -> dict:
    """Launch keywords for a kernel taking a ``PDL`` constexpr: ``PDL`` (whether it calls
    :func:`enter`) and Triton's ``launch_pdl`` option, on for sm_90+ CUDA devices unless switched off."""
    if ENABLED and _capable(torch.device(device)):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """Let the next kernel on the stream launch, then wait until the kernel before this one has
    finished (its writes visible). A no-op unless PDL. Call it before any load of another kernel's
    output and before any global store."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Bring the 128-byte lines at ``ptrs`` (any shape; must point inside an allocation) into L2, with
    no result and no wait: what a PDL kernel does with data no kernel before it writes, before
    :func:`enter`."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
