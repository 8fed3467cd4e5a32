"""The native engine's prefill: every prompt once (its ``n`` completions share it), right-padded, in one causal pass
per chunk of at most ``prefill_tokens`` tokens; the keys / values go into the cache rows of each prompt's
completions, and the logits of each prompt's last token come back to sample the first token from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.kernels import reference
from qerl.rollout import step_plan
from qerl.rollout.buffers import State
from qerl.rollout.decoder import LoraInputs, lora_inputs
from qerl.rollout.layers import ModelView


def prefill(
    view: ModelView, state: State, prompt_ids: list[list[int]], n: int, pad_id: int, prefill_tokens: int
) -> torch.Tensor:
    """Run all prompts (in chunks), fill the cache rows of their completions; return last logits [P, V]."""
    width = max(len(p) for p in prompt_ids)
    per_chunk = max(1, prefill_tokens // width)
    logits = []
    for start in range(0, len(prompt_ids), per_chunk):
        logits.append(_chunk(view, state, prompt_ids[start : start + per_chunk], start, n, pad_id))
    return torch.cat(logits)


def _chunk(view: ModelView, state: State, chunk: list[list[int]], first: int, n: int, pad_id: int) -> torch.Tensor:
    """One chunk of prompts, the ``first`` of them at index ``first``: its last logits ``[len(chunk), V]``."""
    dev = view.device
    p, width = len(chunk), max(len(c) for c in chunk)
    tokens = torch.full((p, width), pad_id, dtype=torch.long)
    for i, c in enumerate(chunk):
        tokens[i, : len(c)] = torch.tensor(c)
    tokens = tokens.to(dev)
    lens = torch.tensor([len(c) for c in chunk], device=dev)
    # Right padding: causal attention already keeps real tokens from seeing the pads after them.
    rows = torch.arange(first * n, (first + p) * n, device=dev)
    src = torch.arange(p, device=dev).repeat_interleave(n)
    cos, sin = state.cos[:width][None, :, None, :], state.sin[:width][None, :, None, :]
    hd, nh, nkv = view.head_dim, view.num_heads, view.num_kv_heads

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, LoraInputs]:
        if view.layers[i].qk_norms is not None:
            q, k = step_plan.qk_norm(q, k, view.layers[i].qk_norms, hd)
        q = reference.apply_rope(q.view(p, width, nh, hd), cos, sin).transpose(1, 2)
        k = reference.apply_rope(k.view(p, width, nkv, hd), cos, sin).transpose(1, 2)
        v = v.view(p, width, nkv, hd).transpose(1, 2)
        state.k[i, rows, :, :width] = k[src]
        state.v[i, rows, :, :width] = v[src]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5, enable_gqa=nkv != nh)
        out = attn.transpose(1, 2).reshape(p, width, nh * hd)
        return out, lora_inputs(out, view.layers[i].o)  # in natural K order: the plan's prefill o route

    x = step_plan.run_layers(step_plan.build(view, p * width, decode=False), view.embed(tokens), attend)
    # Only each prompt's last position is sampled from.
    return view.lm_head(x[torch.arange(p, device=dev), lens - 1])
