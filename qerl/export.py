"""``python -m qerl.export``: fold a trained LoRA adapter (and its trained norms) into a normal checkpoint.

    python -m qerl.export --model qmodel/Qwen2.5-7B-Instruct-NVFP4A16 --lora runs/7b/adapter --output export/7b
    python -m qerl.export --model NVFP4_DIR --lora ADAPTER --output DIR --format nvfp4 [--method rtn|mse]

Training never merges the adapter (a bf16 delta cannot be folded into 4-bit codes in place), so a
trained policy is the pair (NVFP4 checkpoint, peft adapter). A server wants one checkpoint. Here
every Linear is dequantized to fp32, ``scaling * B @ A`` is added in fp32, and the sum is rounded to
bf16 once; the adapter's ``modules_to_save`` tensors (the RMSNorms trained with ``--ln``) replace the
checkpoint's. ``--format bf16`` (the default) writes that dense checkpoint; ``--format nvfp4``
re-quantizes it with qerl's streaming quantizer (``--method`` as the quantize CLI) into an NVFP4A16
checkpoint that vLLM serves like any other.

Re-quantizing is lossy in a way that matters for RL adapters: a LoRA update smaller than half an FP4
step rounds back to the base code. The export therefore measures, over all merged layers, the share
of the LoRA delta the new codes keep (``<Q(W + d) - Q(W), d> / |d|^2``: 1 kept, 0 lost) and records it
in ``qerl_export.json``; below one half it warns and suggests ``--format bf16``.

Every tensor's declared shape and dtype are checked against the model its config.json describes before
anything is written (``qerl.load.headers``: a damaged header declaring a 16 GiB tensor, or one the model has
not, is refused, not copied). Tensors stream one at a time (peak memory: one output shard plus a few fp32
copies of the largest Linear), each checked as it is read (``qerl.load.integrity``: a NaN block scale stops
the export in one line instead of writing NaN weights), the output appears atomically (temp dir, then rename)
under its run lock (``qerl.runlock``), what a killed export left beside it (the partial output, ``--format
nvfp4``'s dense copy of the whole model) is removed by the next export to it
(``qerl.fsutil.remove_leftovers``), and an existing output is replaced only with ``--overwrite`` and only if
this tool wrote it (its ``qerl_export.json`` marker). An adapter that records the digest of the model it was
trained on (``qerl_base.json``, written by ``qerl.train.run``) is refused on another model unless
``--allow-base-mismatch``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from qerl import checkpoint, hub, model_files, nvfp4
from qerl.cli import ArgumentParser, UsageError, run, shard_gb
from qerl.fingerprint import check_adapter_base
from qerl.fsutil import atomic_directory, is_within, refuse_link, remove_leftovers, scratch_directory, write_text
from qerl.load.adapter import CONFIG_FILE, check_patterns, read_adapter_config
from qerl.load.headers import check_headers
from qerl.load.integrity import check_tensor, check_tensors
from qerl.quantize import pipeline
from qerl.runlock import run_lock

if TYPE_CHECKING:
    from peft import LoraConfig

logger = logging.getLogger("qerl.export")

FORMATS = ("bf16", "nvfp4")
#: Re-quantization methods qerl's quantizer offers (``--method`` of the quantize CLI).
#: The quantize CLI's data-free methods (streamed like the export itself); gptq needs calibration data.
QUANT_METHODS = ("rtn", "mse")
#: Written into every export; an existing output without it is never replaced.
MARKER = "qerl_export.json"
_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
#: Below this share of the LoRA delta kept by re-quantization, the NVFP4 export warns.
RETAINED_WARNING = 0.5


@dataclass
class Adapter:
    """A peft LoRA adapter read from disk: per target layer (A, B, scaling) and the dense overrides."""

    path: Path
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)

    def delta(self, layer: str) -> torch.Tensor:
        """``scaling * B @ A`` in fp32."""
        a, b, scaling = self.deltas[layer]
        return (b.float() @ a.float()) * scaling


def read_adapter(path: Path) -> Adapter:
    """Read ``adapter_config.json`` and ``adapter_model.safetensors``; refuse what a merge cannot express."""
    from peft.utils.other import get_pattern_key

    config, weights = _lora_config(path)
    try:
        with safe_open(weights, framework="pt") as st:
            state = {k: st.get_tensor(k) for k in st.keys()}
    except Exception as e:
        raise ValueError(f"{weights}: unreadable safetensors file ({e})") from None
    check_tensors(state, weights)
    adapter = Adapter(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name = key.removeprefix(_PEFT_PREFIX)
        suffix = next((s for s in _LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            pairs.setdefault(name[: -len(suffix)], {})[suffix[1:7]] = value
        elif name.endswith(".weight") and any(
            name[: -len(".weight")].split(".")[-1] == m for m in config.modules_to_save or ()
        ):
            adapter.overrides[name] = value
        else:
            raise ValueError(f"{weights}: tensor {key!r} is neither a LoRA A/B weight nor a modules_to_save weight")
    for layer, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{weights}: layer {layer!r} has {sorted(ab)} but needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{weights}: layer {layer!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; ranks differ"
            )
        # The scaling peft gives this layer (LoraModel._create_and_replace, LoraLayer.update_layer).
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), layer), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), layer), config.lora_alpha)
        if r != a.shape[0]:
            raise ValueError(f"{weights}: layer {layer!r} has rank {a.shape[0]} but adapter_config.json says {r}")
        adapter.deltas[layer] = (a, b, alpha / math.sqrt(r) if config.use_rslora else alpha / r)
    if not adapter.deltas and not adapter.overrides:
        raise ValueError(f"{weights}: holds no LoRA or modules_to_save tensors")
    # Not needed for the merge (it goes by tensor names), but what evaluation refuses export refuses too.
    check_patterns(
        config, [*adapter.deltas, *(n.removesuffix(".weight") for n in adapter.overrides)], str(path / CONFIG_FILE)
    )
    return adapter


def _lora_config(path: Path) -> tuple[LoraConfig, Path]:
    """The adapter directory's peft ``LoraConfig`` (checked: ``qerl.load.adapter``) and weights file, refused in
    one line unless a plain LoRA."""
    from peft import LoraConfig  # peft is slow to import: only when an export runs

    config, weights = read_adapter_config(path)
    if not isinstance(config, LoraConfig):
        raise ValueError(f"--lora {path}/adapter_config.json: not a LoRA config (a {type(config).__name__})")
    refused = [
        name
        for name, on in (
            ("use_dora", config.use_dora),
            ("lora_bias", config.lora_bias),
            ("fan_in_fan_out", config.fan_in_fan_out),
            ("bias", config.bias != "none"),
        )
        if on
    ]
    if refused:
        raise ValueError(f"--lora {path}: {refused[0]} is set; only plain LoRA (bias none) can be merged here")
    return config, weights


@dataclass
class MergeStats:
    """Sums over the merged layers, for the record and the re-quantization check."""

    layers: int = 0
    overrides: int = 0
    delta_sq: float = 0.0
    weight_sq: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "merged_layers": self.layers,
            "replaced_tensors": self.overrides,
            "delta_rel_fro": math.sqrt(self.delta_sq / max(self.weight_sq, 1e-30)),
        }


def merge_to_dense(model_dir: Path, adapter: Adapter, out_dir: Path, max_shard_bytes: int | None = None) -> MergeStats:
    """Write ``model_dir`` with ``adapter`` folded in as a dense bf16 safetensors checkpoint into ``out_dir``."""
    config = checkpoint.read_config(model_dir)
    checkpoint.check_layer_count(model_dir, config)
    tensors = checkpoint.TensorIndex(model_dir, check=check_tensor)
    check_headers(model_dir, tensors)
    packed = checkpoint.packed_layers(tensors.names())
    for layer in adapter.deltas:
        if layer not in packed and f"{layer}.weight" not in tensors:
            raise ValueError(
                f"--lora {adapter.path}: targets {layer!r}, which {model_dir} does not have; wrong base model?"
            )
    for name in adapter.overrides:
        if name not in tensors and name.removesuffix(".weight") not in packed:
            raise ValueError(
                f"--lora {adapter.path}: replaces {name!r}, which {model_dir} does not have; wrong base model?"
            )
    stats = MergeStats()
    writer = checkpoint.ShardWriter(out_dir, max_shard_bytes)
    for name in tensors.names():
        layer, _, suffix = name.rpartition(".")
        if layer in packed:
            if suffix != checkpoint.PACKED:
                continue  # the scales are read with their packed weight
            base = _dequantized(tensors, layer)
            name, dtype = f"{layer}.weight", torch.bfloat16
        else:
            base = tensors.get(name)
            dtype = base.dtype  # a dense base keeps its own dtype
        if name in adapter.overrides:
            base = _checked(adapter.overrides[name], base, name, adapter.path)
            stats.overrides += 1
        if name == f"{layer}.weight" and layer in adapter.deltas:
            delta = _checked(adapter.delta(layer), base, f"{layer} (B @ A)", adapter.path)
            base = base.float() + delta
            stats.layers += 1
            stats.delta_sq += float(delta.square().sum())
            stats.weight_sq += float(base.square().sum())
        writer.add(name, base.to(dtype))
    writer.finish()
    if config.pop("quantization_config", None) is not None:  # the dequantized Linears are bf16 now
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = "bfloat16"
    write_text(out_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    model_files.copy_side_files(model_dir, out_dir)
    return stats


def _checked(value: torch.Tensor, target: torch.Tensor, name: str, adapter: Path) -> torch.Tensor:
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"--lora {adapter}: {name} has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
        )
    return value


def requantize(dense_dir: Path, out_dir: Path, ignore: tuple[str, ...], method: str) -> None:
    """The dense merge -> NVFP4A16 through qerl's streaming quantizer (the quantize CLI's backend).

    ``method`` is the quantize CLI's ``--method``, one of its data-free ones (``QUANT_METHODS``)."""
    if method not in QUANT_METHODS:
        raise ValueError(f"--method: expected one of {QUANT_METHODS}, got {method!r}")
    pipeline.quantize_streaming(pipeline.Source.open(dense_dir, ignore, quantize_lm_head=False), out_dir, method)


