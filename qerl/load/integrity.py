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
checks took 0.12-0.18 s of a 3.4-4.9 s load, a median 3.5% (``benchmarks/results/integrity.json`` at c55da27): they
re-read the 2.6 GB of bf16 embeddings / head and FP8 scales at memory bandwidth. A load to a GPU checks there
(``aminmax`` at HBM bandwidth) in buckets of many tensors and reads every verdict back once, at the end of the load
(:class:`Verdicts`): on one H100 the 731 checks of that checkpoint take 3.4 ms run alone, 0.38% of a 0.9 s load
(``benchmarks/results/integrity.json``).
"""

from __future__ import annotations

import torch

from qerl.checkpoint import GLOBAL_SCALE, PACKED, SCALE

#: The largest byte of a valid FP8-E4M3 block scale (448, E4M3's largest finite value, positive).
_MAX_SCALE_BYTE = 0x7E


#: On a GPU, tensors are checked in buckets of about this many elements (a concatenation of at most 64 MB in bf16).
BUCKET_ELEMENTS = 1 << 25


class DamagedTensor(ValueError):
    """A tensor holds values its format cannot hold (NaN, Inf, a negative scale)."""


def _kind(name: str, tensor: torch.Tensor, where: object) -> str | None:
    """How ``tensor`` is checked: ``"scale"`` (FP8 block-scale bytes), ``"global"`` (finite and positive),
    ``"values"`` (finite), or None when its dtype alone makes it sound (packed codes, integers, empty)."""
    suffix = name.rpartition(".")[2]
    if suffix == PACKED:
        if tensor.dtype != torch.uint8:
            raise DamagedTensor(f"{where}: tensor {name!r} is {tensor.dtype}, expected uint8 packed E2M1 codes")
        return None
    if tensor.numel() == 0:
        return None
    if suffix == SCALE and tensor.dtype == torch.float8_e4m3fn:
        return "scale"
    if not tensor.is_floating_point():
        return None
    return "global" if suffix == GLOBAL_SCALE else "values"


def _flat(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the 1-D view its check reads (an FP8 scale by its bytes)."""
    return (tensor.view(torch.uint8) if kind == "scale" else tensor).reshape(-1)


def _flag(kind: str, flat: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on ``flat``'s device, true when a tensor of ``kind`` may be damaged: one reduction in its own
    dtype. It over-approximates only for FP8 block scales (a -0.0 byte is above 0x7E and harmless), which
    :func:`_explain` then looks at closely."""
    if kind == "scale":
        return flat.max() > _MAX_SCALE_BYTE
    if kind == "global":
        return (~torch.isfinite(flat) | (flat <= 0)).any()
    return ~torch.isfinite(torch.stack(torch.aminmax(flat))).all()


def _suspect(name: str, tensor: torch.Tensor, where: object) -> torch.Tensor | None:
    """:func:`_flag` for one tensor (None: sound by its dtype alone)."""
    kind = _kind(name, tensor, where)
    return None if kind is None else _flag(kind, _flat(kind, tensor))


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
    """The checks of one load; on a GPU, batched and read back once, at :meth:`finish`.

    A host read waits for every copy queued before it, so one read per tensor (as :func:`check_tensor` does)
    serialized a GPU load behind its checks (14.6% of a 7B NVFP4 load on an H100), and even queued, a few kernel
    launches per tensor for its 731 tensors cost 10.8%: a load is host-bound (each copy from the memory-mapped file
    holds the host), so every launch adds to it. So a CUDA tensor joins a bucket of its kind and dtype; a bucket of
    :data:`BUCKET_ELEMENTS` is concatenated and checked by one reduction, its flag kept on the device; a tensor that
    large alone is checked alone. A CPU tensor is checked at once: there the reductions run at memory bandwidth and
    a concatenation would only add a copy.
    """

    def __init__(self, where: object) -> None:
        self.where = where
        self._flags: list[torch.Tensor] = []
        self._checked: list[list[tuple[str, torch.Tensor]]] = []  # the tensors behind each flag
        self._buckets: dict[tuple[str, torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
        self._sizes: dict[tuple[str, torch.dtype, torch.device], int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Check ``tensor`` (at once on a CPU; bucketed, its flag queued, on a GPU)."""
        if tensor.device.type != "cuda":
            check_tensor(name, tensor, self.where)
            return
        kind = _kind(name, tensor, self.where)
        if kind is None:
            return
        numel = tensor.numel()  # an FP8 scale has as many bytes as elements
        if numel >= BUCKET_ELEMENTS:
            self._queue(kind, [(name, tensor)])
            return
        key = (kind, tensor.dtype, tensor.device)
        self._buckets.setdefault(key, []).append((name, tensor))
        self._sizes[key] = self._sizes.get(key, 0) + numel
        if self._sizes[key] >= BUCKET_ELEMENTS:
            self._flush(key)

    def _flush(self, key: tuple[str, torch.dtype, torch.device]) -> None:
        del self._sizes[key]
        self._queue(key[0], self._buckets.pop(key))

    def _queue(self, kind: str, group: list[tuple[str, torch.Tensor]]) -> None:
        """One reduction over ``group``'s tensors (concatenated when more than one); its flag queued."""
        flats = [_flat(kind, tensor) for _, tensor in group]
        self._flags.append(_flag(kind, flats[0] if len(flats) == 1 else torch.cat(flats)))
        self._checked.append(group)

    def finish(self) -> None:
        """Read every queued flag in one synchronization; raise for the first tensor that is really damaged."""
        for key in list(self._buckets):
            self._flush(key)
        if not self._flags:
            return
        for index in torch.stack(self._flags).nonzero().flatten().tolist():
            for name, tensor in self._checked[index]:
                _explain(name, tensor, self.where)
        self._flags.clear()
        self._checked.clear()


__all__ = ["DamagedTensor", "Verdicts", "check_tensor", "check_tensors"]
