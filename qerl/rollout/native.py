"""``NativeEngine``: gpt-fast-style rollouts over the trainer's own model object.

How a ``generate`` call runs:

1. ``ModelView.from_model`` collects references to the live modules (NVFP4 buffers or bf16
   weights, the norm weights forward really uses, peft LoRA factors) and refreshes the small LoRA
   buffers. Nothing heavy is copied, so an optimizer step or an in-place AQN write to a norm weight
   is seen by the next generation without recapturing anything.
2. Prefill (``qerl.rollout.prefill``): unique prompts, right-padded, go through one causal pass (chunked);
   their keys/values are written into a preallocated static cache ``[layers, rows, Hkv, S, D]``,
   one cache row per completion (a prompt's ``n`` completions share its prefill).
3. Decode: one token per row per step over the static cache. On CUDA the whole step (embedding,
   layers, LM head, sampling, stop-token bookkeeping) is captured once as a CUDA graph per
   (batch bucket, KV-length bucket, sampling mode) and replayed; graphs read parameters by address.
   Every ``check_every`` steps the host looks at the done flags: when all rows are done it stops,
   and when the live rows fit a smaller power-of-two bucket it compacts them (and their cache rows)
   to the front so that finished rows stop costing work. The KV-length bucket (``kv_block``) bounds
   attention to the cache prefix that can hold live tokens; inside it, each row's attention loop
   stops at that row's own length.

CPU runs the same step eagerly (fp32 for tests). Floors and measured speeds: docs/rollout.md.

AQN hook: ``set_step_hook(fn)`` registers a zero-argument callable that runs at the start of every
decode step, *inside* the captured graph on CUDA, and once before prefill. It must be capture-safe:
fixed shapes, in-place tensor ops, randomness from the default CUDA generator (e.g.
``w.copy_(base + sigma * torch.randn_like(base))``). Norm weights are read by address, so writes
made between generations need no hook at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qerl.kernels import reference
from qerl.kernels.reference import AttentionArgs, StepBooks
from qerl.rollout import step_plan
from qerl.rollout.base import RolloutOutput, SamplingParams, check_prompts, resolve_pad_id, trim_completion
from qerl.rollout.buffers import Slots, State, StepKey, bucket, round_up, side_stream
from qerl.rollout.decoder import LoraInputs
from qerl.rollout.layers import ModelView
from qerl.rollout.prefill import prefill
from qerl.rollout.sampling import adjust_logits, is_filtered, make_generator, sample


class NativeEngine:
    """RolloutEngine running the trainer's model with a static KV cache and CUDA graphs.

    Args:
        model: a transformers causal LM of a ``qerl.arch.FAMILIES`` family, optionally peft-wrapped;
            decoder Linears may be ``NVFP4Linear``. Used in place, never copied. A sliding-window
            model (Mistral) rolls out up to its window: longer requests are refused, not truncated.
        tokenizer_or_pad_id: a tokenizer (for its pad id) or the pad id itself.
        cuda_graphs: capture decode steps on CUDA (ignored on CPU).
        kv_block: KV-length bucket granularity for decode attention (and graph keys).
        check_every: decode steps between host checks of the done flags (early exit, compaction).
        prefill_tokens: max prompt tokens (rows x padded length) per prefill chunk.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_or_pad_id: object,
        *,
        cuda_graphs: bool = True,
        kv_block: int = 256,
        check_every: int = 16,
        prefill_tokens: int = 16384,
    ) -> None:
        self.model = model
        self.pad_id = resolve_pad_id(tokenizer_or_pad_id)
        self.cuda_graphs = cuda_graphs
        self.kv_block = kv_block
        self.check_every = check_every
        self.prefill_tokens = prefill_tokens
        self._hook: Callable[[], None] | None = None
        self._state: State | None = None
        self._graphs: dict[StepKey, Callable[[], None]] = {}  # step key -> replay of its captured graph
        self._pool = None
        self._signature: tuple | None = None
        self._gen: torch.Generator | None = None
        self._forced: object = None  # teacher_forced_logits: the completions, then (tokens, logits) buffers
        self._view: ModelView | None = None  # kept so that its LoRA buffers (read by graphs) are reused
        self._step_plans: dict[int, step_plan.StepPlan] = {}  # batch bucket -> its decode ops, for ``_view``
        self.last_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ public API

    @property
    def view(self) -> ModelView | None:
        """The model view of the latest generation (its layers' groups and LoRA buffers); None before the first."""
        return self._view

    @property
    def step_plans(self) -> dict[int, step_plan.StepPlan]:
        """The latest generation's decode ops, by batch bucket (a copy)."""
        return dict(self._step_plans)

    @property
    def graphs(self) -> dict[StepKey, Callable[[], None]]:
        """The captured decode steps, by step key: the replays later steps of that key reuse (a copy)."""
        return dict(self._graphs)

    @property
    def signature(self) -> tuple | None:
        """Which model tensors the state and graphs read (``ModelView.signature``): reallocated ones change it."""
        return self._signature

    def set_step_hook(self, fn: Callable[[], None] | None) -> None:
        """Run ``fn()`` at the start of every decode step (captured into the graph on CUDA)."""
        self._hook = fn
        self._drop_graphs()

    def _drop_graphs(self, which: Callable[[StepKey], bool] | None = None) -> None:
        """Forget captured graphs (all, or those whose key matches); a fresh memory pool follows
        when none is left, since reusing a pool whose graphs are all gone trips the allocator."""
        self._graphs = {k: g for k, g in self._graphs.items() if which is not None and not which(k)}
        if not self._graphs:
            self._pool = None

    def release(self) -> None:
        """Free the KV cache and the graphs (before a training pass that needs them: qerl.train.recompute)."""
        self._drop_graphs()
        self._state = None
        self._view = None
        self._step_plans = {}

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1) -> RolloutOutput:
        return self._generate(prompt_ids, params, n, force=False)

    @torch.no_grad()
    def teacher_forced_logits(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits (fp32 ``[len(completion), V]``) the decode path gives each completion token, fed the
        given tokens instead of samples: prefill predicts token 0, captured decode steps the rest.

        For checking the engine against a full forward of the trainer's model (tests, benchmarks).
        """
        if len(prompt_ids) != len(completion_ids) or any(len(c) == 0 for c in completion_ids):
            raise ValueError("completion_ids: expected one non-empty completion per prompt")
        steps = max(len(c) for c in completion_ids)
        self._forced = completion_ids
        self._drop_graphs(lambda key: key.forced)  # forced graphs read the previous call's buffers
        try:
            self._generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=steps), 1, force=True)
            logits = self._forced[1]
        finally:
            self._forced = None
        return [logits[i, : len(c)].clone() for i, c in enumerate(completion_ids)]

    def _forced_buffers(self, view: ModelView, state: State, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per output row (trash row included): the tokens to feed and room for the logits."""
        tokens = torch.full((state.rows + 1, steps), self.pad_id, dtype=torch.long)
        for i, c in enumerate(self._forced):
            tokens[i, : len(c)] = torch.tensor(c)
        logits = torch.zeros(state.rows + 1, steps, view.lm_head.out_features, device=view.device)
        return tokens.to(view.device), logits

    @torch.no_grad()
    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams, n: int, force: bool) -> RolloutOutput:
        check_prompts(prompt_ids, n)
        view = self._view = ModelView.from_model(self.model, previous=self._view)
        self._step_plans = {}
        view.refresh_lora()
        rows = len(prompt_ids) * n
        max_len = max(len(p) for p in prompt_ids)
        window = view.sliding_window
        if window is not None and max_len + params.max_new_tokens > window:
            raise ValueError(
                f"native rollout engine: prompt ({max_len} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's sliding_window ({window}); the engine attends to the whole "
                "sequence, so shorten them or use kind='hf'"
            )
        state = self._prepare(view, rows, max_len + params.max_new_tokens, params)
        if force:
            self._forced = self._forced_buffers(view, state, params.max_new_tokens)
        if self._hook is not None:
            self._hook()

        row_prompt = torch.arange(rows, device=view.device) // n
        lens = torch.tensor([len(p) for p in prompt_ids], device=view.device)
        logits = prefill(view, state, prompt_ids, n, self.pad_id, self.prefill_tokens)
        greedy, filtered = params.temperature == 0, is_filtered(params)
        state.step.zero_()
        b = bucket(rows)
        every = torch.arange(rows, device=view.device)
        if force:
            tok, lp = self._forced_tokens(logits, every, 0)
        else:
            if filtered:
                state.mark_prompts(prompt_ids, n)
            tok, lp = self._sample(self._step_plan(view, b), logits[row_prompt], state, greedy, filtered, every)

        slots = state.slots_for(b)
        slots.load(self.pad_id, state.trash, tok, lens[row_prompt], reference.is_stop(tok, state.stop), every)
        state.out_tok[:rows, 0] = tok
        state.out_lp[:rows, 0] = lp
        state.step.fill_(1)

        steps = 1
        for t in range(1, params.max_new_tokens):
            kv_len = min(state.seq, round_up(max_len + t, self.kv_block))
            self._run_step(view, state, StepKey(b, kv_len, greedy, filtered, force))
            steps = t + 1
            if t % self.check_every == 0 and t + 1 < params.max_new_tokens:
                live = (~slots.done).nonzero().flatten()
                if live.numel() == 0:
                    break
                if bucket(live.numel()) < b:
                    b, slots = self._compact(state, slots, live, kv_len)
        self.last_stats = {
            "decode_steps": float(steps - 1),
            "final_bucket": float(b),
            "graphs": float(len(self._graphs)),
        }
        return self._collect(state, rows, steps, n, params)

    # ------------------------------------------------------------------ setup

    def _prepare(self, view: ModelView, rows: int, seq: int, params: SamplingParams) -> State:
        """(Re)allocate state when it is too small or the model's tensors moved; set the knobs."""
        signature = view.signature()
        if signature != self._signature:
            self._drop_graphs()
            self._signature = signature
        need_rows, need_seq = bucket(rows), round_up(seq, self.kv_block)
        state = self._state
        if state is None or state.rows < need_rows or state.seq < need_seq:
            self._drop_graphs()
            self._state = None  # free the old cache before allocating the new one
            state = self._state = State(view, need_rows, need_seq)
        if len(params.stop_token_ids) > state.stop.numel():
            self._drop_graphs()  # they read the stop table that set_sampling replaces
        state.set_sampling(params)
        if self._gen is None or self._gen.device != view.device:
            self._gen = make_generator(view.device, params.seed)
            self._drop_graphs()
        elif params.seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(int(params.seed))
        if self._step_plan(view, bucket(rows)).sample is not None:  # the fused sampler draws from this seed
            state.seed.random_(generator=self._gen)
        return state

    # ------------------------------------------------------------------ decode

    def _decode_step(self, view: ModelView, state: State, key: StepKey) -> None:
        """One token for every slot of bucket ``key.batch``: static shapes, no host syncs (graph-capturable)."""
        if self._hook is not None:
            self._hook()
        slots = state.slots[key.batch]
        ops = self._step_plan(view, key.batch)
        kv, scale = key.kv_len, view.head_dim**-0.5

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, LoraInputs]:
            k_cache, v_cache = state.k[i, : key.batch, :, :kv], state.v[i, : key.batch, :, :kv]
            args = AttentionArgs(state.cos, state.sin, slots.pos, k_cache, v_cache, scale)
            return ops.layers[i].attention(q, k, v, args)

        logits = view.lm_head(step_plan.run_layers(ops, view.embed(slots.tokens), attend))
        if key.forced:
            tok, lp = self._forced_tokens(logits, slots.row_id, state.step)
        else:
            tok, lp = self._sample(ops, logits, state, key.greedy, key.filtered, slots.row_id)
        self._finish_step(ops, state, slots, tok, lp)

    def _step_plan(self, view: ModelView, batch: int) -> step_plan.StepPlan:
        """The decode ops of bucket ``batch`` for this generation's model view, built at their first use."""
        ops = self._step_plans.get(batch)
        if ops is None:
            ops = self._step_plans[batch] = step_plan.build(view, batch, decode=True)
        return ops

    def _sample(
        self,
        ops: step_plan.StepPlan,
        logits: torch.Tensor,
        state: State,
        greedy: bool,
        filtered: bool,
        row_id: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sampling.sample`` with the state's knobs: the plan's sampling kernel (``ops.sample``) where nothing
        beyond temperature shapes the distribution (its draws come from ``state.seed``, which ``_prepare`` takes
        from the engine's generator, so a seed still fixes the tokens), else the torch ops, after ``adjust_logits``
        with the rows' token history (``row_id``: their output rows)."""
        if not filtered and ops.sample is not None:
            return ops.sample(logits, state.temperature, state.seed, state.step, greedy)
        if not filtered:
            return sample(logits, state.temperature, generator=self._gen, greedy=greedy, filtered=False)
        banned = state.stop_mask & (state.step < state.min_tokens)
        logits = adjust_logits(logits, state.seen[row_id], state.penalty, banned)
        tok, lp = sample(
            logits,
            state.temperature,
            state.top_k,
            state.top_p,
            self._gen,
            min_p=state.min_p,
            greedy=greedy,
            filtered=True,
        )
        # A device-side True: ``seen[row_id, tok] = True`` would copy a host scalar in, which graph capture refuses.
        state.seen.index_put_((row_id, tok), torch.ones_like(tok, dtype=torch.bool))
        return tok, lp

    def _forced_tokens(
        self, logits: torch.Tensor, row_id: torch.Tensor, step: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: record ``logits`` for the rows at ``step``; the given tokens, log-prob 0."""
        forced_tok, forced_logits = self._forced
        forced_logits[row_id, step] = logits.float()
        return forced_tok[row_id, step], torch.zeros(row_id.shape[0], device=logits.device)

    def _finish_step(
        self, ops: step_plan.StepPlan, state: State, slots: Slots, tok: torch.Tensor, lp: torch.Tensor
    ) -> None:
        """Record the step (pad / 0 for finished rows), mark stop tokens, feed tokens back, advance."""
        books = StepBooks(
            slots.done,
            slots.row_id,
            state.stop,
            state.step,
            slots.tokens,
            slots.pos,
            state.out_tok,
            state.out_lp,
            self.pad_id,
        )
        ops.finish(tok, lp, books)

    def _graphed(self, view: ModelView) -> bool:
        """Whether decode steps are captured and replayed (else run eagerly)."""
        return self.cuda_graphs and view.device.type == "cuda"

    def _run_step(self, view: ModelView, state: State, key: StepKey) -> None:
        if not self._graphed(view):
            self._decode_step(view, state, key)
            return
        replay = self._graphs.get(key)
        if replay is None:
            replay = self._graphs[key] = self._capture(view, state, key)
        replay()

    def _capture(self, view: ModelView, state: State, key: StepKey) -> Callable[[], None]:
        """Warm the step up (its side effects undone), then record it; returns the replay."""
        slots = state.slots[key.batch]
        # Everything a step changes that a later step reads: the token history too (the repetition penalty's),
        # else the warm-up's tokens would count as seen and a seed would not fix the tokens of a first generation.
        touched = (slots.tokens, slots.pos, slots.done, state.step, state.seen)
        saved = [t.clone() for t in touched]
        # Warm up on a scratch generator: set_state() on the real one would swap the state object
        # that earlier graphs were registered with, and they would stop following manual_seed();
        # drawing from it would shift this generation's random stream.
        real_gen, self._gen = self._gen, torch.Generator(device=view.device)
        try:
            with side_stream(view.device):
                for _ in range(2):  # compiles/autotunes Triton kernels, creates cuBLAS handles
                    self._decode_step(view, state, key)
        finally:
            self._gen = real_gen
        for buf, value in zip(touched, saved, strict=True):
            buf.copy_(value)
        return self._record(lambda: self._decode_step(view, state, key))

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Capture ``step`` as a CUDA graph (reading every tensor by address) and return its replay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self._gen)
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        return graph.replay

    def _compact(self, state: State, slots: Slots, live: torch.Tensor, kv_len: int) -> tuple[int, Slots]:
        """Move the live rows (and their cache rows) to the front of a smaller bucket."""
        n_live = live.numel()
        b = bucket(n_live)
        state.k[:, :n_live, :, :kv_len] = state.k[:, live, :, :kv_len]
        state.v[:, :n_live, :, :kv_len] = state.v[:, live, :, :kv_len]
        new = state.slots_for(b)
        done = torch.zeros(n_live, dtype=torch.bool, device=live.device)
        new.load(self.pad_id, state.trash, slots.tokens[live], slots.pos[live], done, slots.row_id[live])
        return b, new

    # ------------------------------------------------------------------ output

    def _collect(self, state: State, rows: int, steps: int, n: int, params: SamplingParams) -> RolloutOutput:
        toks = state.out_tok[:rows, :steps].cpu()
        lps = state.out_lp[:rows, :steps].cpu()
        stop = set(params.stop_token_ids)
        completions, logprobs, reasons = [], [], []
        for i in range(rows):
            length, reason = trim_completion(toks[i].tolist(), stop, params.max_new_tokens)
            completions.append(toks[i, :length].tolist())
            logprobs.append(lps[i, :length].tolist())
            reasons.append(reason)
        return RolloutOutput(completions, logprobs, reasons, [i // n for i in range(rows)])
