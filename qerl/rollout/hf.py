"""``HFEngine``: rollouts through transformers' ``generate``.

The baseline every faster engine is measured against, and the fallback for architectures the
native engine does not know. It runs the model exactly as the trainer does (same modules, LoRA
unmerged), so it is also the reference in the engine tests.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel

from qerl.rollout.base import RolloutOutput, SamplingParams, check_prompts, resolve_pad_id, trim_completion


class HFEngine:
    """RolloutEngine over ``model.generate`` with left padding and per-step scores."""

    def __init__(self, model: PreTrainedModel, tokenizer_or_pad_id: object) -> None:
        self.model = model
        self.pad_id = resolve_pad_id(tokenizer_or_pad_id)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        greedy = params.temperature == 0
        cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            max_new_tokens=params.max_new_tokens,
            # Always a list, even empty: a None would be filled in from the model's own eos.
            eos_token_id=list(params.stop_token_ids),
            pad_token_id=self.pad_id,
            repetition_penalty=params.repetition_penalty,
            typical_p=1.0,
            no_repeat_ngram_size=0,
            min_length=0,
            min_new_tokens=params.min_tokens or None,
            return_dict_in_generate=True,
            output_scores=not greedy,
            output_logits=greedy,
        )
        if params.min_p > 0:
            cfg.min_p = params.min_p
        elif getattr(self.model.generation_config, "min_p", None) is not None:
            cfg.min_p = 0.0  # neutralise a checkpoint default; None would be overwritten by it
        return cfg

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1) -> RolloutOutput:
        check_prompts(prompt_ids, n)
        rows = [p for p in prompt_ids for _ in range(n)]
        device = next(self.model.parameters()).device
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                generation_config=self._generation_config(params),
            )
        steps = out.logits if params.temperature == 0 else out.scores
        logp = torch.log_softmax(torch.stack(steps, dim=1).float(), dim=-1)  # [rows, T, V]
        new = out.sequences[:, width:]
        chosen = logp.gather(-1, new[..., None]).squeeze(-1).cpu()
        new = new.cpu()
        stop = set(params.stop_token_ids)
        completions, logprobs, reasons = [], [], []
        for i in range(len(rows)):
            length, reason = trim_completion(new[i].tolist(), stop, params.max_new_tokens)
            completions.append(new[i, :length].tolist())
            logprobs.append(chosen[i, :length].tolist())
            reasons.append(reason)
        return RolloutOutput(completions, logprobs, reasons, [i // n for i in range(len(rows))])
