"""The compressed-tensors NVFP4A16 checkpoint: its config block, and reading its tensors safely.

Both the quantizer (which writes checkpoints) and the loader (which reads them) go through here,
so the format lives in one place.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

NVFP4_FORMAT = "nvfp4-pack-quantized"
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
#: Layers that vLLM fuses and that must therefore share one global scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantization_config(ignore: list[str], version: str | None = None) -> dict:
    """The ``quantization_config`` block that llm-compressor writes for scheme NVFP4A16."""
    if version is None:
        try:
            import compressed_tensors

            version = compressed_tensors.__version__
        except ImportError:
            version = "0.19.0"
    return {
        "config_groups": {
            "group_0": {
                "format": NVFP4_FORMAT,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 16,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn",
                    "strategy": "tensor_group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        },
        "format": NVFP4_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": version,
    }


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def is_nvfp4_config(config: dict) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors" and qc.get("format") == NVFP4_FORMAT


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (through the index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files; expected a safetensors checkpoint")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: listed in model.safetensors.index.json but missing")
    return files


class TensorIndex:
    """Name -> file map over a checkpoint's shards, reading one tensor at a time (memory-mapped)."""

    def __init__(self, model_dir: Path) -> None:
        self.files: dict[str, Path] = {}
        for f in shard_files(model_dir):
            try:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        self.files[name] = f
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
            with safe_open(f, framework="pt") as st:
                return st.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: could not read tensor {name!r} ({e}); is the file truncated?") from None
