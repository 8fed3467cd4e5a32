"""A checkpoint's headers against its model: every tensor the ``config.json`` describes, with its shape and dtype.

A safetensors header is only a claim. Export (and anything else that copies tensors whole) compares every header
with the model's skeleton before reading a byte, so a damaged one declaring a 16 GiB tensor, or a tensor the model
has not, is refused in one line instead of copied.

Why in ``load`` while export is its one caller: it answers a question about reading a checkpoint (which tensors, of
which shapes and dtypes, a checkpoint of this model may hold) from the skeleton the loader builds for the model. The
loader needs no separate pass (it compares each tensor with the skeleton's as it fills it in: ``loader``, or
transformers for a dense model); export does, because it copies tensors without building the model, and
``benchmarks/integrity.py`` writes its load-test checkpoint from :func:`expected_tensors`. Export, a later stage,
imports it from here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl import checkpoint, nvfp4

#: safetensors' dtype names of the tensors a checkpoint may hold: the NVFP4 tensors' own, and the dense ones'.
_DENSE_DTYPES = frozenset({"BF16", "F16", "F32"})
_QUANTIZED_DTYPES = {checkpoint.PACKED: "U8", checkpoint.SCALE: "F8_E4M3", checkpoint.GLOBAL_SCALE: "F32"}


def expected_tensors(
    model_dir: Path, packed: set[str]
) -> tuple[dict[str, tuple[tuple[int, ...], frozenset[str]]], set[str]]:
    """(name -> (shape, allowed safetensors dtypes) of every tensor the model ``config.json`` describes may
    hold, the names a checkpoint may leave out as tied to another), the Linears of ``packed`` as NVFP4 (codes,
    block scales, global scale), from a skeleton built on the meta device (no memory). A header is only a
    claim: compared with this, a damaged one is refused before its tensor is read, let alone copied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # plain Linears: their dense shapes give the packed ones
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    expected = {}
    for name, tensor in skeleton.state_dict().items():
        layer = name.removesuffix(".weight")
        if layer in packed and tensor.ndim == 2:
            out, k = tensor.shape
            shapes = {
                checkpoint.PACKED: (out, k // 2),
                checkpoint.SCALE: (out, k // nvfp4.GROUP_SIZE),
                checkpoint.GLOBAL_SCALE: (1,),
            }
            for suffix, shape in shapes.items():
                expected[f"{layer}.{suffix}"] = (shape, frozenset({_QUANTIZED_DTYPES[suffix]}))
        else:
            expected[name] = (tuple(tensor.shape), _DENSE_DTYPES)
    return expected, set(getattr(skeleton, "all_tied_weights_keys", {}) or {})


def check_headers(model_dir: Path, tensors: checkpoint.TensorIndex) -> None:
    """Raise a one-line ``ValueError`` unless every tensor ``tensors`` holds is one the model has, with the shape
    and dtype :func:`expected_tensors` gives it, and none is missing but a tied head's. Headers only: nothing
    is read, so a header declaring a 16 GiB tensor costs nothing."""
    expected, tied = expected_tensors(model_dir, checkpoint.packed_layers(tensors.names()))
    for name, (shape, dtype) in tensors.headers.items():
        if name not in expected:
            raise ValueError(
                f"{tensors.files[name]}: holds tensor {name!r}, which the model {model_dir / 'config.json'} "
                "describes does not have; the checkpoint is damaged or of another model"
            )
        want, dtypes = expected[name]
        if shape != want or dtype not in dtypes:
            raise ValueError(
                f"{tensors.files[name]}: tensor {name!r} is declared {dtype} {list(shape)}, the model's is "
                f"{'/'.join(sorted(dtypes))} {list(want)}; the checkpoint is damaged"
            )
    missing = [n for n in expected if n not in tensors.headers and n not in tied]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing tensor {missing[0]!r} ({len(missing)} in all)")
