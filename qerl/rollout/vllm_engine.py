"""``VLLMEngine``: rollouts from a colocated vLLM ``LLM`` serving the NVFP4 checkpoint.

vLLM serves the compressed-tensors NVFP4A16 checkpoint with its Marlin FP4 kernels and runs the
trainer's LoRA unmerged through its own LoRA layers. Before each ``generate`` the engine pushes
the trainer's current state, from memory, through vLLM's public extension point
(``worker_extension_cls`` + ``LLM.collective_rpc``); no file is written per step and no vLLM file
is patched:

* LoRA: peft's adapter state dict becomes a ``vllm.lora.lora_model.LoRAModel`` (``from_lora_tensors``)
  that replaces the adapter registered under a fixed id in the worker's LoRA manager and is
  activated (copied into vLLM's GPU LoRA slots). Requests then carry a ``LoRARequest`` with that id;
  vLLM finds it already registered and never reads its (placeholder) path.
* Norms: the RMSNorm weights the trainer's forward really uses (trained copies under peft
  ``modules_to_save``, with any AQN noise written into them) go through the model's own
  ``load_weights`` by module name.

Log-probs are vLLM's ``processed_logprobs`` (after the penalties, temperature, top-k/top-p/min-p), matching
``RolloutOutput``'s contract. The engine runs vLLM in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the caller chose otherwise): the worker then
receives the trainer's CUDA tensors by reference through ``collective_rpc`` (vLLM's uniproc
executor calls the method directly), with no trip through the host. After every push the prefix
cache is reset, since KV blocks computed under the previous weights must not be reused.

Checked against vLLM 0.26.0 (worker LoRA manager ``vllm/lora/worker_manager.py``: an adapter id
that is already registered is only activated, never loaded from its path).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from qerl.arch import NORM_MODULES
from qerl.rollout.base import RolloutOutput, SamplingParams, check_prompts, trim_completion
from qerl.rollout.layers import active_norm, unwrap_causal_lm

#: The id under which the trainer's adapter lives in vLLM's LoRA manager.
LORA_ID = 1
LORA_NAME = "qerl-policy"
#: The values vLLM accepts for max_lora_rank (its MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: LoRARequest insists on a path; vLLM never reads it because the adapter is registered first.
LORA_PLACEHOLDER_PATH = "qerl-in-memory-adapter"


#: Request seeds lie below this: vLLM keeps ``seed + j`` (the j-th of n samples) in an int64 array.
SEED_SPAN = 2**62


def request_seeds(seed: int | None, prompts: int, n: int) -> list[int | None]:
    """vLLM's seed for each prompt's request (None: unseeded), inside int64 for any ``seed`` the caller draws.

    One seed per prompt: vLLM seeds each request's generator with its own seed (and the j-th of n samples with
    seed + j), so a shared seed would give identical prompts (a GRPO group sent as n=1 requests) identical
    samples; prompts are spaced n seeds apart."""
    if seed is None:
        return [None] * prompts
    base = seed % SEED_SPAN
    return [base + i * n for i in range(prompts)]


def _require_vllm() -> Any:
    # In-process engine core: collective_rpc then hands CUDA tensors over by reference. vLLM reads
    # this lazily (vllm/envs.py) until its first engine caches the environment, so set it first.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "rollout engine kind='vllm' needs vLLM (pip install 'qerl[vllm]'); use kind='native' or 'hf' without it"
        ) from err
    return vllm


class QerlWorkerExtension:
    """Methods vLLM mixes into its GPU worker (``worker_extension_cls``); called via ``collective_rpc``.

    ``self`` is vLLM's ``Worker``; ``self.model_runner`` (V1 or V2 runner) carries the
    ``LoRAModelRunnerMixin`` whose ``lora_manager`` is an ``LRUCacheWorkerLoRAManager``.
    """

    def qerl_set_lora(self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> None:
        """Replace the adapter ``LORA_ID`` by these peft-format tensors and activate it."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = self.model_runner.lora_manager
        manager = worker_manager._adapter_manager
        helper = PEFTHelper.from_dict(peft_config)
        helper.validate_legal(worker_manager.lora_config)  # rank <= max_lora_rank, no bias/DoRA
        dtype = worker_manager.lora_config.lora_dtype
        # Own copies: vLLM folds the scaling into lora_b in place (LoRALayerWeights.optimize), which
        # would otherwise scale the trainer's own parameter whenever the dtypes already match.
        tensors = {k: v.to(device=worker_manager.device, dtype=dtype, copy=True) for k, v in tensors.items()}
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)  # what _load_adapter applies too
        lora = LoRAModel.from_lora_tensors(
            LORA_ID,
            tensors,
            helper,
            device=str(worker_manager.device),
            dtype=dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_unstacked_mapper(),
        )
        manager.remove_adapter(LORA_ID)  # frees its GPU slot too (deactivate_adapter)
        manager.add_adapter(lora)  # packs q/k/v and gate/up, folds the scaling into B
        manager.activate_adapter(LORA_ID)  # copies A/B into the GPU slot the kernels read

    def qerl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Overwrite (norm) weights by HF module name through the model's own loader (in place)."""
        self.model_runner.get_model().load_weights(weights)


