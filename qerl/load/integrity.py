"""Integrity of loaded weights: every tensor a command reads is finite and in its format's range.

A checkpoint can be valid safetensors and still hold garbage: one FP8 block scale set to NaN (byte
0x7f) makes evaluation print nonsense, an export write NaN weights and a training run log a NaN
gradient norm and go on, all with exit status 0. So the loader, the export and the adapter readers
check each tensor once, where it was loaded, and stop with one line naming it.

The checks are one reduction per tensor in its own dtype (no copy, no per-element Python): a
floating-point tensor's minimum and maximum are finite exactly when all its elements are (``aminmax``
propagates NaN; Inf is an extreme), FP8-E4M3 block scales are checked on their bytes (the format
writes 0x00..0x7e only: 0x7f/0xff are E4M3's NaN and a set sign bit is a negative scale, so a byte
maximum of 0x7e clears a tensor at once, and only a larger one is looked at closely), and global
scales must be positive. The packed E2M1 codes need only their dtype: every byte is a valid pair of
codes. On a CPU (2 cores, a 5.85 GB Qwen2.5-7B-shaped NVFP4 checkpoint read from the page cache, bf16) the
checks take 0.12-0.18 s of a 3.4-4.9 s load, a median 3.5% (``benchmarks/results/integrity.json``): they re-read
the 2.6 GB of bf16 embeddings / head and FP8 scales at memory bandwidth. A load to a GPU checks there (``aminmax``
at HBM bandwidth) and reads every verdict back once, at the end of the load (:class:`Verdicts`); the share that
leaves is what ``python -m benchmarks.integrity`` measures on a GPU, not yet run since.
"""

from __future__ import annotations

import torch

from qerl.checkpoint import GLOBAL_SCALE, PACKED, SCALE

#: The largest byte of a valid FP8-E4M3 block scale (448, E4M3's largest finite value, positive).
_MAX_SCALE_BYTE = 0x7E


class DamagedTensor(ValueError):
    """A tensor holds values its format cannot hold (NaN, Inf, a negative scale)."""


def _suspect(name: str, tensor: torch.Tensor, where: object) -> torch.Tensor | None:
    """A 0-dim bool on ``tensor``'s device, true when the tensor may be damaged (None: sound by its dtype alone).

    One reduction in the tensor's own dtype; it over-approximates only for FP8 block scales (a -0.0 byte is above
    0x7E and harmless), which :func:`_explain` then looks at closely."""
    suffix = name.rpartition(".")[2]
    if suffix == PACKED:
        if tensor.dtype != torch.uint8:
            raise DamagedTensor(f"{where}: tensor {name!r} is {tensor.dtype}, expected uint8 packed E2M1 codes")
        return None
    if suffix == SCALE and tensor.dtype == torch.float8_e4m3fn:
        return None if tensor.numel() == 0 else tensor.view(torch.uint8).max() > _MAX_SCALE_BYTE
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if suffix == GLOBAL_SCALE:
        return (~torch.isfinite(tensor) | (tensor <= 0)).any()
    return ~torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def _explain(name: str, tensor: torch.Tensor, where: object) -> None:
    """Raise :class:`DamagedTensor` naming how many values of a suspect tensor are bad (none: it is sound)."""
    suffix = name.rpartition(".")[2]
    if suffix == SCALE and tensor.dtype == torch.float8_e4m3fn:
        raw = tensor.view(torch.uint8)
        bad = int((((raw & 0x7F) == 0x7F) | (raw > 0x80)).sum())  # -0.0 (0x80) is harmless
        what = "NaN or negative FP8 block scales; the checkpoint is damaged (re-quantize or re-download it)"
    elif suffix == GLOBAL_SCALE:
        bad = int((~torch.isfinite(tensor) | (tensor <= 0)).sum())
        what = (
            "global scales that are not finite and positive; the checkpoint is damaged (re-quantize or re-download it)"
        )
    else:
        bad = int((~torch.isfinite(tensor)).sum())
        what = "NaN or Inf values; the weights are damaged"
    if bad:
        raise DamagedTensor(f"{where}: tensor {name!r} has {bad} {what}")


def check_tensor(name: str, tensor: torch.Tensor, where: object) -> None:
    """Raise :class:`DamagedTensor` (one line naming ``where`` and ``name``) unless ``tensor`` is sound."""
    suspect = _suspect(name, tensor, where)
    if suspect is not None and bool(suspect):  # one host read: on a GPU, one sync
        _explain(name, tensor, where)


def check_tensors(tensors: dict[str, torch.Tensor], where: object) -> None:
    """:func:`check_tensor` over a name -> tensor mapping (a state dict, an adapter file)."""
    for name, tensor in tensors.items():
        check_tensor(name, tensor, where)


class Verdicts:
    """The checks of one load, with the verdicts of its GPU tensors read back once, at :meth:`finish`.

    A host read waits for every copy queued before it, so one read per tensor (as :func:`check_tensor` does)
    serialized a GPU load behind its checks: 14.6% of a 7B NVFP4 load on an H100 (``benchmarks.integrity``).
    Here a CUDA tensor's check only queues its suspect flag; a CPU tensor is checked at once, as before.
    """

    def __init__(self, where: object) -> None:
        self.where = where
        self._flags: list[torch.Tensor] = []
        self._tensors: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Check ``tensor`` (at once on a CPU; its flag queued on a GPU)."""
        if tensor.device.type != "cuda":
            check_tensor(name, tensor, self.where)
            return
        suspect = _suspect(name, tensor, self.where)
        if suspect is not None:
            self._flags.append(suspect)
            self._tensors.append((name, tensor))

    def finish(self) -> None:
        """Read every queued flag in one synchronization; raise for the first tensor that is really damaged."""
        if not self._flags:
            return
        for index in torch.stack(self._flags).nonzero().flatten().tolist():
            _explain(*self._tensors[index], self.where)
        self._flags.clear()
        self._tensors.clear()


__all__ = ["DamagedTensor", "Verdicts", "check_tensor", "check_tensors"]