def retained_share(model_dir: Path, dense_dir: Path, out_dir: Path, layers: list[str]) -> float | None:
    """Share of the LoRA delta that the re-quantized weights keep, over all merged quantized layers:
    ``<Q(W') - W_hat, W' - W_hat> / |W' - W_hat|^2`` with W_hat the original NVFP4 weight, W' the bf16
    merge and Q(W') its re-quantization. None when no quantized layer was merged."""
    original, dense, requantized = (checkpoint.TensorIndex(d) for d in (model_dir, dense_dir, out_dir))
    dot = norm = 0.0
    for layer in layers:
        if f"{layer}.{checkpoint.PACKED}" not in original or f"{layer}.{checkpoint.PACKED}" not in requantized:
            continue
        w_hat = _dequantized(original, layer)
        delta = dense.get(f"{layer}.weight").float() - w_hat
        dot += float(((_dequantized(requantized, layer) - w_hat) * delta).sum())
        norm += float(delta.square().sum())
    return None if norm == 0 else dot / norm


def _dequantized(tensors: checkpoint.TensorIndex, layer: str) -> torch.Tensor:
    return nvfp4.dequantize(*(tensors.get(f"{layer}.{s}") for s in checkpoint.QUANTIZED_SUFFIXES), torch.float32)


def check_output(out: Path, overwrite: bool, model_dir: Path, adapter_dir: Path) -> None:
    """Refuse an output that is a symbolic link, is or lies inside the model or adapter directory (its files would
    change their digest: the run's own adapter then counted as made for other weights), or exists and was not
    written by this tool, or exists without ``--overwrite``; all before any work."""
    refuse_link(out, "--output")
    for what, path in (("model", model_dir), ("adapter", adapter_dir)):
        if is_within(out, path):
            where = "the" if out.resolve() == path.resolve() else "inside the"
            raise ValueError(f"--output {out}: is {where} {what} directory ({path}); choose a directory outside it")
    if not out.exists():
        return
    if not (out / MARKER).is_file():
        raise FileExistsError(
            f"--output {out}: exists and was not written by qerl.export (no {MARKER}); refusing to replace it"
        )
    if not overwrite:
        raise FileExistsError(f"--output {out}: exists (an earlier export); pass --overwrite to replace it")


