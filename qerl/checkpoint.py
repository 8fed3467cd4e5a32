"""The compressed-tensors NVFP4A16 checkpoint: its config block, reading its tensors safely (:class:`TensorIndex`)
and writing them in bounded shards (:class:`ShardWriter`).

The quantizer and export (which write checkpoints) and the loader (which reads them) go through here, so the
format lives in one place.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from qerl.fsutil import check_regular, read_json, save_safetensors

NVFP4_FORMAT = "nvfp4-pack-quantized"
#: compressed-tensors' names for a quantized Linear's tensors (after ``{layer}.``): the packed E2M1
#: codes, the FP8 block scales, the FP32 global scale. ``NVFP4Linear``'s buffers carry the same names.
PACKED, SCALE, GLOBAL_SCALE = QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
#: A written checkpoint's shard size, unless the writer is told otherwise (the quantize and export CLIs'
#: ``--max-shard-gb``): a streaming writer's peak memory is about one shard plus one tensor.
SHARD_BYTES = 4 << 30


def packed_layers(names: Iterable[str]) -> set[str]:
    """The layers (name prefixes) among tensor ``names`` that hold an NVFP4 weight."""
    suffix = f".{PACKED}"
    return {n.removesuffix(suffix) for n in names if n.endswith(suffix)}


def quantization_config(ignore: list[str], version: str | None = None) -> dict:
    """The ``quantization_config`` block that llm-compressor writes for scheme NVFP4A16.

    Built from compressed-tensors' own NVFP4A16 preset and config model, plus what llm-compressor adds
    when it compresses: the group's compressor format, the observer its recipe ran, and the
    ``ModelCompressor`` keys beside the quantization config (tests/test_quantize.py compares the whole
    block with llm-compressor's output).
    """
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    if version is None:
        import compressed_tensors

        version = compressed_tensors.__version__
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = NVFP4_FORMAT
    scheme.weights.observer = "memoryless_minmax"
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=NVFP4_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    ).model_dump(mode="json")
    return {**config, "sparsity_config": {}, "transform_config": {}, "version": version}


def read_config(model_dir: Path) -> dict:
    """``model_dir``'s config.json as a dict, read bounded (``qerl.fsutil.read_json``: a device or FIFO is refused)."""
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face model directory")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def is_nvfp4_config(config: dict) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors" and qc.get("format") == NVFP4_FORMAT


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (through the index when there is one), each a regular file.
    The index may name files of the directory only: one outside it (``../x``, an absolute path) would load weights
    that the model's digest (``qerl.fingerprint``) does not cover."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        record = read_json(index)
        weight_map = record.get("weight_map") if isinstance(record, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map is not an object of tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if name in ("", ".", "..") or Path(name).name != name:
                raise ValueError(
                    f"{index}: weight_map names {name!r}, outside the model directory; expected file names in it"
                )
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files; expected a safetensors checkpoint")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: listed in model.safetensors.index.json but missing")
        check_regular(f)  # a FIFO would hang the reader
    return files


#: A decoder layer's tensors: ``model.layers.N.self_attn.q_proj.weight_packed`` and the like.
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(model_dir: Path, config: dict, tensors: TensorIndex | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``config``'s ``num_hidden_layers`` is exactly the decoder layers
    the weights hold (read from the safetensors headers, no tensor data). A config that claims fewer layers
    runs a truncated model with every extra weight ignored, more layers adds random ones (or allocates a
    huge skeleton before any tensor is compared), so the count is settled before anything is allocated.
    ``tensors``: the checkpoint's headers when the caller has them already."""
    where = model_dir / "config.json"
    count = config.get("num_hidden_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}: num_hidden_layers is {count!r}; expected a positive integer")
    names = (tensors or TensorIndex(model_dir)).names()
    held = {int(m.group(1)) for name in names if (m := _LAYER_TENSOR.search(name))}
    if len(held) != count or max(held) != count - 1:  # distinct indices from 0: exactly 0..count-1
        found = f"layers {min(held)}-{max(held)} ({len(held)} in all)" if held else "no decoder layers"
        raise ValueError(
            f"{where}: num_hidden_layers is {count}, but the weights hold {found}; "
            "the config does not describe these weights"
        )


class TensorIndex:
    """Name -> file map over a checkpoint's shards, reading one tensor at a time (memory-mapped).

    ``check(name, tensor, file)``, when given, sees every tensor read and raises on a bad one
    (:func:`qerl.load.integrity.check_tensor`: finite, in range)."""

    def __init__(
        self, model_dir: Path, check: Callable[[str, torch.Tensor, Path], None] | None = None, keep_open: bool = False
    ) -> None:
        self.check = check
        self.keep_open = keep_open
        self._open: tuple[Path, Any] | None = None
        self.files: dict[str, Path] = {}
        #: name -> (shape, safetensors dtype name) as the headers declare them, before any data is read.
        self.headers: dict[str, tuple[tuple[int, ...], str]] = {}
        for f in shard_files(model_dir):
            try:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        self.files[name] = f
                        header = st.get_slice(name)
                        self.headers[name] = (tuple(header.get_shape()), header.get_dtype())
            except Exception as e:  # safetensors raises several types for damaged files
                raise ValueError(f"{f}: unreadable safetensors file ({e}); is it truncated?") from None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        f = self.files[name]
        try:
            if self.keep_open:
                tensor = self._handle(f).get_tensor(name)
            else:
                with safe_open(f, framework="pt") as st:
                    tensor = st.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: could not read tensor {name!r} ({e}); is the file truncated?") from None
        if self.check is not None:
            self.check(name, tensor, f)
        return tensor

    def _handle(self, f: Path) -> Any:
        """``f`` opened once and kept until a tensor of another file is asked for (``keep_open``): opening and
        unmapping a shard per tensor cost 0.4 s of a 7B load's ~4 s on CPU, and a reader that goes through
        the shards in order keeps one mapped at a time (the loader; not the quantizer, whose source may be one
        file the size of the model, all of which would stay mapped)."""
        if self._open is None or self._open[0] != f:
            self._open = None  # the previous shard's mapping goes first
            self._open = (f, safe_open(f, framework="pt"))
        return self._open[1]

    def close(self) -> None:
        """Drop the file kept open by ``keep_open`` (its mapping goes with it)."""
        self._open = None


class ShardWriter:
    """Writes a checkpoint's tensors, in the order given, to numbered safetensors shards of at most ``max_bytes``
    (:data:`SHARD_BYTES` by default) each: a shard is flushed once the next tensor would not fit, so a streaming
    writer holds one shard in memory. :meth:`finish` gives the shards their final names (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` with the index transformers and vLLM read). The quantizer and export write
    through it."""

    def __init__(self, out_dir: Path, max_bytes: int | None = None) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes or SHARD_BYTES
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        index = len(self.shards)
        save_safetensors(self.pending, self.out_dir / f"shard-{index:05d}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Give shards their final names; write the index when there is more than one."""
        self.flush()
        count = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{i:05d}.tmp", self.out_dir / final)  # modes: atomic_directory's
            weight_map.update({n: final for n in names})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
