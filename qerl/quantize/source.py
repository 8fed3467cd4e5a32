"""What the quantizer checks in a source checkpoint before (and while) it writes anything.

A source that would quantize "successfully" into a broken checkpoint is refused with a one-line
error naming the tensor: NaN/Inf weights (every logit of the result would be NaN) and a config.json
whose sizes disagree with the stored tensors (the result would only fail when loaded). The ignore
list is resolved here too, the same way for both backends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qerl import checkpoint, model_files, nvfp4

LM_HEAD = "lm_head"
#: Checked in slices of this many elements, so the boolean mask never costs a tensor's worth of RAM.
_FINITE_CHUNK = 1 << 24


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches one ``--ignore`` entry.

    ``re:REGEX`` matches with ``re.match`` on the full name (compressed-tensors' rule); a bare
    entry matches the full name or its last part (``lm_head``, ``down_proj``).
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.rsplit(".", 1)[-1] == pattern


def check_patterns(patterns: Sequence[str]) -> None:
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"--ignore {p!r}: not a valid regular expression ({e})") from None


@dataclass
class SourceModel:
    """The model that config.json describes, built on the meta device (no memory for weights)."""

    config: dict
    model: nn.Module

    @classmethod
    def from_dir(cls, src: Path) -> SourceModel:
        from transformers import AutoConfig, AutoModelForCausalLM

        # Before transformers builds anything: the directory, the config's fields and layer count against the headers
        # (100,000 claimed layers took 177 s and 5 GB of skeleton before); no code of the model's own (never trusted).
        config, _ = model_files.checked_config(src, copying=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(src, trust_remote_code=False), trust_remote_code=False
            )
        return cls(config, model)

    @property
    def tied_lm_head(self) -> bool:
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return head is not None and embed is not None and head.weight is embed.weight

    def linears(self, ignore: Sequence[str] = (), quantize_lm_head: bool = False) -> tuple[list[str], list[str]]:
        """Names of the Linear modules to quantize and of those kept in bf16.

        ``lm_head`` is kept unless ``quantize_lm_head``; ``ignore`` adds to it (bare names or
        ``re:`` patterns, see :func:`matches`). Every user pattern must match some Linear, so a
        typo is an error rather than a silently quantized layer.
        """
        check_patterns(ignore)
        patterns = list(ignore) if quantize_lm_head else [LM_HEAD, *ignore]
        names, ignored, used = [], [], set()
        for name, module in self.model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            hits = [p for p in patterns if matches(name, p)]
            used.update(hits)
            if hits:
                ignored.append(name)
                continue
            if name == LM_HEAD and self.tied_lm_head:
                raise ValueError(
                    "--quantize-lm-head: lm_head shares its weight with the input embeddings "
                    "(tie_word_embeddings); it cannot be quantized on its own"
                )
            nvfp4.check_quantizable((module.out_features, module.in_features), name)
            names.append(name)
        unused = [p for p in ignore if p not in used]
        if unused:
            raise ValueError(f"--ignore {unused[0]!r} matches no Linear module of the model")
        return names, ignored

    def check_shapes(self, src: Path, tensors: checkpoint.TensorIndex) -> None:
        """Every stored tensor must have the shape config.json implies; none may be missing or unknown.

        Reads only the safetensors headers. Unknown tensors are what a config with too few layers
        leaves over; those the model class itself declares ignorable on load
        (``_keys_to_ignore_on_load_unexpected``, e.g. multi-token-prediction layers) and old rotary
        ``inv_freq`` buffers are passed through unchanged, as transformers does.
        """
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        ignorable = [*(getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or []), r"rotary_emb\.inv_freq$"]
        for name in tensors.names():
            if name not in expected and not any(re.search(p, name) for p in ignorable):
                raise ValueError(
                    f"{tensors.files[name]}: tensor {name!r} is not part of the model config.json "
                    "describes (does config.json match the weights?)"
                )
        tied = {LM_HEAD + ".weight"} if self.tied_lm_head else set()
        for name, shape in expected.items():
            if name not in tensors:
                if name in tied:
                    continue
                raise ValueError(f"{src}: checkpoint is missing tensor {name!r} (config.json describes it)")
            f = tensors.files[name]
            with safe_open(f, framework="pt") as st:
                stored = tuple(st.get_slice(name).get_shape())
            if stored != shape:
                raise ValueError(f"{f}: tensor {name!r} has shape {stored} but config.json implies {shape}")


def check_finite(name: str, tensor: torch.Tensor, where: Path | str) -> None:
    """Raise a one-line error if a floating-point ``tensor`` holds NaN or Inf."""
    if not tensor.is_floating_point():
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        part = flat[start : start + _FINITE_CHUNK]
        if not torch.isfinite(part).all():
            nan = int(torch.isnan(flat).sum())
            inf = int(torch.isinf(flat).sum())
            raise ValueError(
                f"{where}: tensor {name!r} has {nan} NaN and {inf} Inf values; refusing to quantize a broken weight"
            )