def export(
    model: str | Path,
    lora: str | Path,
    output: str | Path,
    *,
    fmt: str = "bf16",
    method: str = "rtn",
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
    allow_base_mismatch: bool = False,
) -> dict:
    """Merge ``lora`` into ``model`` and write ``output`` (format ``bf16`` or ``nvfp4``); returns the
    record also written to ``output/qerl_export.json``. ``allow_base_mismatch`` merges an adapter whose
    ``qerl_base.json`` names other weights than ``model``'s (shapes are still checked)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: expected one of {FORMATS}, got {fmt!r}")
    if fmt == "nvfp4" and method not in QUANT_METHODS:
        raise ValueError(f"--method: expected one of {QUANT_METHODS}, got {method!r}")
    model_dir = hub.local_model_dir(model, what="--model")
    source_config, _ = model_files.checked_config(model_dir, copying=True)  # no code, no links out, sound fields
    adapter_dir, out = Path(lora), Path(output)
    adapter = read_adapter(adapter_dir)
    same_base = check_adapter_base(adapter_dir, str(model), allow_base_mismatch)
    record: dict = {
        "tool": "qerl.export",
        "model": str(model),
        "lora": str(adapter_dir),
        "format": fmt,
        "quantized_source": checkpoint.is_nvfp4_config(source_config),
        "base_verified": same_base,
    }
    check_output(out, overwrite, model_dir, adapter_dir)  # before the lock, so that bad input creates no folder
    with run_lock(out):  # and under it: a run that finished meanwhile is an existing output
        check_output(out, overwrite, model_dir, adapter_dir)
        remove_leftovers(out)  # of a killed export to the same output (the lock says none is running)
        _write(model_dir, adapter, out, record, fmt, method, source_config, max_shard_bytes)
    kept = record.get("lora_delta_retained")
    if kept is not None and kept < RETAINED_WARNING:
        logger.warning(
            "re-quantization kept only %.0f%% of the LoRA update (smaller than the FP4 steps); "
            "--format bf16 keeps all of it",
            100 * kept,
        )
    return record


def _write(
    model_dir: Path,
    adapter: Adapter,
    out: Path,
    record: dict,
    fmt: str,
    method: str,
    source_config: dict,
    max_shard_bytes: int | None,
) -> None:
    """The merge into ``out`` (atomically), its statistics added to ``record``, which is written last."""
    with atomic_directory(out) as tmp:
        if fmt == "bf16":
            stats = merge_to_dense(model_dir, adapter, tmp, max_shard_bytes)
        else:
            # the source's kept modules; a dense source has none beyond lm_head, which the quantizer keeps anyway
            ignore = tuple((source_config.get("quantization_config") or {}).get("ignore") or ())
            with scratch_directory(out, "bf16") as dense:
                stats = merge_to_dense(model_dir, adapter, dense, max_shard_bytes)
                requantize(dense, tmp, ignore, method)
                record["method"] = method
                record["lora_delta_retained"] = retained_share(model_dir, dense, tmp, list(adapter.deltas))
        record.update(stats.as_dict())
        write_text(tmp / MARKER, json.dumps(record, indent=1) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags; a mistake is one ``error:`` line (``qerl.cli``), as in every qerl command."""
    p = ArgumentParser(prog="python -m qerl.export", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="the checkpoint the adapter was trained on (NVFP4 or dense dir, hub id)"
    )
    p.add_argument("--lora", required=True, help="peft adapter directory (e.g. RUN/adapter or RUN/checkpoint-N)")
    p.add_argument("--output", required=True, help="output directory (written atomically)")
    p.add_argument("--format", default="bf16", choices=FORMATS, help="bf16: dense merge; nvfp4: re-quantized merge")
    p.add_argument("--method", default="rtn", choices=QUANT_METHODS, help="re-quantization method (--format nvfp4)")
    p.add_argument("--max-shard-gb", type=shard_gb, default=4.0, help="output shard size (GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --output")
    p.add_argument(
        "--allow-base-mismatch",
        action="store_true",
        help="merge --lora even if it records another base model's digest (shapes are still checked)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: 0, or 2 with ``error: <one line>`` for bad input or a full / read-only disk (``qerl.cli``)."""
    return run(command, argv)


def command(argv: Sequence[str] | None) -> None:
    """The command itself: bad input raises ``UsageError`` (a full or read-only disk its ``OSError``), which
    :func:`main` turns into its one line and exit status (``qerl.cli.run``)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        record = export(
            args.model,
            args.lora,
            args.output,
            fmt=args.format,
            method=args.method,
            overwrite=args.overwrite,
            max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
            allow_base_mismatch=args.allow_base_mismatch,
        )
    except (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError, KeyError) as e:
        raise UsageError(str(e) or type(e).__name__) from e
    print(f"wrote {args.output}: {json.dumps(record)}")


if __name__ == "__main__":
    sys.exit(main())
