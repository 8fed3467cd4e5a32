"""Recompute only what memory requires: what ``--gradient_checkpointing`` left unset (auto) does.

trl switches gradient checkpointing on for every run: each decoder layer's forward runs twice, once in the forward
and again inside the backward, for memory the card may well have free (docs/performance.md, "Training pass").
``QeRLConfig`` leaves the flag unset on CUDA (without CUDA it stays on, as before); ``AutoRecompute`` then decides
before each training pass (one micro-batch's forward + backward) how it runs, weighing :func:`no_recompute_bytes` for
its padded length against the card's free memory:

* no recompute, the micro-batch in one piece, while the whole pass fits;
* no recompute, the micro-batch in row chunks (``qerl.train.chunked_pass``: each chunk's forward + backward in turn,
  the loss and metrics still the whole micro-batch's), when one chunk fits and the whole does not: the fewest chunks
  whose largest fits (:func:`chunk_rows`);
* full recompute when not even one row fits, or the pass cannot be chunked (``--pass_chunk_rows 0``, a loss whose
  chunks qerl cannot normalise: ``chunked_pass.refusal``).

One way within a run: a chunk never grows back and full recompute stays, so a run does not alternate and logs each
change in one line. ``True`` / ``False`` are trl's, as before, in one piece unless ``--pass_chunk_rows`` asks chunks.

Before a pass, whatever the checkpointing, ``AutoRecompute.free_rollout_memory`` may free the native rollout engine's
KV cache and captured decode graphs (``--release_rollout_memory``): unset, only where the smallest pass the trainer
could run (:func:`recompute_terms`' full recompute, or one row without it) would not fit beside them. At long
completions that cache is the largest thing on the card after the weights; the next rollout allocates it again and
captures its graphs anew, seconds a step, which is why auto does it only where the pass would not fit otherwise.

None of it changes the numbers beyond the order of sums: the recompute replays the same ops on the same inputs, so
the loss and every gradient are bitwise the same (``tests/test_recompute.py``); chunks change only how the
micro-batch's sums are split (``tests/test_chunked_pass.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Hidden-sized bf16 tensors per token that a training pass holds beyond the decoder layers' saved activations: the
#: chunked LM head and the activation gradients of the backward. Fitted on the H200 (benchmarks/grpo_floors.py tells
#: how); the same in both modes, since neither the head nor the gradients are recomputed.
HEAD_ACTIVATIONS = 36
#: Share of the card's memory left free under the estimate (allocator fragmentation, cuBLAS workspaces, and what the
#: estimate does not count).
HEADROOM = 0.05
#: The model config fields the estimate reads (``head_dim`` where the family sets it).
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def saved_activation_bytes(
    shape: Mapping[str, int],
    rows: int,
    tokens: int,
    lora_r: int,
    *,
    trained_norms: bool = True,
    masked: bool = False,
    fused: bool = False,
) -> int:
    """Bytes that autograd holds for the backward of every decoder layer (Llama / Qwen2 layout, LoRA on the seven
    projections, bf16 activations under autocast) when nothing is recomputed, at ``rows`` x ``tokens``.

    Per layer and token, what each op saves (h hidden, i intermediate, q = heads x head_dim, k = KV heads x head_dim):

    * each RMSNorm (2): its fp32 input (4h: ``pow`` and the normalising ``mul``) and ``rsqrt`` per row (4); with
      trained norms also the bf16 normalised input (2h, for the weight's gradient);
    * the shrink GEMMs' inputs, one each however many projections read it: the attention input (2h, q/k/v), the MLP
      input (2h, gate/up), the down input (2i); the o_proj input is SDPA's output (below);
    * attention: RoPE'd q (2q), k and v (2k each; 2q each when ``masked``: transformers then repeats them to every
      head), SDPA's output (2q) and its fp32 log-sum-exp per head (4 x heads); with a mask, also SDPA's additive
      bf16 mask, tokens x 2 bytes per token and layer;
    * MLP: the gate output (``silu``), ``silu(gate)`` and the up output (``mul``): 3 x 2i;
    * LoRA: each of the seven shrinks' outputs (2r), saved by its expand.

    With ``fused`` layers (``qerl.train.fused_layers``) a norm keeps its bf16 input and the row's scale (2h + 4) and
    the MLP only the gate and up outputs (2 x 2i).

    Not counted: the frozen weights (NVFP4's packed ones, bf16 ones) that the GEMMs' backward reads where they are,
    and what is shared by all layers (RoPE tables, the mask built once per forward).
    """
    h, i, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or h // heads
    q, k = heads * head_dim, shape["num_key_value_heads"] * head_dim
    kv = q if masked else k
    norm = 2 * h + 4 if fused else 4 * h + 4 + (2 * h if trained_norms else 0)
    attention = 2 * q + 2 * 2 * kv + 2 * q + 4 * heads + (2 * tokens if masked else 0)
    mlp = (2 if fused else 3) * 2 * i
    per_token = 2 * norm + 2 * h + 2 * h + 2 * i + attention + mlp + 7 * 2 * lora_r
    return shape["num_hidden_layers"] * rows * tokens * per_token


def no_recompute_bytes(
    shape: Mapping[str, int],
    rows: int,
    tokens: int,
    lora_r: int,
    *,
    nvfp4: bool,
    trained_norms: bool = True,
    masked: bool = False,
    fused: bool = False,
) -> int:
    """What a training pass without recompute adds, at its peak, to the memory it starts with: every layer's saved
    activations (:func:`saved_activation_bytes`), ``HEAD_ACTIVATIONS`` hidden-sized bf16 tensors per token, and for
    NVFP4 two bf16 copies of the largest weight (dequantized for the GEMMs of the forward and of the backward)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    saved = saved_activation_bytes(shape, rows, tokens, lora_r, trained_norms=trained_norms, masked=masked, fused=fused)
    return saved + HEAD_ACTIVATIONS * rows * tokens * h * 2 + (2 * h * i * 2 if nvfp4 else 0)


def recompute_terms(shape: Mapping[str, int], rows: int, tokens: int, *, nvfp4: bool) -> dict[str, int]:
    """What a training pass with full recompute adds at its peak, by term: one bf16 hidden state per layer and token
    kept at each checkpoint (``checkpointed``), one layer's recomputed activations and, for NVFP4, two bf16 copies of
    its largest dequantized weight (``layer_recompute``), and the LM head's and the gradients' ``HEAD_ACTIVATIONS``
    hidden-sized tensors per token (``head_and_grads``)."""
    h, i, rows_tokens = shape["hidden_size"], shape["intermediate_size"], rows * tokens
    return {
        "checkpointed": shape["num_hidden_layers"] * rows_tokens * h * 2,
        "layer_recompute": rows_tokens * (3 * i + 4 * h) * 2 + (2 * h * i * 2 if nvfp4 else 0),
        "head_and_grads": HEAD_ACTIVATIONS * rows_tokens * h * 2,
    }


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes a pass can still allocate, the card's total) on a CUDA ``device``: what the driver reports free plus
    what torch's allocator holds unused; None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def enable_recompute(model: nn.Module, gradient_checkpointing_kwargs: dict[str, Any] | None) -> None:
    """``gradient_checkpointing_enable`` as transformers' training loop calls it: ``every_n_layers`` and ``offload``
    taken out of the kwargs, the rest handed to ``torch.utils.checkpoint``."""
    kwargs = dict(gradient_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
    )


def chunk_rows(rows: int, fits: Callable[[int], bool]) -> int:
    """Rows per chunk of a pass over ``rows`` rows: all of them where ``fits(rows)``; else the fewest chunks whose
    largest fits, as even as they come (8 rows of which 5 fit: two chunks of 4; of which 3 fit: 3, 3 and 2); 0 where not
    even one row fits. ``fits`` is tried from ``rows`` down, so it must turn false as the rows grow, as memory does."""
    largest = next((c for c in range(rows, 0, -1) if fits(c)), 0)
    return -(-rows // -(-rows // largest)) if largest else 0


class AutoRecompute:
    """Mixin over trl's ``GRPOTrainer``: with ``gradient_checkpointing`` unset, the plan of each training pass (see the
    module docstring), logged in one line when it is made and when it changes; ``qerl.train.chunked_pass`` asks for it
    before each pass and runs it. ``planned_recompute`` and ``planned_chunk`` are the plan of the passes so far (None:
    the next pass plans afresh); :meth:`pass_bytes` and :meth:`unallocated_state_bytes` the estimate it weighs."""

    planned_recompute: str | None = None  # the mode of the passes so far: None before the first, then "none" or "full"
    planned_chunk: int | None = None  # rows per chunk of the passes so far; a later pass's chunk is at most this
    layers_fused: bool = False  # the norms and MLPs run qerl.train.fused_layers (the trainer sets it when it swaps)
    rollout_memory_freed: int = 0  # passes before which free_rollout_memory freed the engine's memory

    def _choose_recompute(self, inputs: dict[str, Any], chunks: bool) -> int:
        """Rows per forward + backward of this pass (all its rows: one piece, with full recompute if it came to that);
        ``chunks``: whether the pass may run in row chunks."""
        rows, prompt = inputs["prompt_ids"].shape
        tokens = prompt + inputs["completion_ids"].shape[1]
        masked = self.pass_masked(inputs)
        state = self.unallocated_state_bytes()
        memory = device_memory(inputs["prompt_ids"].device)
        room = None if memory is None else memory[0] - HEADROOM * memory[1]

        def need(c: int) -> int:
            return self.pass_bytes(c, tokens, masked) + state

        def fits(c: int) -> bool:
            return room is not None and c <= (self.planned_chunk or rows) and need(c) <= room

        chunk = self._agreed(chunk_rows(rows, fits) if chunks else (rows if fits(rows) else 0))
        mode = "none" if chunk else "full"
        if (mode, chunk) != (self.planned_recompute, self.planned_chunk):
            free = "no CUDA memory to measure" if room is None else f"{room / 1e9:.1f} GB free besides the headroom"
            piece = f" in chunks of {chunk} rows" if 0 < chunk < rows else ""
            each = f", a chunk of {chunk} rows ~{need(chunk) / 1e9:.1f} GB" if piece else ""
            logger.info(
                "activation recompute: %s%s from step %d (a pass of %d x %d tokens needs ~%.1f GB without it%s; %s)",
                mode,
                piece,
                self.state.global_step,
                rows,
                tokens,
                need(rows) / 1e9,
                each,
                free,
            )
            if mode == "full":
                enable_recompute(self.model, self.args.gradient_checkpointing_kwargs)
        self.planned_recompute, self.planned_chunk = mode, chunk
        return chunk or rows

    def _agreed(self, chunk: int) -> int:
        """The smallest of every data-parallel rank's choice: each rank must run as many pieces, since trl's loss
        gathers its metrics across the ranks in every piece (one rank that recomputes makes every rank recompute)."""
        if self.accelerator.num_processes == 1:
            return chunk
        return int(self.accelerator.gather(torch.tensor([chunk], device=self.accelerator.device)).min())

    def pass_masked(self, inputs: dict[str, Any]) -> bool:
        """Whether this pass's attention takes a padding mask: any pad in its rows (``qerl.train.aligned_rows``
        removes the mask where it can)."""
        return not (bool(inputs["prompt_mask"].all()) and bool(inputs["completion_mask"].all()))

    def _model_shape(self) -> dict[str, Any]:
        """This trainer's model dimensions (``SHAPE_KEYS`` and ``head_dim``) for the estimates."""
        shape = {key: getattr(self.model.config, key) for key in SHAPE_KEYS}
        shape["head_dim"] = getattr(self.model.config, "head_dim", None)
        return shape

    def pass_bytes(self, rows: int, tokens: int, masked: bool) -> int:
        """What a training pass of ``rows`` x ``tokens`` keeps for its backward without recompute (``masked``: a pass
        with padding), for this trainer's model and adapter (:func:`no_recompute_bytes`)."""
        from qerl.load.loader import is_nvfp4_model

        model = self.model
        lora_r = max((getattr(c, "r", 0) for c in getattr(model, "peft_config", {}).values()), default=0)
        trained_norms = any(p.requires_grad for n, p in model.named_parameters() if "norm" in n)
        return no_recompute_bytes(
            self._model_shape(),
            rows,
            tokens,
            lora_r,
            nvfp4=is_nvfp4_model(model),
            trained_norms=trained_norms,
            masked=masked,
            fused=self.layers_fused,
        )

    def auto_may_chunk(self, inputs: dict[str, Any]) -> bool:
        """Whether the automatic plan may run this pass in row chunks (``qerl.train.chunked_pass`` says; alone, this
        mixin never chunks)."""
        return False

    def smallest_pass_bytes(self, inputs: dict[str, Any]) -> int:
        """The least a pass over ``inputs`` could hold as this trainer plans it, and the state it is still to
        allocate: ``--pass_chunk_rows N`` runs pieces of N rows; the checkpointing on recomputes each piece in full,
        off recomputes nothing, and unset (auto) recomputes in full unless one row without recompute is smaller and
        the pass may run in chunks."""
        from qerl.load.loader import is_nvfp4_model

        rows, prompt = inputs["prompt_ids"].shape
        tokens, masked = prompt + inputs["completion_ids"].shape[1], self.pass_masked(inputs)
        asked, checkpointing = self.args.pass_chunk_rows, self.args.gradient_checkpointing
        rows = min(asked, rows) if asked else rows
        full = sum(recompute_terms(self._model_shape(), rows, tokens, nvfp4=is_nvfp4_model(self.model)).values())
        if checkpointing:
            least = full
        elif checkpointing is False or asked:
            least = self.pass_bytes(rows, tokens, masked)
        else:
            least = min(full, self.pass_bytes(1, tokens, masked)) if self.auto_may_chunk(inputs) else full
        return least + self.unallocated_state_bytes()

    def free_rollout_memory(self, inputs: dict[str, Any]) -> None:
        """Free the native engine's KV cache and decode graphs before this pass (module docstring): always with
        ``--release_rollout_memory True``, never with False; unset, where :meth:`smallest_pass_bytes` exceeds the
        card's free memory less the headroom. The first release is logged in one line."""
        engine = getattr(self, "_engine", None)
        asked = self.args.release_rollout_memory
        if asked is False or getattr(engine, "view", None) is None:  # no native engine, or none since its release
            return
        device = inputs["prompt_ids"].device
        memory = device_memory(device)
        if asked is None:
            if memory is None:
                return
            need, room = self.smallest_pass_bytes(inputs), memory[0] - HEADROOM * memory[1]
            if need <= room:
                return
        cuda = device.type == "cuda"
        held = torch.cuda.memory_allocated(device) if cuda else 0
        engine.release()
        if cuda:
            torch.cuda.empty_cache()  # the graphs' private pool and the cache's blocks back to every allocation
        if not self.rollout_memory_freed:
            why = "as asked" if asked else f"the pass needs ~{need / 1e9:.1f} GB, {room / 1e9:.1f} GB free"
            freed = held - (torch.cuda.memory_allocated(device) if cuda else 0)
            logger.info(
                "rollout memory: freed the engine's KV cache and decode graphs (%.1f GB) before the training pass "
                "from step %d (%s); each rollout allocates them again",
                freed / 1e9,
                self.state.global_step,
                why,
            )
        self.rollout_memory_freed += 1

    def unallocated_state_bytes(self) -> int:
        """What the pass's backward and the step's optimizer are still to allocate: an fp32 gradient for each trainable
        parameter without one, and AdamW's two fp32 moments while the optimizer holds no state yet."""
        moments = 8 if self.optimizer is None or not self.optimizer.state else 0
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return sum(p.numel() * ((4 if p.grad is None else 0) + moments) for p in trainable)


__all__ = [
    "AutoRecompute",
    "HEAD_ACTIVATIONS",
    "chunk_rows",
    "device_memory",
    "enable_recompute",
    "no_recompute_bytes",
    "recompute_terms",
    "saved_activation_bytes",
]
