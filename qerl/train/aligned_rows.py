"""The training forward without a padding mask: each row's tokens moved to its start, the pad columns cut.

trl scores rows of ``[left-padded prompt | right-padded completion]`` and hands the model their padding mask. With
any zero in it, SDPA leaves FlashAttention (and drops ``enable_gqa``: K and V are copied once per query head by
``repeat_kv``), and every column, pads included, goes through every GEMM; the fixed-length benchmark never shows it
(its mask is all ones, which transformers drops).

A row's real tokens are one run (its prompt, then its completion up to the end of sequence). Shifting row ``i`` left
by its ``n_i`` leading pads leaves only trailing pads, and plain causal attention then gives every real token what
the mask gave it: it sees exactly the real tokens before it, none of the pads after. Columns past the longest row are
cut. Positions now start at 0 in every row, as in the rollout; trl's masked forward counted the pads, which RoPE
cannot tell apart (it sees only differences of positions), so the result is the same up to rounding. The decoder's
output is shifted back, so the LM head, trl's slicing of the completion logits and everything after are unchanged.

A mask that is not one run per row, explicit position ids, a cache or embeddings in place of ids leave the forward
as it was. :class:`AlignedRows` applies it to the trainer's log-prob passes (the loss and the old-policy and
reference passes) only, never to generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: Decoder keyword arguments under which a shift would change the result: the forward is left alone.
_UNSHIFTABLE = ("position_ids", "past_key_values", "inputs_embeds", "cache_position")


def shifts(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(leading pads per row, the longest row's length) of a 0/1 ``[rows, columns]`` mask that has a zero and whose
    ones are one run per row; None for any other mask (nothing to gain, or a shift would change the result)."""
    if mask.dim() != 2 or bool(mask.all()):
        return None
    real = mask.bool()
    lengths = real.sum(1)
    leading = real.int().argmax(1)  # the first 1 (0 for an empty row)
    columns = torch.arange(real.size(1), device=real.device)
    run = (columns >= leading[:, None]) & (columns < (leading + lengths)[:, None])
    if not torch.equal(run, real):
        return None
    return leading, max(int(lengths.max()), 1)


def shift_left(values: torch.Tensor, leading: torch.Tensor, width: int) -> torch.Tensor:
    """``values[i, j + leading[i]]`` for ``j < width`` (``[rows, columns, ...]``); past a row's end, its last column."""
    columns = torch.arange(width, device=values.device)
    index = (columns[None, :] + leading[:, None]).clamp(max=values.size(1) - 1)
    return values.gather(1, _expanded(index, values))


def shift_back(values: torch.Tensor, leading: torch.Tensor, columns: int) -> torch.Tensor:
    """The inverse of :func:`shift_left` on the real tokens, back to ``columns`` columns; a pad column holds some real
    column's value (finite: trl's completion mask zeroes what it adds to the loss)."""
    index = torch.arange(columns, device=values.device)[None, :] - leading[:, None]
    return values.gather(1, _expanded(index.clamp(0, values.size(1) - 1), values))


def _expanded(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return index.view(*index.shape, *([1] * (values.dim() - 2))).expand(*index.shape, *values.shape[2:])


@contextmanager
def aligned(decoder: nn.Module) -> Iterator[None]:
    """Within the block, each forward of ``decoder`` (a transformers base model: ids in, hidden states out) with a
    padding mask runs on its rows shifted left, unmasked, and returns its hidden states shifted back."""
    pending: list[tuple[torch.Tensor, int] | None] = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        plan = None
        if not args and ids is not None and mask is not None and all(kwargs.get(k) is None for k in _UNSHIFTABLE):
            plan = shifts(mask)
        pending.append(None if plan is None else (plan[0], ids.size(1)))
        if plan is not None:
            kwargs = {**kwargs, "input_ids": shift_left(ids, *plan), "attention_mask": None}
        return args, kwargs

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        plan = pending.pop()
        if plan is not None and hasattr(output, "last_hidden_state"):
            output.last_hidden_state = shift_back(output.last_hidden_state, *plan)
        return output

    handles = [
        decoder.register_forward_pre_hook(before, with_kwargs=True),
        decoder.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def decoder_of(model: nn.Module) -> nn.Module | None:
    """The transformers base model (the stack of decoder layers) inside a causal LM, peft-wrapped or not; None where
    there is none to find."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(base, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not base else None


class AlignedRows:
    """Mixin over trl's ``GRPOTrainer``: its log-prob passes run :func:`aligned` (the module docstring), and the
    memory plan of a pass (``qerl.train.recompute``) counts no mask where the shift removes it."""

    accelerator: Any
    #: False: trl's masked forward (the benchmarks' A/B: ``benchmarks.grpo_step --masked-pass``).
    align_rows: bool = True

    def pass_masked(self, inputs: dict[str, Any]) -> bool:
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return not bool(mask.all()) and (not self.align_rows or shifts(mask) is None)

    def _get_per_token_logps_and_entropies(self, model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        decoder = decoder_of(self.accelerator.unwrap_model(model)) if self.align_rows else None
        if decoder is None:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)  # type: ignore[misc]
        with aligned(decoder):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)  # type: ignore[misc]
