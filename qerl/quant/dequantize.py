"""An NVFP4 checkpoint turned back into a dense one: the same weights, in bf16.

This isolates what 4-bit weights cost a run from what the NVFP4 kernels and packed training path
do: a dense run on the dequantized copy sees exactly the quantized values (up to bf16 rounding of
``code * scale / g``) through the ordinary dense code path (``benchmarks/learning.py``'s
"dequantized" arm).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from qerl import checkpoint, nvfp4
from qerl.fsutil import atomic_directory
from qerl.quantize import _copy_side_files, _ShardWriter


def dequantize_checkpoint(src: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a dense ``dtype`` checkpoint of NVFP4 checkpoint ``src`` to ``out_dir`` (atomically),
    streaming one layer at a time; every other tensor is copied unchanged."""
    config = checkpoint.read_config(src)
    if not checkpoint.is_nvfp4_config(config):
        raise ValueError(f"{src}: not an NVFP4 checkpoint (no compressed-tensors nvfp4 quantization_config)")
    tensors = checkpoint.TensorIndex(src)
    suffix = ".weight_packed"
    layers = {n[: -len(suffix)] for n in tensors.names() if n.endswith(suffix)}
    parts = {f"{layer}.{s}" for layer in layers for s in checkpoint.QUANTIZED_SUFFIXES}
    del config["quantization_config"]
    with atomic_directory(out_dir) as tmp:
        writer = _ShardWriter(tmp)
        for name in tqdm(tensors.names(), desc="dequantize", unit="tensor"):
            if name.endswith(suffix):
                layer = name[: -len(suffix)]
                q = [tensors.get(f"{layer}.{s}") for s in checkpoint.QUANTIZED_SUFFIXES]
                writer.add(f"{layer}.weight", nvfp4.dequantize(*q, dtype=dtype))
            elif name not in parts:
                writer.add(name, tensors.get(name))
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _copy_side_files(src, tmp)
    return out_dir
