"""Native and HF rollout engines on tiny random Llama/Qwen2 models (CPU, fp32; GPU tests marked gpu)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from peft import get_peft_model
from tiny_models import nvfp4_lora, tiny_llama, tiny_model, tiny_qwen2
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.load.linear import stack_fused_groups
from qerl.load.lora import lora_config
from qerl.rollout import SamplingParams, get_engine
from qerl.rollout.native import NativeEngine
from qerl.rollout.sampling import processed_logprobs
from qerl.rollout.vllm_engine import request_seeds
from qerl.train.aqn import draw_seed

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [1], [40, 41, 42, 43]]


def greedy(n_tokens: int = 64, stop: list[int] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n_tokens, stop_token_ids=stop or [])


MODELS = {
    "llama": lambda: tiny_llama(),
    "qwen2_bias_tied": lambda: tiny_qwen2(),
    "llama_nvfp4_lora": lambda: nvfp4_lora(tiny_llama(2)),
    "qwen2_nvfp4_lora": lambda: nvfp4_lora(tiny_qwen2(3)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_native_greedy_equals_transformers(name: str) -> None:
    model = MODELS[name]()
    ref = get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(), n=2)
    out = get_engine(model, 0, kind="native").generate(PROMPTS, greedy(), n=2)
    assert out.completion_ids == ref.completion_ids
    assert all(len(c) == 64 for c in out.completion_ids)
    assert len({tuple(c) for c in out.completion_ids}) >= 3  # not a degenerate model
    flat = [abs(a - b) for la, lb in zip(out.logprobs, ref.logprobs, strict=True) for a, b in zip(la, lb, strict=True)]
    assert max(flat) < 1e-4
    assert out.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]


def test_stop_tokens_and_finish_reasons_match_transformers() -> None:
    model = tiny_qwen2(4)
    free = get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(40))
    # Stop ids that appear mid-way in some greedy completions and never in others.
    stop = [free.completion_ids[0][10], free.completion_ids[1][25]]
    ref = get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(40, stop))
    engine = NativeEngine(model, 0, check_every=4)
    out = engine.generate(PROMPTS, greedy(40, stop))
    assert out.completion_ids == ref.completion_ids
    assert out.finish_reasons == ref.finish_reasons
    assert "stop" in out.finish_reasons and "length" in out.finish_reasons
    for ids, reason in zip(out.completion_ids, out.finish_reasons, strict=True):
        early = [t for t in ids[:-1] if t in stop]
        assert not early
        assert (reason == "stop") == (ids[-1] in stop)
        assert reason == "stop" or len(ids) == 40


def test_finished_rows_are_compacted_and_all_done_stops_early() -> None:
    model = tiny_llama(5)
    prompts = [[i + 3, i + 7, 2 * i + 1] for i in range(9)]
    free = get_engine(model, 0, kind="hf").generate(prompts, greedy(48))
    stop = sorted({c[4] for c in free.completion_ids})  # every row stops within 5 tokens
    ref = get_engine(model, 0, kind="hf").generate(prompts, greedy(48, stop))
    engine = NativeEngine(model, 0, check_every=2)
    out = engine.generate(prompts, greedy(48, stop))
    assert out.completion_ids == ref.completion_ids
    assert engine.last_stats["final_bucket"] < 16  # started in bucket 16 (9 rows)
    assert all(r == "stop" for r in ref.finish_reasons)
    assert engine.last_stats["decode_steps"] < 47  # the loop ended once every row was done


def test_sampled_logprobs_match_full_forward() -> None:
    """Logprobs from the engine vs a teacher-forced forward of prompt+completion through the model."""
    model = nvfp4_lora(tiny_qwen2(6))
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=32, seed=3)
    out = get_engine(model, 0, kind="native").generate(PROMPTS[:2], params, n=3)
    worst = 0.0
    for ids, lps, pi in zip(out.completion_ids, out.logprobs, out.prompt_index, strict=True):
        prompt = PROMPTS[pi]
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(prompt) - 1 : -1]
        sorted_lp, order = processed_logprobs(logits, params.temperature, params.top_k, params.top_p)
        ref = sorted_lp.gather(-1, torch.argsort(order, -1)).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.isfinite(ref).all()
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    assert worst < 1e-4, worst  # fp32: only summation-order differences


def test_sampling_seeded_and_hf_distribution_agrees() -> None:
    model = tiny_llama(7)
    engine = get_engine(model, 0, kind="native")
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)
    a = engine.generate(PROMPTS, params, n=2)
    b = engine.generate(PROMPTS, params, n=2)
    c = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=12), n=2)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids


def test_lora_and_norm_updates_are_seen_by_next_generate() -> None:
    model = nvfp4_lora(tiny_llama(8))
    engine = get_engine(model, 0, kind="native")
    before = engine.generate(PROMPTS, greedy(32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)  # an optimizer-like in-place update
    after_lora = engine.generate(PROMPTS, greedy(32))
    assert after_lora.completion_ids != before.completion_ids
    assert after_lora.completion_ids == get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(32)).completion_ids
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name and "input_layernorm" in name:
                p.add_(torch.randn_like(p) * 0.5)  # AQN-style in-place noise on the trained norms
    after_norm = engine.generate(PROMPTS, greedy(32))
    assert after_norm.completion_ids != after_lora.completion_ids
    assert after_norm.completion_ids == get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(32)).completion_ids


def test_release_frees_the_cache_and_the_next_generate_rebuilds_it() -> None:
    """``release`` (the trainer's ``free_rollout_memory``) drops the KV cache, graphs and view; the next generation
    builds them again and gives the same tokens, with the step hook still installed."""
    model = nvfp4_lora(tiny_llama(8))
    engine = NativeEngine(model, 0)
    assert engine.view is None
    calls = []
    engine.set_step_hook(lambda: calls.append(1))
    before = engine.generate(PROMPTS, greedy(24), n=2)
    assert engine.view is not None and calls
    engine.release()
    assert engine.view is None and not engine.graphs
    hooked = len(calls)
    assert engine.generate(PROMPTS, greedy(24), n=2).completion_ids == before.completion_ids
    assert engine.view is not None and len(calls) > hooked


def test_step_hook_runs_every_decode_step() -> None:
    model = tiny_llama(9)
    engine = NativeEngine(model, 0)
    calls = []
    engine.set_step_hook(lambda: calls.append(1))
    engine.generate(PROMPTS, greedy(10))
    assert len(calls) == 1 + 9  # once before prefill, then each of the 9 decode steps


def graph_free_capture(engine: NativeEngine) -> NativeEngine:
    """Run the engine's capture/replay bookkeeping on CPU: the warm-up is the real one, and "recording"
    keeps the step closure, so a replay reads the objects bound at capture, as a CUDA graph reads the
    addresses it captured."""
    engine._graphed = lambda plan: True
    engine._record = lambda step: step
    return engine


def test_capture_bookkeeping_replays_like_eager() -> None:
    """Seeded sampling, compaction and a LoRA update through captured steps (CPU stand-in for graphs)."""
    model = nvfp4_lora(tiny_llama(13))
    prompts = [[i + 3, i + 7, 2 * i + 1] for i in range(9)]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, seed=5)
    eager = NativeEngine(model, 0, check_every=2)
    graphed = graph_free_capture(NativeEngine(model, 0, check_every=2))
    a = graphed.generate(prompts, sampled)
    replays = dict(graphed.graphs)
    assert replays
    b = graphed.generate(prompts, sampled)
    ref = eager.generate(prompts, sampled)
    assert a.completion_ids == b.completion_ids == ref.completion_ids
    assert a.logprobs == b.logprobs == ref.logprobs
    assert all(graphed.graphs[k] is r for k, r in replays.items())  # replayed, not recaptured

    free = get_engine(model, 0, kind="hf").generate(prompts, greedy(24))
    stop = sorted({c[4] for c in free.completion_ids[:6]})
    hf = get_engine(model, 0, kind="hf").generate(prompts, greedy(24, stop))
    assert graphed.generate(prompts, greedy(24, stop)).completion_ids == hf.completion_ids
    assert graphed.last_stats["final_bucket"] < 16  # compacted into smaller (freshly captured) buckets

    signature = graphed.signature
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)  # an optimizer-like in-place update
    replays = dict(graphed.graphs)
    out = graphed.generate(prompts, greedy(24, stop))
    assert out.completion_ids == get_engine(model, 0, kind="hf").generate(prompts, greedy(24, stop)).completion_ids
    assert out.completion_ids != hf.completion_ids
    assert graphed.signature == signature  # LoRA buffers were refreshed in place, not reallocated
    assert all(graphed.graphs[k] is r for k, r in replays.items() if k in graphed.graphs)


def test_bad_inputs_have_clear_errors() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="kind"):
        get_engine(model, 0, kind="tensorrt")
    with pytest.raises(ValueError, match="prompt_ids"):
        get_engine(model, 0, kind="native").generate([[]], greedy(4))
    with pytest.raises(ValueError, match="tokenizer_or_pad_id"):
        get_engine(model, "pad", kind="hf")


def test_vllm_request_seeds_fit_int64_for_every_trainer_seed() -> None:
    """vLLM stores each request's ``seed + j`` (j < n) as int64: the trainer's 63-bit draws (``aqn.draw_seed``)
    must land there, distinct per prompt and sample."""
    n, prompts = 16, 64
    for seed in (0, 5, 2**63 - 1, draw_seed(2**31 - 1, 10**6, 7), 6893945078351461698816014):
        seeds = request_seeds(seed, prompts, n)
        streams = {s + j for s in seeds for j in range(n)}
        assert len(streams) == prompts * n
        assert 0 <= min(streams) and max(streams) < 2**63
    assert request_seeds(None, 3, 4) == [None] * 3
    assert request_seeds(9, 2, 4) == request_seeds(9, 2, 4)


def test_vllm_engine_missing_vllm_is_a_clear_error() -> None:
    pytest.importorskip("peft")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="kind='vllm' needs vLLM"):
            get_engine(tiny_llama(), 0, kind="vllm", checkpoint="unused")
    else:
        pytest.skip("vllm is installed here")


#: Every setting that takes the engine's filtered (torch) sampling path, and the fused one.
SAMPLING_SETTINGS = {
    "temperature": dict(temperature=0.9),
    "top_p": dict(temperature=0.9, top_p=0.95),
    "top_k": dict(temperature=0.9, top_k=20),
    "min_p": dict(temperature=0.9, min_p=0.05),
    "penalty": dict(temperature=0.9, repetition_penalty=1.3),
    "min_tokens": dict(temperature=0.9, min_tokens=8, stop_token_ids=[3]),
    "greedy_penalty": dict(temperature=0.0, repetition_penalty=1.3),
}


class HostData(TorchDispatchMode):
    """Records the ops that build a tensor from host data (``torch.tensor(...)``, ``t[i] = True``): on CUDA each is
    a copy from pageable host memory, which CUDA-graph capture refuses. CPU tensors show the same ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setting", list(SAMPLING_SETTINGS))
def test_decode_step_takes_no_host_data(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step the engine captures as a CUDA graph, traced on CPU: no op in it brings host data in."""
    engine = NativeEngine(tiny_llama(10), 0)
    step = engine._decode_step
    seen = HostData()

    def traced(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with seen:
            return step(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_step", traced)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=3, **SAMPLING_SETTINGS[setting]), n=2)
    assert all(len(c) == 12 or c[-1] == 3 for c in out.completion_ids)
    assert seen.ops == [], f"{setting}: {seen.ops[:3]} in the decode step"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_graph_greedy_equals_transformers_fp32(name: str) -> None:
    model = MODELS[name]().cuda()
    ref = get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(), n=2)
    # fp32 NVFP4 runs qerl.nvfp4's reference dequantize eagerly here: its E2M1 table is now cached per
    # device, so it could be captured, but that path has not been run on a GPU yet. bf16 NVFP4 (the
    # kernels) is graphed below.
    graphs = "nvfp4" not in name
    engine = NativeEngine(model, 0, cuda_graphs=graphs)
    out = engine.generate(PROMPTS, greedy(), n=2)
    assert engine.last_stats["graphs"] >= int(graphs)
    assert out.completion_ids == ref.completion_ids


@pytest.mark.gpu
@gpu
def test_gpu_graph_sampling_is_seeded_and_sees_lora_updates() -> None:
    model = get_peft_model(tiny_llama(10), lora_config(r=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model = model.cuda()
    engine = NativeEngine(model, 0)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, seed=5)
    a = engine.generate(PROMPTS, params, n=4)
    b = engine.generate(PROMPTS, params, n=4)
    assert a.completion_ids == b.completion_ids
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    graphs = dict(engine.graphs)
    out = engine.generate(PROMPTS, greedy(32))
    assert out.completion_ids == get_engine(model, 0, kind="hf").generate(PROMPTS, greedy(32)).completion_ids
    assert all(engine.graphs[k] is g for k, g in graphs.items() if k in engine.graphs)  # no recapture


@pytest.mark.gpu
@gpu
def test_gpu_release_gives_the_cache_back_and_the_next_generate_captures_anew() -> None:
    """On CUDA, ``release`` gives the KV cache and the graphs' memory back to the allocator (what the training pass
    can then use) and the next generation captures again, with the same greedy tokens."""
    model = get_peft_model(tiny_llama(10), lora_config(r=4)).eval().cuda()
    engine = NativeEngine(model, 0)
    before = engine.generate(PROMPTS, greedy(40), n=4)
    held = torch.cuda.memory_allocated()
    engine.release()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() < held and not engine.graphs
    assert engine.generate(PROMPTS, greedy(40), n=4).completion_ids == before.completion_ids
    assert engine.graphs  # captured anew


@pytest.mark.parametrize("setting", list(SAMPLING_SETTINGS))
def test_capture_warm_up_leaves_no_trace(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph capture's warm-up steps (run here on CPU, the "graph" replaying the step eagerly) change nothing a later
    step reads: a seeded first generation, which captures, draws what a second one, which only replays, draws, and
    what an engine without graphs draws."""
    engine = NativeEngine(tiny_llama(10), 0)
    monkeypatch.setattr(engine, "_graphed", lambda plan: True)
    monkeypatch.setattr(engine, "_record", lambda step: step)
    params = SamplingParams(max_new_tokens=16, seed=7, **SAMPLING_SETTINGS[setting])
    first = engine.generate(PROMPTS, params, n=2).completion_ids
    assert engine.graphs
    assert engine.generate(PROMPTS, params, n=2).completion_ids == first
    assert NativeEngine(tiny_llama(10), 0).generate(PROMPTS, params, n=2).completion_ids == first


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("setting", list(SAMPLING_SETTINGS))
def test_gpu_every_sampling_setting_is_captured_and_seeded(setting: str) -> None:
    """Each sampling setting runs as CUDA graphs, and a seed fixes its tokens."""
    engine = NativeEngine(tiny_llama(10).cuda(), 0)
    params = SamplingParams(max_new_tokens=24, seed=7, **SAMPLING_SETTINGS[setting])
    a = engine.generate(PROMPTS, params, n=2)
    assert engine.last_stats["graphs"] >= 1
    assert engine.generate(PROMPTS, params, n=2).completion_ids == a.completion_ids


def test_teacher_forced_logits_match_full_forward_cpu() -> None:
    model = nvfp4_lora(tiny_qwen2(11))
    completions = [[3, 9, 27, 81, 243 % 256, 17], [100, 101, 102], [7] * 10, [55, 66]]
    got = NativeEngine(model, 0).teacher_forced_logits(PROMPTS, completions)
    for prompt, comp, logits in zip(PROMPTS, completions, got, strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt + comp])).logits[0, len(prompt) - 1 : -1]
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4


