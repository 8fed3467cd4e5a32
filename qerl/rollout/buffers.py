"""The native engine's static buffers: what one ``generate`` sizes once and its captured decode graphs read and
write by address (the KV cache, RoPE tables, output rows, sampling knobs, per-bucket row state), and the step key
that names a captured graph. Kept apart from ``native`` so the engine's loop reads without its bookkeeping."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qerl.rollout.base import SamplingParams
from qerl.rollout.layers import ModelView

#: Stop-id buffer slots baked into a graph; more stop ids grow it (and recapture).
STOP_SLOTS = 16


class StepKey(NamedTuple):
    """Everything static about one decode step: a captured graph per distinct key."""

    batch: int  # slots in the bucket (a power of two)
    kv_len: int  # cache prefix attention reads (a multiple of ``kv_block``)
    greedy: bool
    filtered: bool  # anything beyond temperature: top-k / top-p / min-p, repetition penalty, min_tokens
    forced: bool  # teacher forcing (``teacher_forced_logits``): feed given tokens, record the logits


def bucket(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << (max(n, 1) - 1).bit_length()


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Run the body on a side CUDA stream ordered after and before the current one (CPU: as is).

    Warm-up before graph capture must not run on the capturing (default) stream's history.
    """
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


@dataclass
class Slots:
    """Per-row decode state of one batch bucket (static buffers a graph reads and writes)."""

    tokens: torch.Tensor  # [b] token fed this step
    pos: torch.Tensor  # [b] its position (= cache slot)
    done: torch.Tensor  # [b] bool
    row_id: torch.Tensor  # [b] output row (the trash row for padding slots)

    @classmethod
    def empty(cls, b: int, device: torch.device) -> Slots:
        return cls(
            torch.zeros(b, dtype=torch.long, device=device),
            torch.zeros(b, dtype=torch.long, device=device),
            torch.ones(b, dtype=torch.bool, device=device),
            torch.zeros(b, dtype=torch.long, device=device),
        )

    def load(
        self, pad_id: int, trash: int, tokens: torch.Tensor, pos: torch.Tensor, done: torch.Tensor, row_id: torch.Tensor
    ) -> None:
        """Fill the first ``len(tokens)`` slots with these rows; the rest are finished padding that feed ``pad_id``
        and write to the ``trash`` output row."""
        n = tokens.shape[0]
        self.tokens.fill_(pad_id)
        self.pos.zero_()
        self.done.fill_(True)
        self.row_id.fill_(trash)
        self.tokens[:n] = tokens
        self.pos[:n] = pos
        self.done[:n] = done
        self.row_id[:n] = row_id


class State:
    """The static KV cache, RoPE tables, output buffers and sampling knobs, sized (rows, seq)."""

    def __init__(self, view: ModelView, rows: int, seq: int) -> None:
        dev, dt = view.device, view.dtype
        n_layers = len(view.layers)
        self.rows, self.seq = rows, seq
        self.k = torch.zeros(n_layers, rows, view.num_kv_heads, seq, view.head_dim, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        with torch.no_grad():
            probe = torch.empty(1, dtype=dt, device=dev)
            cos, sin = view.rotary(probe, torch.arange(seq, device=dev)[None])
        self.cos, self.sin = cos[0], sin[0]  # [seq, D], the model's own rope (theta, scaling)
        self.trash = rows  # output row that padding slots write to
        self.out_tok = torch.zeros(rows + 1, seq, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(rows + 1, seq, dtype=torch.float32, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)  # the fused sampler's Philox key, per generate
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.top_k = torch.zeros((), dtype=torch.long, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.min_p = torch.zeros((), dtype=torch.float32, device=dev)
        self.penalty = torch.ones((), dtype=torch.float32, device=dev)
        self.min_tokens = torch.zeros((), dtype=torch.long, device=dev)
        self.stop = torch.full((STOP_SLOTS,), -1, dtype=torch.long, device=dev)
        # The filtered path's token history and stop tokens (repetition penalty, min_tokens), per output row.
        vocab = view.lm_head.out_features
        self.seen = torch.zeros(rows + 1, vocab, dtype=torch.bool, device=dev)
        self.stop_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self.slots: dict[int, Slots] = {}

    def slots_for(self, b: int) -> Slots:
        if b not in self.slots:
            self.slots[b] = Slots.empty(b, self.k.device)
        return self.slots[b]

    def set_sampling(self, params: SamplingParams) -> None:
        """Write ``params``' stop ids and sampling knobs into the buffers the step reads (the stop table grown first
        where ``params`` has more ids than it holds: the caller drops graphs that read the old one)."""
        dev = self.stop.device
        if len(params.stop_token_ids) > self.stop.numel():
            self.stop = torch.full((len(params.stop_token_ids),), -1, dtype=torch.long, device=dev)
        self.stop.fill_(-1)
        if params.stop_token_ids:
            self.stop[: len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids, device=dev)
        self.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        self.min_p.fill_(params.min_p)
        self.penalty.fill_(params.repetition_penalty)
        self.min_tokens.fill_(params.min_tokens)
        self.stop_mask.zero_()
        # A stop id outside the model's vocabulary (a tokenizer's extra EOS) can never be sampled: nothing to ban.
        in_vocab = [t for t in params.stop_token_ids if t < self.stop_mask.numel()]
        if in_vocab:
            self.stop_mask[torch.tensor(in_vocab, device=dev)] = True

    def mark_prompts(self, prompt_ids: list[list[int]], n: int) -> None:
        """Start each completion row's token history with its prompt (the repetition penalty covers it)."""
        self.seen.zero_()
        for i, ids in enumerate(prompt_ids):
            self.seen[i * n : (i + 1) * n, torch.tensor(ids, device=self.seen.device)] = True

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