class VLLMEngine:
    """RolloutEngine over a colocated vLLM ``LLM`` with the trainer's LoRA and norms pushed each call.

    Args:
        model: the trainer's (peft-wrapped) model; read for its adapter and norm weights only.
        tokenizer: unused beyond the common signature (vLLM loads the checkpoint's own).
        checkpoint: the NVFP4A16 (or bf16) checkpoint directory vLLM serves.
        gpu_memory_utilization: vLLM's share of GPU memory (KV cache included); the trainer needs the rest.
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``max_model_len``, ``enforce_eager``).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: object = None,
        *,
        checkpoint: str,
        gpu_memory_utilization: float = 0.3,
        **llm_kwargs: Any,
    ) -> None:
        vllm = _require_vllm()
        self.model = model
        self.lm = unwrap_causal_lm(model)
        peft_config = getattr(model, "peft_config", {}).get("default")
        self.peft_config = None
        kwargs: dict[str, Any] = {}
        if peft_config is not None:
            if peft_config.rank_pattern or peft_config.alpha_pattern:
                raise ValueError("rollout engine kind='vllm': LoRA rank_pattern/alpha_pattern is not supported")
            targets = peft_config.target_modules
            self.peft_config = {
                "r": peft_config.r,
                "lora_alpha": peft_config.lora_alpha,
                "target_modules": targets if isinstance(targets, str) else sorted(targets),
                "bias": "none",
                "use_rslora": bool(peft_config.use_rslora),
            }
            # vLLM accepts only a fixed set of max ranks (MaxLoRARanks): take the smallest that holds r.
            max_rank = next((r for r in VLLM_LORA_RANKS if r >= peft_config.r), None)
            if max_rank is None:
                raise ValueError(
                    f"rollout engine kind='vllm': LoRA r={peft_config.r} > vLLM's largest {VLLM_LORA_RANKS[-1]}"
                )
            kwargs.update(enable_lora=True, max_lora_rank=max_rank, max_loras=1)
        # Prompts arrive as token ids and completions leave as token ids: vLLM needs no tokenizer.
        kwargs["skip_tokenizer_init"] = True
        self.llm = vllm.LLM(
            model=str(checkpoint),
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.QerlWorkerExtension",
            **{**kwargs, **llm_kwargs},
        )

    @torch.no_grad()
    def sync(self) -> None:
        """Push the current LoRA factors and norm weights into vLLM (no files, no patches)."""
        if self.peft_config is not None:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model)
            tensors = {k: v.detach() for k, v in state.items() if "lora_" in k}
            self.llm.collective_rpc("qerl_set_lora", args=(tensors, self.peft_config))
        norms = []
        for i, layer in enumerate(self.lm.model.layers):
            for name in NORM_MODULES:
                norms.append((f"model.layers.{i}.{name}.weight", active_norm(getattr(layer, name)).weight.detach()))
        norms.append(("model.norm.weight", active_norm(self.lm.model.norm).weight.detach()))
        self.llm.collective_rpc("qerl_load_weights", args=(norms,))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the previous weights

    @staticmethod
    def _sampling(vllm: Any, params: SamplingParams, n: int, seed: int | None) -> Any:
        return vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it in vLLM too
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            min_tokens=params.min_tokens,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # only params.stop_token_ids end a completion, as in the other engines
            seed=seed,
            logprobs=0,  # only the sampled token's log-prob (no top-k alternatives)
            detokenize=False,
        )

    def lora_request(self) -> Any:
        """The ``LoRARequest`` that selects the pushed adapter (None without LoRA), for direct ``llm`` calls."""
        if self.peft_config is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(LORA_NAME, LORA_ID, LORA_PLACEHOLDER_PATH)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1) -> RolloutOutput:
        check_prompts(prompt_ids, n)
        vllm = _require_vllm()
        self.sync()
        sampling = [self._sampling(vllm, params, n, seed) for seed in request_seeds(params.seed, len(prompt_ids), n)]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], sampling, lora_request=self.lora_request(), use_tqdm=False
        )
        stop = set(params.stop_token_ids)
        completions, logprobs, reasons, index = [], [], [], []
        for i, request in enumerate(outputs):
            for completion in request.outputs:
                ids = list(completion.token_ids)
                lps = [entry[tok].logprob for tok, entry in zip(ids, completion.logprobs or [], strict=False)]
                length, reason = trim_completion(ids, stop, params.max_new_tokens)
                completions.append(ids[:length])
                logprobs.append(lps[:length])
                reasons.append(reason)
                index.append(i)
        return RolloutOutput(completions, logprobs, reasons, index)
