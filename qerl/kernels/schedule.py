"""Launch schedules of the NVFP4 kernels (``fp4_gemm``): tile shapes, split-K counts, the decode
schedule's environment override. Pure Python, no Triton, so the choices are tested on any machine.

Why split-K: a decode GEMM (M <= 128 tokens) has few output tiles (7B down_proj: 56 of 64 rows), so
the K dimension is cut into slices to give every SM work; ``decode_split`` picks how many from a
model of waves of resident programs (docs/kernels.md#wave-model).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

#: The interpreter (TRITON_INTERPRET=1, used to debug on CPU) mis-multiplies bf16, so under it the
#: scale multiply is done in fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch arithmetic on the host (no Triton import: this module runs on any machine)."""
    return -(-a // b)


@dataclass(frozen=True)
class Config:
    """Tile shape and schedule of one ``_bwd_kernel`` launch (grad_x, M <= ``FUSED_BWD_MAX_M``)."""

    BM: int
    BN: int
    BK: int
    warps: int
    stages: int
    group_m: int = 8
    mul_f32: bool = _INTERPRET


@dataclass(frozen=True)
class DecodeConfig:
    """Schedule of one ``_decode_kernel`` launch: BN weight rows x BK codes per K step, ``split`` K
    slices (0 = pick from the shape, ``decode_split``), ``x_split``: load x as one contiguous tile and
    split it in registers (else four strided gathers). BM (padded tokens) follows from M.
    ``resident``: programs one SM holds at BM=16, halving per doubling of BM (ptxas, BN=64 BK=256 3
    stages: 105 registers + 43 KB -> 4; BM=32 -> 2; BM=64, 255 registers + 117 KB -> 1)."""

    # The fastest of the schedules swept over 7B down / gate_up at M = 1 / 16 (docs/kernels.md#decode-schedule).
    BN: int = 64
    BK: int = 256
    warps: int = 4
    stages: int = 3
    split: int = 0
    x_split: bool = True
    resident: int = 4

    @classmethod
    def from_env(cls) -> DecodeConfig | None:
        """The schedule ``QERL_DECODE_CONFIG`` names (``"BN=64,BK=128,stages=6"``), or None when it is unset:
        lets a tuning run (benchmarks/decode_tune.py prints the line) try one schedule at every M on whole
        models without editing code. Unknown keys or non-integers are a one-line error."""
        spec = os.environ.get("QERL_DECODE_CONFIG", "").strip()
        if not spec:
            return None
        fields = {f for f in cls.__dataclass_fields__ if f != "x_split"}
        values = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in fields or not value.strip().isdigit():
                raise ValueError(
                    f"QERL_DECODE_CONFIG: expected comma-separated KEY=INT with KEY in {sorted(fields)}, got {item!r}"
                )
            values[key.strip()] = int(value)
        return cls(**values)


def _flag(name: str, default: bool) -> bool:
    """``QERL_<name>`` as a switch: unset gives ``default``, ``0`` turns it off, anything else on."""
    return os.environ.get(name, "1" if default else "0") != "0"


@dataclass(frozen=True)
class Switches:
    """The kernels' ``QERL_*`` switches, read once at import (table: docs/kernels.md#switches). Frozen, so a test or
    an A/B swaps the whole object (``switched``); a captured CUDA graph keeps what it was built with. One switch is
    not here: ``QERL_TRITON=0`` runs the plain-torch references everywhere; it says whether the kernels run at all,
    not which of them, and ``backend.enabled`` reads it once, at first use."""

    #: The Gluon TMA/wgmma decode GEMM (``fp4_gemm.gluon_kernel``; docs/kernels.md#gluon-min-m).
    gluon_decode: bool = True
    #: The register-only mma.sync decode GEMM up to ``DIRECT_MAX_M`` rows (docs/kernels.md#direct-max-m).
    direct_decode: bool = True
    #: Ring-refilling K slices stay on the mma.sync kernel, not the TMA/wgmma one (docs/kernels.md#direct-ring).
    direct_ring: bool = False
    #: The attention kernel ropes q / k and writes the cache itself (docs/kernels.md#rope-in-attention).
    rope_in_attention: bool = True
    #: The RMSNorm + LoRA shrink splits u's ranks over programs up to 64 rows (docs/kernels.md#rank-split).
    shrink_by_rank: bool = True
    #: Decode GEMMs launch with programmatic dependent launch (docs/kernels.md#pdl).
    decode_pdl: bool = True
    #: Sampling without top-k / top-p is one kernel (docs/kernels.md#fused-sampler).
    fused_sampler: bool = True
    #: One Triton decode schedule forced at every M (a tuning run), else None (docs/kernels.md#decode-schedule).
    decode_config: DecodeConfig | None = None

    @classmethod
    def from_env(cls) -> Switches:
        """The switches the environment sets (docs/kernels.md#switches)."""
        return cls(
            gluon_decode=_flag("QERL_DECODE_GLUON", True),
            direct_decode=_flag("QERL_DECODE_DIRECT", True),
            direct_ring=_flag("QERL_DECODE_DIRECT_RING", False),
            rope_in_attention=_flag("QERL_ROPE_IN_ATTENTION", True),
            shrink_by_rank=_flag("QERL_SHRINK_BY_RANK", True),
            decode_pdl=_flag("QERL_DECODE_PDL", True),
            fused_sampler=_flag("QERL_FUSED_SAMPLER", True),
            decode_config=DecodeConfig.from_env(),
        )


#: The switches in force; replaced whole, never mutated (``switched``).
SWITCHES = Switches.from_env()


@contextlib.contextmanager
def switched(**changes: object) -> Iterator[Switches]:
    """``SWITCHES`` with ``changes`` (field=value) inside the block, restored after it: how tests and A/B runs
    flip a switch without touching the environment. Engines built inside keep the step plans they built."""
    global SWITCHES
    saved = SWITCHES
    SWITCHES = replace(saved, **changes)
    try:
        yield SWITCHES
    finally:
        SWITCHES = saved


#: The Gluon kernel takes 17..128 rows: from 32 rows it beats the Triton kernel, at 16 it ties (docs/kernels.md#gluon-min-m).
GLUON_MIN_M = 16
#: From 9 rows the TMA/wgmma kernel also takes GEMMs of at least this many weights: it wins from 26 M, loses at 16.5 M
#: (docs/kernels.md#gluon-min-weights).
GLUON_MIN_WEIGHTS = 20_000_000
#: Rows up to which x in the Gluon K order runs the mma.sync kernel: it wins at 1, ties at 8, loses at 16
#: (docs/kernels.md#direct-max-m).
DIRECT_MAX_M = 8
#: The decode schedule per padded token count BM: the sweeps' best up to 32, two warpgroups sharing one x tile
#: above, BK=128 at BM=128 to fit shared memory (docs/kernels.md#decode-schedule, docs/kernels.md#decode-by-bm).
DECODE_BY_BM = {
    16: DecodeConfig(),
    32: DecodeConfig(),
    64: DecodeConfig(BN=128, BK=256, warps=8),
    128: DecodeConfig(BN=128, BK=128, warps=8),
}


def default_decode(M: int) -> DecodeConfig:
    """The schedule for M tokens: ``QERL_DECODE_CONFIG`` if set, else the measured one for its BM."""
    return SWITCHES.decode_config or DECODE_BY_BM[max(16, 1 << (M - 1).bit_length())]


#: M at or below which the forward takes a decode kernel, no dequantized weight (docs/kernels.md#the-floors).
DECODE_MAX_M = 128
#: M at or below which grad_x takes the fused ``_bwd_kernel``, dequantize + cuBLAS above (docs/kernels.md#design).
FUSED_BWD_MAX_M = 64
#: SMs of each device (filled lazily by :func:`sm_count`): the slots split-K fills. An entry made ahead describes a
#: device the host does not have (tests/test_step_plan_choices.py's H100 on a CPU host).
SM_COUNTS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (4 stands in for a CPU device, whose launches only the interpreter runs)."""
    if device not in SM_COUNTS:
        SM_COUNTS[device] = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        )
    return SM_COUNTS[device]


#: A decode program's fixed cost in K steps, ``decode_split``'s one parameter, fitted (docs/kernels.md#wave-model).
DECODE_PROGRAM_STEPS = 2


def decode_split(tiles: int, k_steps: int, slots: int, program_steps: int = DECODE_PROGRAM_STEPS) -> int:
    """Split-K count for ``tiles`` output tiles of ``k_steps`` K steps on ``slots`` resident programs.

    Programs run in waves of ``slots``; a wave lasts as long as one program (its K steps plus
    ``DECODE_PROGRAM_STEPS``). Minimizing waves x program length avoids both a last wave that is
    mostly empty (7B gate_up at M=1: 592 one-slice programs for 528 slots) and programs too short
    to pay their fixed cost (BM=64, one resident program per SM). Ties go to fewer slices (fewer
    partials). Within ~1% of the best split per shape (docs/kernels.md#wave-model). ``program_steps``: the
    fixed cost, in K steps, of the kernel being scheduled.
    """
    best, best_cost = 1, None
    for split in range(1, min(64, k_steps) + 1):
        steps = cdiv(k_steps, split)
        if cdiv(k_steps, steps) != split:  # the launch would run fewer slices: seen already
            continue
        cost = cdiv(tiles * split, slots) * (steps + program_steps)
        if best_cost is None or cost < best_cost:
            best, best_cost = split, cost
    return best


def resolve_split(tiles: int, k_steps: int, split: int, slots: int, program_steps: int) -> int:
    """The K slices a tile is cut into: ``split``, or ``decode_split``'s choice over ``slots`` resident programs when
    0, lowered to the count that slices of ``ceil(k_steps / split)`` steps give."""
    if split <= 0:
        split = decode_split(tiles, k_steps, slots, program_steps)
    return cdiv(k_steps, cdiv(k_steps, split))


def _max_sm_steps(slices: list[float], sms: int) -> float:
    """The most K steps one SM runs when the block scheduler deals programs (``slices``: each one's K steps, in
    launch order) round-robin over ``sms`` SMs: a one-wave launch lasts about as long as that SM."""
    load = [0.0] * sms
    for i, steps in enumerate(slices):
        load[i % sms] += steps
    return max(load)


@functools.lru_cache(maxsize=4096)
def balanced_split(tiles: int, split: int, slots: int, k_steps: int, sms: int) -> tuple[int, int]:
    """``(base, extra)``: ``decode_split``'s ``split`` slices for every tile, and one slice more for the last
    ``extra`` tiles where a uniform split leaves resident slots empty and filling them shortens the busiest SM.

    Why: one wave of equal programs on fewer programs than slots leaves some SMs with fewer of them, and those
    finish early and idle (7B down at M=64: 56 tiles x 4 slices = 224 programs on 264 slots of 2 an SM,
    docs/kernels.md#balanced-split). With 40 tiles in 5 slices the grid is 264 programs and
    the kernel launches the longer slices' programs first (``fp4_gluon._slice_of``), so each SM holds at most one
    of them. Where there are more long programs than SMs, some SM still runs two and the extra slices only add
    partials (32B down at M=32: 56 long programs x 3 > 132 SMs): the balanced split is kept only when the round-robin
    load model (``_max_sm_steps``) says the busiest SM gets lighter.
    ``extra`` stays below ``tiles`` (all of them would be a uniform split the wave model did not pick)."""
    if split + 1 > k_steps or tiles * split >= slots:
        return split, 0
    extra = min(tiles - 1, slots - tiles * split)
    uniform = _max_sm_steps([k_steps / split] * (tiles * split), sms)
    balanced = _max_sm_steps(
        [k_steps / split] * ((tiles - extra) * split) + [k_steps / (split + 1)] * (extra * (split + 1)), sms
    )
    return (split, extra) if balanced < 0.99 * uniform else (split, 0)


def decode_config(M: int, N: int, K: int, device: torch.device, cfg: DecodeConfig | None = None) -> DecodeConfig:
    """``cfg`` (default: ``default_decode(M)``) with BK and split resolved for this shape.

    BK halves (down to 64) until it divides K, so the model shapes take the unmasked EVEN_K loop;
    split comes from ``decode_split`` with the SM count x the programs an SM holds at this M.
    """
    cfg = cfg or default_decode(M)
    bk = cfg.BK
    while K % bk and bk > 64:
        bk //= 2
    split = cfg.split
    if split <= 0:
        bm = max(16, 1 << (M - 1).bit_length())
        slots = sm_count(device) * max(1, cfg.resident * 16 // bm)
        split = decode_split(cdiv(N, cfg.BN), cdiv(K, bk), slots)
    return replace(cfg, BK=bk, split=split)


def bwd_config(M: int, N: int, K: int) -> Config:
    if M <= FUSED_BWD_MAX_M:
        return Config(BM=16 if M <= 16 else 64, BN=64, BK=128, warps=4, stages=3)
    return Config(BM=128, BN=64, BK=128, warps=8, stages=3)
