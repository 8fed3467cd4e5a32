"""The native engine's static buffers: what one ``generate`` sizes once and its captured decode graphs read and
write by address (the KV cache, RoPE tables, output rows, sampling knobs, per-bucket row state), and the step key
that names a captured graph. Kept apart from ``native`` so the engine's loop reads without its bookkeeping."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qerl.rollout.layers import ModelPlan

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


class State:
    """The static KV cache, RoPE tables, output buffers and sampling knobs, sized (rows, seq)."""

    def __init__(self, plan: ModelPlan, rows: int, seq: int) -> None:
        dev, dt = plan.device, plan.dtype
        n_layers = len(plan.layers)
        self.rows, self.seq = rows, seq
        self.k = torch.zeros(n_layers, rows, plan.num_kv_heads, seq, plan.head_dim, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        with torch.no_grad():
            probe = torch.empty(1, dtype=dt, device=dev)
            cos, sin = plan.rotary(probe, torch.arange(seq, device=dev)[None])
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
        vocab = plan.lm_head.out_features
        self.seen = torch.zeros(rows + 1, vocab, dtype=torch.bool, device=dev)
        self.stop_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self.slots: dict[int, Slots] = {}

    def slots_for(self, b: int) -> Slots:
        if b not in self.slots:
            self.slots[b] = Slots.empty(b, self.k.device)
        return self.slots[b]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
