"""Turn a Hugging Face checkpoint into an NVFP4A16 compressed-tensors checkpoint.

Two backends; for the default method they write byte-identical files:

* ``qerl`` streams tensor by tensor from the safetensors shards: peak RAM is about one tensor plus
  one output shard, whatever the model size (a 32B model quantizes on a 24 GB machine);
* ``llmcompressor`` runs llm-compressor's ``oneshot`` with ``QuantizationModifier(scheme="NVFP4A16")``
  where that package is installed (it loads the whole model).

Three methods, one format (``qerl.nvfp4``), which vLLM and ``qerl.load.loader`` read unchanged:

* ``rtn`` (default): round-to-nearest with min/max scales, no calibration data: exactly what the
  QeRL reference script does, deterministic and reproducible by vLLM users;
* ``mse``: the same, with each block's FP8 scale chosen by reconstruction error weighted by input
  moments estimated from the weights (``qerl.quantize.mse``, ``qerl.quantize.importance``), still
  data-free and streaming;
* ``gptq``: llm-compressor's GPTQ on calibration text (``qerl.quantize.calibration``); it needs the
  whole model and the ``quantize`` extra, and it closes most of rtn's quality gap
  (benchmarks/results/quality_cpu.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from qerl import arch, checkpoint, hub, model_files, nvfp4
from qerl.fsutil import atomic_directory, remove_leftovers, scratch_directory
from qerl.quantize import importance, mse, target
from qerl.quantize.calibration import Calibration
from qerl.quantize.source import SourceModel, check_finite
from qerl.runlock import run_lock

Backend = Literal["auto", "qerl", "llmcompressor"]
Method = Literal["rtn", "mse", "gptq"]
#: The backends that implement each method, the first one being what ``auto`` picks.
METHOD_BACKENDS: dict[str, tuple[str, ...]] = {
    "rtn": ("qerl", "llmcompressor"),
    "mse": ("qerl",),
    "gptq": ("llmcompressor",),
}


def default_output(model: str, root: str | os.PathLike[str] = "qmodel") -> Path:
    """``./qmodel/<name>-NVFP4A16``. The reference script wrote ``<name>-NVFP4A16-GPTQ``, although it ran
    round-to-nearest (no calibration data); ours names what it holds (a ``--method gptq`` run is still
    ``-NVFP4A16``: the method is recorded in the checkpoint's quantization config)."""
    name = Path(str(model).rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return Path(root) / f"{name}-NVFP4A16"


def _fused_siblings(name: str) -> tuple[str, ...]:
    parent, _, leaf = name.rpartition(".")
    for group in arch.FUSED_GROUPS:
        if leaf in group:
            return tuple(f"{parent}.{g}" for g in group)
    return (name,)


def global_scales(tensors: checkpoint.TensorIndex, names: list[str]) -> dict[str, torch.Tensor]:
    """Each Linear's global scale, the fused groups sharing their minimum (first streaming pass).

    The pass reads every tensor of the checkpoint, not only the weights to quantize, so that a NaN
    or Inf anywhere fails here, before any output is written.
    """
    wanted = {f"{n}.weight": n for n in names}
    own = {}
    for key in tqdm(tensors.names(), desc="check", leave=False):
        tensor = tensors.get(key)
        check_finite(key, tensor, tensors.files[key])
        if key in wanted:
            own[wanted[key]] = nvfp4.global_scale(tensor)
    shared = {}
    for name in names:
        siblings = [s for s in _fused_siblings(name) if s in own]
        shared[name] = nvfp4.min_global_scale([own[s] for s in siblings])
    return shared


@dataclass
class Source:
    """A checked source checkpoint and the Linear modules the run quantizes / keeps."""

    path: Path
    model: SourceModel
    tensors: checkpoint.TensorIndex
    names: list[str]
    ignored: list[str]

    @classmethod
    def open(cls, src: Path, ignore: tuple[str, ...], quantize_lm_head: bool) -> Source:
        """Refuse, with a one-line error, a source that is already NVFP4, that config.json does not
        describe, or whose ignore patterns do not resolve; all before anything is written."""
        model = SourceModel.from_dir(src)
        if checkpoint.is_nvfp4_config(model.config):
            raise ValueError(f"{src}: is already an NVFP4 checkpoint")
        names, ignored = model.linears(ignore, quantize_lm_head)
        tensors = checkpoint.TensorIndex(src)
        model.check_shapes(src, tensors)
        return cls(src, model, tensors, names, ignored)


def quantize_streaming(
    source: Source, out_dir: Path, method: Method = "rtn", max_shard_bytes: int | None = None
) -> None:
    """The qerl backend: two passes over the shards, one tensor in memory at a time.

    ``rtn`` rounds with min/max block scales (llm-compressor's bytes); ``mse`` searches each
    block's scale (:mod:`qerl.quantize.mse`), weighing input columns by their estimated activation
    moments (:mod:`qerl.quantize.importance`, one more pass over the weights, one tensor at a time).
    Both write the same format with the same global scales.
    """
    src, tensors, names = source.path, source.tensors, source.names
    scales = global_scales(tensors, names)
    moments = importance.input_moments(tensors, source.model.config, names) if method == "mse" else {}
    quantized = {f"{n}.weight": n for n in names}
    writer = checkpoint.ShardWriter(out_dir, max_shard_bytes)
    for name in tqdm(tensors.names(), desc="quantize", unit="tensor"):
        tensor = tensors.get(name)
        if name in quantized:
            layer = quantized[name]
            q = (
                mse.quantize(tensor, scales[layer], moments.get(layer))
                if method == "mse"
                else nvfp4.quantize(tensor, scales[layer])
            )
            for key, value in q.as_dict(f"{layer}.").items():
                writer.add(key, value)
        else:
            writer.add(name, tensor)
    writer.finish()
    config = dict(source.model.config)
    config["quantization_config"] = checkpoint.quantization_config(source.ignored)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model_files.copy_side_files(src, out_dir)


def quantize_llmcompressor(
    source: Source, out_dir: Path, method: Method = "rtn", calibration: Calibration | None = None
) -> None:
    """The llmcompressor backend: load the whole source and run llm-compressor's ``oneshot``.

    ``rtn`` is its data-free ``QuantizationModifier`` (scheme NVFP4A16); ``gptq`` its
    ``GPTQModifier`` with the same scheme: Hessians from the calibration activations, layer by
    layer, column-wise rounding with error feedback. GPTQ keeps llm-compressor's min/max block and
    global scales, so only the E2M1 codes differ from rtn and the tensors keep their format (the
    config differs only in ``actorder``). The modifier gets the resolved list of ignored module
    names, so ``--ignore`` means the same as for the streaming backend whatever form the user wrote.
    """
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError:
        raise RuntimeError(
            "--backend llmcompressor and --method gptq need llmcompressor: pip install 'qerl[quantize]'"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if method == "gptq":
        calibration = calibration or Calibration()
        data = calibration.dataset(AutoTokenizer.from_pretrained(source.path, trust_remote_code=False))
        kwargs = {"dataset": data, "num_calibration_samples": len(data), "max_seq_length": calibration.max_tokens}
    modifier = GPTQModifier if method == "gptq" else QuantizationModifier
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype="auto", trust_remote_code=False)
    for name, tensor in model.state_dict().items():
        check_finite(name, tensor, source.path)
    oneshot(model=model, recipe=modifier(targets="Linear", scheme="NVFP4A16", ignore=source.ignored), **kwargs)
    model.save_pretrained(out_dir, save_compressed=True)
    model_files.copy_side_files(source.path, out_dir)


def quantize_checkpoint(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    gguf_file: str | None = None,
    backend: Backend = "auto",
    method: Method = "rtn",
    calibration: Calibration | None = None,
    overwrite: bool = False,
    ignore: tuple[str, ...] = (),
    quantize_lm_head: bool = False,
    max_shard_bytes: int | None = None,
) -> Path:
    """Quantize ``model`` (dir, hub id, ``smollm2-135m``, or a dir + ``gguf_file``) into ``output``.

    ``method`` is ``rtn`` (round-to-nearest, min/max scales: llm-compressor's bytes), ``mse``
    (data-free block-scale search, streaming) or ``gptq`` (llm-compressor's GPTQ on
    ``calibration``, default the bundled GSM8K rows); all three write the same format.
    ``auto`` picks the first backend of :data:`METHOD_BACKENDS` (streaming for rtn and mse: bounded
    memory, no extra package). ``ignore`` lists Linear modules kept in bf16 in addition to
    ``lm_head`` (which is quantized only with ``quantize_lm_head``). The result appears atomically:
    everything is written to a temporary sibling directory that is renamed into place only when
    complete; an existing ``output`` is replaced only under the rules of
    :func:`qerl.quantize.target.check_target`.
    """
    backend = _resolve_backend(method, backend)
    if calibration is not None and method != "gptq":
        raise ValueError(f"--calibration-data / --calibration-samples apply to --method gptq, not {method}")
    out_dir = Path(output) if output is not None else default_output(gguf_file or str(model))
    gguf, model_dir = _source_paths(model, gguf_file)
    sources = [p for p in (model_dir, gguf) if p is not None]
    target.check_target(out_dir, sources, overwrite)  # before the lock, so that bad input creates no folder
    run: Callable[[Source, Path], None] = (
        partial(quantize_llmcompressor, method=method, calibration=calibration)
        if backend == "llmcompressor"
        else partial(quantize_streaming, method=method, max_shard_bytes=max_shard_bytes)
    )
    with run_lock(out_dir):
        target.check_target(out_dir, sources, overwrite)  # again: a run that finished meanwhile wrote it
        remove_leftovers(out_dir)  # of a killed run to the same output (the lock says none is running)
        with scratch_directory(out_dir, "src") as scratch:
            src = hub.convert_gguf(gguf, scratch / "bf16") if gguf is not None else model_dir
            source = Source.open(src, tuple(ignore), quantize_lm_head)
            with atomic_directory(out_dir) as tmp:
                run(source, tmp)
    return out_dir


def _resolve_backend(method: str, backend: str) -> str:
    """The backend that runs ``method``: ``auto`` -> the first that implements it; a backend that does
    not implement it is a one-line error."""
    if method not in METHOD_BACKENDS:
        raise ValueError(f"--method must be one of {', '.join(METHOD_BACKENDS)}, got {method!r}")
    if backend not in ("auto", "qerl", "llmcompressor"):
        raise ValueError(f"--backend must be auto, qerl or llmcompressor, got {backend!r}")
    allowed = METHOD_BACKENDS[method]
    if backend == "auto":
        return allowed[0]
    if backend not in allowed:
        raise ValueError(f"--method {method} runs on --backend {' or '.join(allowed)}, not {backend}")
    return backend


def _source_paths(model: str | os.PathLike[str], gguf_file: str | None) -> tuple[Path | None, Path | None]:
    """(GGUF file, model directory) of the source; a hub id is downloaded (safetensors files only)."""
    if gguf_file is not None:
        gguf = Path(gguf_file)
        if not gguf.is_absolute():
            gguf = Path(str(model)) / gguf_file
        if not gguf.exists():
            raise FileNotFoundError(f"--gguf-file {gguf} does not exist")
        return gguf, None
    return None, hub.local_model_dir(model, what="--model")