def medium_model(nvfp4: bool, seed: int = 12, stacked: bool = False, **shape: int) -> nn.Module:
    """A bf16 Qwen2 with 7B-like head shapes (head_dim 128, GQA 7:1), small enough for a test;
    ``stacked``: one global scale per q/k/v and gate/up group, stacked on the device as the loader does;
    ``shape`` overrides config sizes."""
    sizes = dict(hidden_size=896, intermediate_size=2432, num_attention_heads=7, num_key_value_heads=1) | shape
    model = tiny_model(
        "qwen2",
        seed,
        vocab_size=4096,
        num_hidden_layers=4,
        head_dim=128,
        max_position_embeddings=2048,
        rope_theta=1e6,
        tie_word_embeddings=True,
        **sizes,
    )
    # Cast before quantizing: Module.to(dtype) would also cast the fp8 scales and fp32 global scales.
    model = model.to(torch.bfloat16).eval()
    if nvfp4:
        peft_model = nvfp4_lora(model, group_scales=stacked)
        with torch.no_grad():  # trained-LoRA magnitudes (|A|,|B| ~ 0.03), not the stress-test 0.3
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.mul_(0.1)
        peft_model = peft_model.to("cuda" if torch.cuda.is_available() else "cpu")
        if stacked:
            assert stack_fused_groups(peft_model) == 8
        return peft_model
    peft_model = get_peft_model(model, lora_config(r=16)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft_model.to("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "nvfp4,fp32_norms,stacked",
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True)],
    ids=["bf16_lora", "nvfp4_lora", "fp32_norms", "nvfp4_lora_stacked"],
)
def test_gpu_teacher_forced_logits_bf16(nvfp4: bool, fp32_norms: bool, stacked: bool) -> None:
    """Bound: max |native - HF forward| over every completion position <= 5% of max |logit|.

    bf16 rounding of different (but each reasonable) op orders: fused kernels vs HF's SDPA path.
    ``fp32_norms``: the trained norm copies stored in fp32 as QeRLTrainer keeps them on a bf16 model.
    ``stacked``: q/k/v and gate/up as one FP4 launch each (``decoder.stacked_forward``).
    """
    model = medium_model(nvfp4, stacked=stacked)
    if fp32_norms:
        from qerl.train.trainer import keep_trainable_fp32

        assert any("norm" in name for name in keep_trainable_fp32(model))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (17, 250, 64)]
    completions = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (300, 40, 129)]
    engine = NativeEngine(model, 0)
    got = engine.teacher_forced_logits(prompts, completions)
    assert engine.last_stats["graphs"] >= 1
    if stacked:
        assert all(g.stacked is not None for layer in engine.view.layers for g in (layer.qkv, layer.gate_up))
    worst, scale = 0.0, 0.0
    for prompt, comp, logits in zip(prompts, completions, got, strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt + comp], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        worst = max(worst, (logits - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    print(f"teacher-forced {'nvfp4' if nvfp4 else 'bf16'}+LoRA: max|dlogit|={worst:.4f}, max|logit|={scale:.3f}")
    assert worst <= 0.05 * scale


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("kernel,rows", [("gluon", 40), ("gluon", 20), ("gluon", 12), ("direct", 6)])
def test_gpu_gluon_k_decode(kernel: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches above ``GLUON_MIN_M`` (the TMA/wgmma kernel; at 12 rows too, with ``GLUON_MIN_WEIGHTS``
    lowered to this small model's GEMMs) or of at most ``DIRECT_MAX_M`` rows (the
    mma.sync kernel) on a model whose GEMM inputs are whole 256-code K steps run every decode GEMM on that
    Gluon kernel with x already in its K order (written so by the producing norm / attention / SiLU kernels;
    the LoRA shrinks fused into them at 6 and 20 rows, through ``lora_a_gluon_k`` at 40): no per-call permute, and
    the logits match the Triton-kernel engine's (<= 1% of max |logit|) and HF's forward (<= 5%)."""
    from qerl.kernels import fp4_direct, fp4_gluon
    from qerl.kernels import schedule as sch

    module, switch = (fp4_gluon, "gluon_decode") if kernel == "gluon" else (fp4_direct, "direct_decode")
    monkeypatch.setattr(sch, "GLUON_MIN_WEIGHTS", 0)
    model = medium_model(
        True, stacked=True, hidden_size=1024, intermediate_size=2560, num_attention_heads=8, num_key_value_heads=2
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 4096, (int(n),), generator=gen).tolist() for n in torch.randint(5, 40, (rows,), generator=gen)
    ]
    completions = [torch.randint(0, 4096, (12,), generator=gen).tolist() for _ in prompts]
    calls: list[bool] = []

    def counted(*args, _f=module.matmul, **kwargs):
        calls.append(kwargs.get("gluon_k", kernel == "direct"))  # fp4_gemm sends the direct kernel permuted x only
        return _f(*args, **kwargs)

    monkeypatch.setattr(module, "matmul", counted)
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, **{switch: True}))
    got = NativeEngine(model, 0).teacher_forced_logits(prompts, completions)
    n = len(calls)  # 4 layers x (qkv, o, gate_up, down) per warm-up or capture of a step graph
    assert n and n % 16 == 0 and all(calls), calls
    monkeypatch.setattr(sch, "SWITCHES", replace(sch.SWITCHES, **{switch: False}))
    base = NativeEngine(model, 0).teacher_forced_logits(prompts, completions)
    assert len(calls) == n
    worst = max((g - b).abs().max().item() for g, b in zip(got, base, strict=True))
    scale = max(b.abs().max().item() for b in base)
    assert worst <= 0.01 * scale, (worst, scale)
    for i in (0, rows // 2, rows - 1):
        with torch.no_grad():
            ids = torch.tensor([prompts[i] + completions[i]], device="cuda")
            ref = model(input_ids=ids).logits[0, len(prompts[i]) - 1 : -1].float()
        assert (got[i] - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_repetition_penalty_and_min_tokens_match_transformers() -> None:
    """The native engine applies transformers' definitions: the penalty over prompt and completion
    tokens, stop tokens banned below ``min_tokens``. One prompt per call, so transformers' left padding
    (whose pad ids its penalty would count) plays no part."""
    model = tiny_qwen2(4)
    free = get_engine(model, 0, kind="hf").generate(PROMPTS[:1], greedy(40))
    for params in (
        SamplingParams(temperature=0.0, max_new_tokens=40, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, max_new_tokens=40, repetition_penalty=0.7),
        # the greedy path's 3rd token as a stop token: without min_tokens it would end the completion at 3
        SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[free.completion_ids[0][2]], min_tokens=12),
    ):
        for prompt in PROMPTS[:2]:
            ref = get_engine(model, 0, kind="hf").generate([prompt], params)
            out = NativeEngine(model, 0, check_every=4).generate([prompt], params, n=2)
            assert out.completion_ids == ref.completion_ids * 2, params
    base = NativeEngine(model, 0).generate(PROMPTS[:1], greedy(40)).completion_ids[0]
    penalised = (
        NativeEngine(model, 0)
        .generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=40, repetition_penalty=1.8))
        .completion_ids[0]
    )
    assert penalised != base  # the penalty changed this greedy path
    stop = [free.completion_ids[0][2]]
    early = NativeEngine(model, 0).generate(PROMPTS[:1], greedy(40, stop)).completion_ids[0]
    late = (
        NativeEngine(model, 0)
        .generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=stop, min_tokens=12))
        .completion_ids[0]
    )
    assert len(early) <= 3 and len(late) > 12 and stop[0] not in late[:12]


def test_min_p_one_keeps_only_the_most_likely_token() -> None:
    """min_p = 1 keeps exactly the tokens as likely as the best one: sampling at any temperature is then greedy."""
    model = tiny_llama()
    ref = NativeEngine(model, 0).generate(PROMPTS, greedy(24), n=2)
    out = NativeEngine(model, 0).generate(
        PROMPTS, SamplingParams(temperature=1.5, max_new_tokens=24, min_p=1.0, seed=3), n=2
    )
    assert out.completion_ids == ref.completion_ids
    assert all(lp == 0.0 for row in out.logprobs for lp in row)  # a one-token distribution
