"""The decode step's sampler (``sample``: the exponential race of ``rollout.sampling.sample`` without top-k / top-p,
in one launch) and its bookkeeping (``finish_step``: record the tokens, mark stops, advance positions, one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend
from .reference import StepBooks
from .step_base import last_arrival


@triton.jit
def exponential(seed_ptr, step_ptr, row, cols, V):
    """The race's E ~ Exp(1) of (step, row, columns): ``-log U``, U Philox-uniform in [0, 1) at counter
    ``step * 2^32 + row * V + column`` under the key ``seed``; clamped to the smallest normal float so
    that ``log E`` stays finite (U = 0 gives E = inf: that token cannot win)."""
    counter = (tl.load(step_ptr) << 32) | (row * V + cols).to(tl.int64)
    return tl.maximum(-tl.log(tl.rand(tl.load(seed_ptr), counter)), 1.1754943508222875e-38)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_l,
    temp_ptr,
    seed_ptr,
    step_ptr,
    part_ptr,
    idx_ptr,
    ticket_ptr,
    tok_ptr,
    lp_ptr,
    V,
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
    NSP: tl.constexpr,
):
    """Program (row, split): ``BLOCK`` logits of the row -> (max, sum of exp below it, best race score,
    its index, its scaled logit); the row's last program combines the splits in split order.

    The race is ``rollout.sampling.sample``'s: ``argmax(x / T - log E)``, ``E = -log U`` exponential,
    which picks token i with probability softmax(x / T)_i; the normaliser never enters the argmax, so
    one pass over the logits gives the token and, with the splits' (max, sum), its log-prob. E comes
    from ``exponential``: a fresh, reproducible draw per step, row and token without a host round trip.
    GREEDY: no race and T = 1, i.e. the argmax and its log-prob under the unprocessed softmax.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if GREEDY:
        race = x
    else:
        x = x / tl.load(temp_ptr)
        race = tl.where(mask, x - tl.log(exponential(seed_ptr, step_ptr, row, cols, V)), float("-inf"))
    best = tl.argmax(race, axis=0)  # the first of equal scores, as torch.argmax
    m = tl.max(x, axis=0)
    slot = row * NSP + split
    tl.store(part_ptr + slot * 4, m)
    tl.store(part_ptr + slot * 4 + 1, tl.sum(tl.exp(x - m), axis=0))
    tl.store(part_ptr + slot * 4 + 2, tl.max(race, axis=0))
    tl.store(part_ptr + slot * 4 + 3, tl.sum(tl.where(tl.arange(0, BLOCK) == best, x, 0.0), axis=0))
    tl.store(idx_ptr + slot, split * BLOCK + best)
    if last_arrival(ticket_ptr, row, nsplit):
        s = tl.arange(0, NSP)
        live = s < nsplit
        base = part_ptr + (row * NSP + s) * 4
        ms = tl.load(base, mask=live, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(base + 1, mask=live, other=0.0, cache_modifier=".cg")
        races = tl.load(base + 2, mask=live, other=float("-inf"), cache_modifier=".cg")
        xs = tl.load(base + 3, mask=live, other=0.0, cache_modifier=".cg")
        top = tl.max(ms, axis=0)
        lse = top + tl.log(tl.sum(sums * tl.exp(ms - top), axis=0))
        win = tl.argmax(races, axis=0)  # the first split with the best score: the smallest index
        tl.store(tok_ptr + row, tl.load(idx_ptr + row * NSP + win, cache_modifier=".cg").to(tl.int64))
        tl.store(lp_ptr + row, tl.sum(tl.where(s == win, xs, 0.0), axis=0) - lse)
        tl.store(ticket_ptr + row, 0)


#: Logits a sampling program reads: V = 152k spreads a b=1 row over ~75 programs (the b=1 step's latency).
SAMPLE_BLOCK = 2048


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rollout.sampling.sample`` without top-k / top-p, in one launch: ``(tokens int64 [B], log-probs fp32
    [B])`` of ``logits [B, V]`` at ``temperature`` (a 0-d tensor), drawn with Philox from the int64
    ``seed`` and ``step`` tensors (read at run time: a captured graph replays with new values). Replaces
    ~10 torch launches (a fp32 copy, log_softmax, the exponential draw, argmax, gathers) that each moved
    the whole ``[B, V]`` matrix."""
    b, v = logits.shape
    nsplit = triton.cdiv(v, SAMPLE_BLOCK)
    nsp = triton.next_power_of_2(nsplit)
    part = torch.empty(b * nsp * 4, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b * nsp, dtype=torch.int32, device=logits.device)
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_kernel[(b, nsplit)](
        logits,
        logits.stride(0),
        temperature,
        seed,
        step,
        part,
        idx,
        backend.tickets(logits.device, b),
        tok,
        lp,
        v,
        GREEDY=greedy,
        BLOCK=SAMPLE_BLOCK,
        NSP=nsp,
        num_warps=4,
    )
    return tok, lp


@triton.jit
def _finish_step_kernel(
    tok_ptr,
    lp_ptr,
    done_ptr,
    row_ptr,
    stop_ptr,
    step_ptr,
    tokens_ptr,
    pos_ptr,
    out_tok_ptr,
    out_lp_ptr,
    b,
    n_stop,
    pad_id,
    out_stride,
    BLOCK: tl.constexpr,
):
    """One program for all rows: what ``NativeEngine._finish_step`` does in ~12 torch ops."""
    offs = tl.arange(0, BLOCK)
    mask = offs < b
    step = tl.load(step_ptr)
    done = tl.load(done_ptr + offs, mask=mask, other=1) != 0
    tok = tl.where(done, pad_id, tl.load(tok_ptr + offs, mask=mask, other=0))
    lp = tl.where(done, 0.0, tl.load(lp_ptr + offs, mask=mask, other=0.0))
    row = tl.load(row_ptr + offs, mask=mask, other=0)
    tl.store(out_tok_ptr + row * out_stride + step, tok, mask=mask)
    tl.store(out_lp_ptr + row * out_stride + step, lp, mask=mask)
    hit = done
    for j in range(0, n_stop):
        hit = hit | (tok == tl.load(stop_ptr + j))
    tl.store(done_ptr + offs, hit, mask=mask)
    tl.store(tokens_ptr + offs, tok, mask=mask)
    tl.store(pos_ptr + offs, tl.load(pos_ptr + offs, mask=mask, other=0) + 1, mask=mask)
    tl.debug_barrier()  # every thread has read `step` before it moves on
    tl.store(step_ptr, step + 1)


def finish_step(tok: torch.Tensor, lp: torch.Tensor, books: StepBooks) -> None:
    """Record this step's tokens/log-probs (pad and 0 for finished rows), mark stop tokens done, feed
    the tokens back, advance positions and the step counter: one launch."""
    b = tok.shape[0]
    _finish_step_kernel[(1,)](
        tok,
        lp,
        books.done,
        books.row_id,
        books.stop,
        books.step,
        books.tokens,
        books.pos,
        books.out_tok,
        books.out_lp,
        b,
        books.stop.numel(),
        books.pad_id,
        books.out_tok.stride(0),
        BLOCK=max(16, triton.next_power_of_2(b)),
        num_warps=4,
    )
