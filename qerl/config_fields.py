"""config.json's fields, checked before anything is built from them, each failure one line naming the file and the
field: transformers turned ``hidden_size: "64"`` into a traceback, ``num_attention_heads: 0`` into a division by
zero and an unknown ``rope_type`` into a KeyError, and took ``intermediate_size: 1000000`` on 128-wide weights for a
request to allocate gigabytes before comparing a single shape.

:func:`check_fields` holds the sizes to positive integers under a bound no real model comes near (:data:`SIZES`),
the heads to divide what they split, the floats to finite positive numbers and the RoPE type and activation to the
ones transformers knows; it ends by letting transformers build the config object itself (no weights), so a rule of
its own that we do not repeat is one line too. :func:`check_shapes` compares the sizes with the tensors the
safetensors headers declare (no data read), so a config that describes other weights is named by its field before
any skeleton is built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from qerl import checkpoint

#: field -> the largest value taken. The largest real models: hidden 16384 (Llama-3.1-405B), intermediate 53248,
#: 128 heads, 126 layers, vocab 262144 (Gemma 3), 10M positions (Llama 4 Scout).
SIZES = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "num_hidden_layers": 1 << 10,
    "vocab_size": 1 << 21,
    "head_dim": 1 << 11,
    "max_position_embeddings": 1 << 24,
}
#: Fields transformers defaults when absent or null.
_OPTIONAL = frozenset({"num_key_value_heads", "head_dim", "max_position_embeddings"})
#: Finite positive floats, when present.
_POSITIVE = ("rms_norm_eps", "rope_theta")


def check_fields(config: Mapping[str, Any], where: str) -> None:
    """Raise a one-line ``ValueError`` naming ``where`` (the config.json) and the field unless the fields described
    in the module docstring hold; ``config`` is config.json's dict, its ``model_type`` already a supported one."""
    for field, bound in SIZES.items():
        value = config.get(field)
        if value is None and field in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{where}: {field} is {value!r}; expected an integer from 1 to {bound}")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv = config.get("num_key_value_heads") or heads
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{where}: num_attention_heads is {heads}, which does not divide hidden_size {hidden}")
    if heads % kv:
        raise ValueError(f"{where}: num_key_value_heads is {kv}, which does not divide num_attention_heads {heads}")
    for field in _POSITIVE:
        _check_positive(config, field, where)
    _check_rope(config, where)
    _check_activation(config, where)
    _transformers_config(config, where)


def _check_positive(block: Mapping[str, Any], field: str, where: str) -> None:
    value = block.get(field)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
    ):
        raise ValueError(f"{where}: {field} is {value!r}; expected a finite positive number")


def _check_rope(config: Mapping[str, Any], where: str) -> None:
    """``rope_parameters`` (transformers 5) and ``rope_scaling`` (older configs): objects, or null, whose
    ``rope_type`` (``type`` in old ones) transformers has an init function for; per-layer-type blocks each."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", *ROPE_INIT_FUNCTIONS}
    for key in ("rope_parameters", "rope_scaling"):
        block = config.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"{where}: {key} is {block!r}; expected an object or null")
        nested = bool(block) and all(isinstance(v, dict) for v in block.values())
        for part in block.values() if nested else [block]:
            rope_type = part.get("rope_type", part.get("type", "default"))
            if rope_type not in known:
                raise ValueError(
                    f"{where}: {key}.rope_type is {rope_type!r}; expected one of {', '.join(sorted(known))}"
                )
            _check_positive(part, "rope_theta", where)
            _check_positive(part, "factor", where)


def _check_activation(config: Mapping[str, Any], where: str) -> None:
    from transformers.activations import ACT2FN

    act = config.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACT2FN:
        raise ValueError(f"{where}: hidden_act is {act!r}; expected an activation transformers knows (silu)")


def _transformers_config(config: Mapping[str, Any], where: str) -> None:
    """transformers' own config class over ``config`` (validation only, no weights); its refusal is one line."""
    from transformers import CONFIG_MAPPING

    try:
        CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
    except Exception as e:  # huggingface_hub's strict-dataclass errors, ValueError, TypeError, ...
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ValueError(f"{where}: transformers refuses it ({lines[-1] if lines else type(e).__name__})") from None


#: A tensor whose shape the sizes decide: (name pattern, (rows, columns)), each a (size, field to blame) pair
#: computed by :func:`_dims`; a packed NVFP4 weight holds two codes per byte, so its columns are halved.
_SHAPED = {
    "embed_tokens": re.compile(r"(?:^|\.)embed_tokens\.weight$"),
    "lm_head": re.compile(r"^lm_head\.weight$"),
    "proj": re.compile(
        r"(?:^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|weight_packed)$"
    ),
}


def _dims(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, str], tuple[int, str]]]:
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    h, q, k, i = (
        (hidden, "hidden_size"),
        (heads * head_dim, "num_attention_heads x head_dim"),
        (kv * head_dim, "num_key_value_heads x head_dim"),
        (inter, "intermediate_size"),
    )
    vocab = (config["vocab_size"], "vocab_size")
    dims = {"embed_tokens": (vocab, h), "lm_head": (vocab, h)}
    dims |= {f"self_attn.{p}_proj": d for p, d in (("q", (q, h)), ("k", (k, h)), ("v", (k, h)), ("o", (h, q)))}
    dims |= {f"mlp.{p}_proj": d for p, d in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
    return dims


def check_shapes(config: Mapping[str, Any], tensors: checkpoint.TensorIndex, where: str) -> None:
    """Raise a one-line ``ValueError`` naming ``where`` and the field when a tensor the sizes decide (embeddings,
    head, every decoder projection) is declared with another shape in the safetensors headers."""
    dims = _dims(config)
    for name, (shape, _) in tensors.headers.items():
        found = next(((kind, m) for kind, pattern in _SHAPED.items() if (m := pattern.search(name))), None)
        if found is None:
            continue
        kind, match = found
        (rows, row_field), (cols, col_field) = dims[match.group(1) if kind == "proj" else kind]
        if kind == "proj" and match.group(2) == checkpoint.PACKED:
            cols //= 2
        if len(shape) != 2:
            raise ValueError(f"{tensors.files[name]}: tensor {name!r} is declared {list(shape)}; expected a matrix")
        for size, field, stored, axis in ((rows, row_field, shape[0], "rows"), (cols, col_field, shape[1], "columns")):
            if stored != size:
                raise ValueError(
                    f"{where}: {field} gives {name!r} {size} {axis}, but {tensors.files[name].name} declares it "
                    f"{list(shape)}; the config does not describe these weights"
                )
