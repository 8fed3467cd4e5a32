"""Rollout decode speed: qerl's native engine vs transformers' generate, beside the bandwidth floor.

What it measures (one process, one GPU, random weights of real shapes):

* ``native nvfp4+lora``: NativeEngine over NVFP4Linear layers + peft LoRA r=16 on all 7 projections
  (unmerged); ``native nvfp4`` the same with the adapter disabled (LoRA overhead);
* ``native bf16+lora``: NativeEngine over bf16 nn.Linear + the same LoRA;
* ``hf bf16+lora``: transformers ``generate`` on the bf16+LoRA model (fewer tokens: it is slow);
* ``hf nf4+lora`` (``--bnb``, 7B, b=1/8): the same over bitsandbytes NF4 ``Linear4bit`` layers (QLoRA's
  usual rollout path);
* ``vllm nvfp4+lora`` / ``vllm bf16+lora``: rows measured by benchmarks/rollout_vllm.py (its own
  processes, same method) and merged with ``--vllm-rows``; the summary's ``over_vllm_*`` ratios come
  from them.

Each prompt is 256 random tokens; 1024 tokens are generated with no stop token (forced length),
temperature 1. ms/step = (time of a 1024-token generate - time of a 1-token generate) / 1023,
both after a warm-up generate of the same shape (graph capture and Triton compilation excluded).
The floor is (weight bytes + LoRA bytes + mean KV bytes read per step) / the device-to-device copy
bandwidth measured in the same run.

``--lora-sweep`` measures only the LoRA cost on the 7B NVFP4 model, at b = 1/8/64: ms/step and GPU
launches per decode step (kernels + memcpy/memset of an eager step, i.e. the nodes its CUDA graph
holds) for LoRA with shrinks fused into the producing kernels, LoRA with one cuBLAS shrink per group
(``ops.FUSED_LORA_MAX_ROWS = 0``: the previous design), and LoRA disabled.

    python benchmarks/rollout.py --out $OUT/rollout.json            # on the GPU
    python benchmarks/rollout.py --lora-sweep --tokens 256 --out $OUT/rollout_lora.json
    python benchmarks/rollout.py --plot benchmarks/results/rollout.json  # PNG beside the JSON
    python benchmarks/rollout.py --out $OUT/rollout.json --vllm-rows $OUT/rollout_vllm.json
    python benchmarks/rollout.py --merge-into rollout.json --vllm-rows rollout_vllm.json --out merged.json
    python benchmarks/rollout.py --bnb-only --shapes 7b --out $OUT/rollout_bnb.json  # merge it like vLLM rows
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

# The repo root in, this folder out: benchmarks/kernels.py would shadow the ``kernels`` package that
# transformers probes (so importing qerl from here failed on machines without Triton).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, _HERE.parent)]

from qerl.fsutil import atomic_file, atomic_write_text  # noqa: E402

SHAPES = {
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
    "32b": dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8
    ),
}
VOCAB = 152064
DEVICE = "cuda"
PROMPT = 256
#: vLLM 0.26 NVFP4(Marlin)+LoRA r16 decode ms/step measured EARLIER on this H200 (issue 4), not in this run.
EARLIER_VLLM_NVFP4_LORA_MS = {("7b", 1): 4.94, ("7b", 8): 4.88, ("7b", 64): 8.25, ("32b", 8): 14.7}


def build_model(shape: str, nvfp4: bool, lora_r: int = 16, seed: int = 0) -> nn.Module:
    """A random Qwen2 of ``shape`` on the GPU (bf16 or NVFP4 decoder Linears) wrapped in peft LoRA."""
    return with_lora(random_qwen2(shape, nvfp4, seed), lora_r)


def random_qwen2(shape: str, nvfp4: bool, seed: int = 0) -> nn.Module:
    """A random Qwen2 of ``shape`` on the GPU, decoder Linears bf16 or NVFP4 (no adapter)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False, **SHAPES[shape]
    )
    return random_causal_lm(Qwen2ForCausalLM, cfg, nvfp4, torch.device(DEVICE), torch.bfloat16, seed).eval()


def random_causal_lm(
    model_cls: type, cfg: object, nvfp4: bool, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """``model_cls(cfg)`` built straight on ``device`` (no dense copy of an NVFP4 model ever exists),
    decoder Linears as ``NVFP4Linear`` when ``nvfp4`` (lm_head stays ``dtype``, as in a real checkpoint),
    filled at random: FP4 codes uniform (never time on zeros), block scales in [0.25, 1.75), global
    scale 150 (weights of rms ~0.02), norms 1, everything else N(0, 0.02). Shared with grpo_step.py."""
    from qerl.linear import NVFP4Linear, replace_linears

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg)
            if nvfp4:
                replace_linears(
                    model, lambda name, lin: None if name == "lm_head" else NVFP4Linear.empty_like(lin, dtype)
                )
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=device, dtype=torch.uint8))
            elif t.dtype == torch.float8_e4m3fn:
                t.copy_((torch.rand(t.shape, generator=gen, device=device) * 1.5 + 0.25).to(t.dtype))
            elif name.endswith("weight_global_scale"):
                t.fill_(150.0)  # E2M1 rms 2.9 x scale ~1 / 150 -> weight rms ~0.02
            elif "norm" in name:
                t.fill_(1.0)
            elif "rotary" not in name:
                t.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):  # its inv_freq was left as meta's garbage by to_empty
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


def with_lora(model: nn.Module, lora_r: int = 16) -> nn.Module:
    """peft LoRA r on all seven projections, with a random (nonzero) B."""
    from peft import get_peft_model

    from qerl.lora import lora_config

    peft_model = get_peft_model(model, lora_config(r=lora_r)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    return peft_model


def build_bnb_model(shape: str, lora_r: int = 16, seed: int = 0) -> nn.Module:
    """The random bf16 Qwen2 with every decoder Linear as a bitsandbytes NF4 ``Linear4bit``, + peft LoRA."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        sys.exit("benchmarks/rollout.py: --bnb needs bitsandbytes (pip install bitsandbytes)")
    from qerl.linear import replace_linears

    def nf4(name: str, lin: nn.Linear) -> nn.Module | None:
        if name == "lm_head":
            return None
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")  # fmt: skip
        # Params4bit quantizes when moved to the GPU (the documented path), so hand it host data.
        q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4").to(DEVICE)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        return q

    model = random_qwen2(shape, nvfp4=False, seed=seed)
    replace_linears(model, nf4)
    model.is_loaded_in_4bit = True  # peft dispatches its bnb LoRA layer only for models marked so
    gc.collect()
    torch.cuda.empty_cache()
    return with_lora(model, lora_r)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of everything a decode step reads once except the embedding table, LoRA bytes in bf16)."""
    total = lora = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:
            continue
        if "lora_" in name:
            lora += t.numel() * 2  # the engine reads bf16 copies
        else:
            total += t.numel() * t.element_size()
    return total, lora


def copy_bandwidth() -> float:
    """The copy ceiling, bytes read + written per second, measured as benchmarks/kernels.py does
    (eager ``copy_`` and an SM copy kernel in a graph; the larger)."""
    spec = importlib.util.spec_from_file_location("qerl_bench_kernels", _HERE / "kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    return kernels.copy_bandwidth()["max"]


def kv_bytes_per_step(shape: str, batch: int, tokens: int) -> float:
    """Mean K+V bytes attention must read per decode step over a generation of ``tokens``."""
    s = SHAPES[shape]
    per_pos = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * 128 * 2
    return batch * per_pos * (PROMPT + tokens / 2)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ms_per_step(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(decode ms/step, prefill+1-token s) for ``engine`` after a warm-up of the same shape."""
    from qerl.rollout import SamplingParams

    full = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
    kv_block = getattr(engine, "kv_block", None)
    if kv_block is None:  # transformers: one warm-up run of the same shape
        engine.generate(prompts, full)
    else:
        # Capture every (batch, KV-length) graph the timed run needs with a few short generates whose
        # long prompts land in each KV bucket, largest first so the cache is sized once.
        total = len(prompts[0]) + tokens
        for end in range(-(-total // kv_block) * kv_block, len(prompts[0]), -kv_block):
            long = [(p * (end // len(p) + 1))[: end - 9] for p in prompts]
            engine.generate(long, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    # The timed prompts' own prefill shape may still compile kernels (the first variant of a run once
    # measured -0.4 ms/step because its t_one held a compile): run it once untimed.
    engine.generate(prompts, one)
    t_one = timed(lambda: engine.generate(prompts, one))
    out = []
    t_full = timed(lambda: out.append(engine.generate(prompts, full)))
    assert all(len(c) == tokens for c in out[0].completion_ids), "a completion stopped early"
    return (t_full - t_one) / (tokens - 1) * 1e3, t_one


def profile(args: argparse.Namespace) -> None:
    """Kernel-level GPU time of eager decode steps (7B NVFP4+LoRA, b=1 and b=8): where a step goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from qerl.rollout import SamplingParams
    from qerl.rollout.native import NativeEngine

    model = build_model("7b", nvfp4=True)
    engine = NativeEngine(model, 0, cuda_graphs=False)
    gen = torch.Generator().manual_seed(1)
    for b in (1, 8):
        prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        params = SamplingParams(temperature=1.0, max_new_tokens=9, seed=0)
        engine.generate(prompts, params)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
        print(f"--- 7b nvfp4+lora b={b}: GPU time of prefill + 8 eager decode steps", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()


def launches_per_step(model: nn.Module, prompts: list[list[int]], steps: int = 4) -> float:
    """GPU activities (kernels, memcpy, memset) per eager decode step: the nodes of its CUDA graph."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from qerl.rollout import SamplingParams
    from qerl.rollout.native import NativeEngine

    engine = NativeEngine(model, 0, cuda_graphs=False)

    def count(tokens: int) -> int:
        params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
        engine.generate(prompts, params)  # compiles first, and sizes the cache
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)

    # steps + 1 tokens = prefill + `steps` decode steps, none of them a host check (check_every=16).
    return (count(steps + 1) - count(1)) / steps


def lora_sweep(args: argparse.Namespace) -> dict:
    """7B NVFP4 at b=1/8/64: LoRA fused / LoRA via cuBLAS shrinks / LoRA disabled, in one process."""
    from qerl.rollout import ops
    from qerl.rollout.native import NativeEngine

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    model = build_model("7b", nvfp4=True)
    wbytes, lbytes = weight_bytes(model)
    fused_rows = ops.FUSED_LORA_MAX_ROWS
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for b in args.batches:
        prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        kv = kv_bytes_per_step("7b", b, args.tokens)
        for variant in ("lora_fused", "lora_cublas", "nolora"):
            ops.FUSED_LORA_MAX_ROWS = 0 if variant == "lora_cublas" else fused_rows
            try:
                with model.disable_adapter() if variant == "nolora" else contextlib.nullcontext():
                    engine = NativeEngine(model, 0)  # fresh graphs: the shrink placement is baked in
                    ms, t_one = ms_per_step(engine, prompts, args.tokens)
                    del engine
                    launches = launches_per_step(model, prompts)
            finally:
                ops.FUSED_LORA_MAX_ROWS = fused_rows
            gc.collect()
            torch.cuda.empty_cache()
            floor = (wbytes + (0 if variant == "nolora" else lbytes) + kv) / bw * 1e3
            rows.append(dict(shape="7b", engine="native", weights="nvfp4", variant=variant, lora=variant != "nolora",
                             batch=b, tokens=args.tokens, ms_per_step=round(ms, 4), launches_per_step=launches,
                             prefill_plus_1_s=round(t_one, 4), floor_ms=round(floor, 4)))  # fmt: skip
            write_partial(args, bw, rows)
            print(f"7b nvfp4 {variant:11s} b={b:3d}: {ms:8.3f} ms/step, {launches:6.1f} launches/step "
                  f"(floor {floor:.3f})", flush=True)  # fmt: skip
    by = {(r["variant"], r["batch"]): r["ms_per_step"] for r in rows}
    summary = {}
    for b in args.batches:
        off = by.get(("nolora", b))
        for variant in ("lora_fused", "lora_cublas"):
            on = by.get((variant, b))
            summary[f"{variant}_overhead_ms_b{b}"] = None if on is None or off is None else round(on - off, 4)
            summary[f"{variant}_share_b{b}"] = None if on is None or off is None else round((on - off) / on, 4)
    return {
        "benchmark": "rollout LoRA cost sweep (decode ms/step, launches/step)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **environment(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "setup": {
            "prompt_tokens": PROMPT,
            "new_tokens": args.tokens,
            "lora_r": 16,
            "temperature": 1.0,
            "weights": "random (real shapes)",
            "model": "Qwen2.5-7B shapes, NVFP4 decoder Linears",
            "fused_lora_max_rows": fused_rows,
        },  # fmt: skip
        "copy_bandwidth_tb_s": round(bw / 1e12, 3),
        "summary": summary,
        "results": rows,
    }


def run(args: argparse.Namespace) -> dict:
    from qerl.rollout import get_engine

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    for shape, batches in (("7b", (1, 8, 64, 128)), ("32b", (8, 1))):
        if shape not in args.shapes or args.bnb_only:
            continue
        for variant in ("nvfp4", "bf16"):
            model = build_model(shape, nvfp4=variant == "nvfp4")
            wbytes, lbytes = weight_bytes(model)
            native = get_engine(model, 0, kind="native")
            hf = get_engine(model, 0, kind="hf")
            for b in batches:
                prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
                kv = kv_bytes_per_step(shape, b, args.tokens)
                runs = [("native", True, native, args.tokens)]
                if variant == "nvfp4" and shape == "7b" and b in (1, 8):
                    runs.append(("native", False, native, args.tokens))
                if variant == "bf16" and not args.skip_hf:
                    runs.append(("hf", True, hf, args.hf_tokens))
                for engine_name, with_lora, engine, tokens in runs:
                    if with_lora:
                        ms, t_one = ms_per_step(engine, prompts, tokens)
                    else:
                        with model.disable_adapter():
                            ms, t_one = ms_per_step(engine, prompts, tokens)
                    floor = (wbytes + (lbytes if with_lora else 0) + kv) / bw * 1e3
                    row = dict(shape=shape, engine=engine_name, weights=variant, lora=with_lora, batch=b,
                               tokens=tokens, ms_per_step=round(ms, 4), prefill_plus_1_s=round(t_one, 4),
                               floor_ms=round(floor, 4), weight_gb=round(wbytes / 1e9, 3),
                               lora_gb=round(lbytes / 1e9, 4), kv_gb_mean=round(kv / 1e9, 3))  # fmt: skip
                    record(rows, row, bw, args)
            del native, hf, model
            gc.collect()
            torch.cuda.empty_cache()
    if (args.bnb or args.bnb_only) and "7b" in args.shapes:
        bnb_rows(rows, gen, bw, args)
    rows, env = with_extra_rows(rows, args.vllm_rows, environment())
    return build_result(rows, bw, args, env=env)


def record(rows: list[dict], row: dict, bw: float, args: argparse.Namespace) -> None:
    """Append a row, save the partial results (they survive a run cut off at its limit), print it."""
    rows.append(row)
    write_partial(args, bw, rows)
    print(f"{row['shape']} {row['engine']:6s} {row['weights']}+{'lora' if row['lora'] else 'nolora':6s} "
          f"b={row['batch']:3d}: {row['ms_per_step']:8.3f} ms/step (floor {row['floor_ms']:.3f}, "
          f"tokens {row['tokens']})", flush=True)  # fmt: skip


def bnb_rows(rows: list[dict], gen: torch.Generator, bw: float, args: argparse.Namespace) -> None:
    """7B bitsandbytes NF4 + LoRA through transformers generate, b = 1 and 8 (``--hf-tokens`` tokens)."""
    from qerl.rollout import get_engine

    model = build_bnb_model("7b")
    wbytes, lbytes = weight_bytes(model)  # packed NF4 codes; the absmax statistics are not counted
    engine = get_engine(model, 0, kind="hf")
    for b in (1, 8):
        prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        kv = kv_bytes_per_step("7b", b, args.hf_tokens)
        ms, t_one = ms_per_step(engine, prompts, args.hf_tokens)
        floor = (wbytes + lbytes + kv) / bw * 1e3
        record(rows, dict(shape="7b", engine="hf", weights="nf4", lora=True, batch=b, tokens=args.hf_tokens,
                          ms_per_step=round(ms, 4), prefill_plus_1_s=round(t_one, 4), floor_ms=round(floor, 4),
                          weight_gb=round(wbytes / 1e9, 3), lora_gb=round(lbytes / 1e9, 4),
                          kv_gb_mean=round(kv / 1e9, 3)), bw, args)  # fmt: skip
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()


#: (engine, weights) of rows that other calls of the same device session measure and merging adds:
#: vLLM (needs its 3-part bundle) and transformers + bitsandbytes NF4 (needs a 43 MB wheel).
MERGEABLE = {("vllm", "nvfp4"), ("vllm", "bf16"), ("hf", "nf4")}


def with_extra_rows(rows: list[dict], files: list[Path] | None, env: dict) -> tuple[list[dict], dict]:
    """``rows`` plus the rows other calls of the same device session measured (``MERGEABLE``: vLLM
    rows of benchmarks/rollout_vllm.py, transformers + NF4 rows of ``--bnb-only``), replacing same-key rows.

    Such a row's floor/bytes fields are taken from the native row of the same configuration (same
    bytes to read); the vLLM / bitsandbytes versions join ``env["versions"]``; each row keeps the
    date of the file it came from as ``measured`` (the document's own date is its native run's).
    """
    if not files:
        return rows, env
    key = ("shape", "weights", "lora", "batch", "tokens")
    merged = {tuple(r[k] for k in key) + (r["engine"],): r for r in rows}
    env = {**env, "versions": dict(env.get("versions") or {})}
    for path in files:
        try:
            data = json.loads(path.read_text())
            vrows = data["results"] if isinstance(data, dict) else data
            if not all(isinstance(r, dict) and (r.get("engine"), r.get("weights")) in MERGEABLE for r in vrows):
                raise ValueError("rows other than vLLM or transformers+NF4 rows")
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"benchmarks/rollout.py: --vllm-rows {path}: expected rollout_vllm.py's or a --bnb-only JSON ({e})")
        if isinstance(data, dict):
            for name in ("vllm", "bitsandbytes"):
                if (data.get("versions") or {}).get(name):
                    env["versions"][name] = data["versions"][name]
            if env.get("device") and data.get("device") and data["device"] != env["device"]:
                sys.exit(f"benchmarks/rollout.py: --vllm-rows {path} was measured on {data['device']}, "
                         f"not {env['device']}")  # fmt: skip
        for r in vrows:
            native = merged.get(tuple(r[k] for k in key) + ("native",))
            fill = {k: native[k] for k in ("floor_ms", "weight_gb", "lora_gb", "kv_gb_mean")} if native else {}
            stamp = {"measured": data["date"]} if isinstance(data, dict) and data.get("date") else {}
            merged[tuple(r[k] for k in key) + (r["engine"],)] = {**r, **{k: v for k, v in fill.items() if r.get(k) is None}, **stamp}
    return list(merged.values()), env


def environment() -> dict:
    import transformers

    from qerl.kernels import schedule

    return {
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            **({"bitsandbytes": sys.modules["bitsandbytes"].__version__} if "bitsandbytes" in sys.modules else {}),
        },
        # The NVFP4 decode schedules this run used (``QERL_DECODE_CONFIG``, or the code's per-BM defaults).
        "decode_config": str(schedule.ENV_DECODE or schedule.DECODE_BY_BM),
    }


def build_result(
    rows: list[dict], bw: float, args: argparse.Namespace, partial: str | None = None, env: dict | None = None
) -> dict:
    """The JSON document: environment, summary ratios (None where a row is missing), all rows."""

    def ms(shape: str, engine: str, weights: str, lora: bool, b: int) -> float | None:
        for r in rows:
            if (r["shape"], r["engine"], r["weights"], r["lora"], r["batch"]) == (shape, engine, weights, lora, b):
                return r["ms_per_step"]
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a / b, 3)

    def over_vllm(shape: str, b: int) -> float | None:
        """vLLM NVFP4+LoRA ms / native NVFP4+LoRA ms, both from this run's rows (None without them)."""
        return ratio(ms(shape, "vllm", "nvfp4", True, b), ms(shape, "native", "nvfp4", True, b))

    nv = {(s, b): ms(s, "native", "nvfp4", True, b) for s, b in EARLIER_VLLM_NVFP4_LORA_MS}
    lora1, nolora1 = ms("7b", "native", "nvfp4", True, 1), ms("7b", "native", "nvfp4", False, 1)
    summary = {
        "nvfp4_lora_b1_ms": ms("7b", "native", "nvfp4", True, 1),
        "over_vllm_nvfp4_lora_b1": over_vllm("7b", 1),
        "over_vllm_nvfp4_lora_b8": over_vllm("7b", 8),
        "over_vllm_nvfp4_lora_b64": over_vllm("7b", 64),
        "over_vllm_nvfp4_lora_b128": over_vllm("7b", 128),
        "over_vllm_nvfp4_lora_32b_b8": over_vllm("32b", 8),
        "nvfp4_over_bf16_b8": ratio(ms("7b", "native", "bf16", True, 8), ms("7b", "native", "nvfp4", True, 8)),
        "lora_overhead_b1": None if lora1 is None or nolora1 is None else round((lora1 - nolora1) / lora1, 4),
        "over_hf_generate_bf16_lora_b1": ratio(ms("7b", "hf", "bf16", True, 1), lora1),
        "over_hf_generate_nf4_lora_b1": ratio(ms("7b", "hf", "nf4", True, 1), lora1),
    }
    same_run_vllm = any(r["engine"] == "vllm" for r in rows)
    earlier = {
        "note": "vLLM 0.26 NVFP4+LoRA r16 ms/step measured EARLIER on this H200 (given in issue 4), NOT in this run"
        + ("; context only: the summary's over_vllm_* use this run's vLLM rows" if same_run_vllm else ""),
        "vllm_ms": {f"{s}_b{b}": v for (s, b), v in EARLIER_VLLM_NVFP4_LORA_MS.items()},
        "over_earlier_vllm": {f"{s}_b{b}": ratio(v, nv[(s, b)]) for (s, b), v in EARLIER_VLLM_NVFP4_LORA_MS.items()},
    }
    result = {
        "benchmark": "rollout decode ms/step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **(env if env is not None else environment()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "setup": {
            "prompt_tokens": PROMPT,
            "new_tokens": args.tokens,
            "hf_new_tokens": args.hf_tokens,
            "lora_r": 16,
            "temperature": 1.0,
            "weights": "random (real shapes)",
            "model": "Qwen2.5 7B/32B shapes",
        },  # fmt: skip
        "copy_bandwidth_tb_s": round(bw / 1e12, 3),
        "summary": summary,
        "earlier_vllm_reference": earlier,
        "results": rows,
    }
    if partial is not None:
        result["partial"] = partial
    return result


#: Bar order and colour of the plot's series: (engine, weights, lora) -> (label, colour).
SERIES = {
    ("native", "nvfp4", True): ("qerl NVFP4 + LoRA", "C0"),
    ("native", "nvfp4", False): ("qerl NVFP4, LoRA off", "#9ecae1"),
    ("native", "bf16", True): ("qerl bf16 + LoRA", "C9"),
    ("vllm", "nvfp4", True): ("vLLM NVFP4 + LoRA", "C2"),
    ("vllm", "bf16", True): ("vLLM bf16 + LoRA", "#a1d99b"),
    ("hf", "bf16", True): ("transformers bf16 + LoRA", "C3"),
    ("hf", "nf4", True): ("transformers NF4 + LoRA", "#fc9272"),
}


def plot(path: Path) -> Path:
    """Grouped bars, one group per (shape, batch), one bar per engine/weights, the NVFP4 + LoRA
    bandwidth floor as a line over each group; saved beside the JSON (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = data["results"]
    groups = sorted({(r["shape"], r["batch"]) for r in rows}, key=lambda g: (list(SHAPES).index(g[0]), g[1]))
    series = [k for k in SERIES if any((r["engine"], r["weights"], r["lora"]) == k for r in rows)]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    for j, key in enumerate(series):
        xs, ys = [], []
        for i, group in enumerate(groups):
            for r in rows:
                if (r["shape"], r["batch"]) == group and (r["engine"], r["weights"], r["lora"]) == key:
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    ys.append(r["ms_per_step"])
        label, colour = SERIES[key]
        ax.bar(xs, ys, width=width, color=colour, label=label)
    for i, group in enumerate(groups):
        floor = next((r["floor_ms"] for r in rows if (r["shape"], r["batch"], r["engine"], r["weights"], r["lora"])
                      == (*group, "native", "nvfp4", True) and r.get("floor_ms")), None)  # fmt: skip
        if floor:
            ax.hlines(floor, i - 0.4, i + 0.4, color="k", label="NVFP4 + LoRA floor" if i == 0 else None, zorder=3)
        earlier = EARLIER_VLLM_NVFP4_LORA_MS.get(group)
        if earlier and ("vllm", "nvfp4", True) not in series:  # no same-run vLLM rows: the earlier numbers
            ax.scatter([i], [earlier], color="C1", marker="*", s=120, zorder=4,
                       label="vLLM NVFP4+LoRA (earlier measurement)" if i == 0 else None)  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(top=8 * max(r["ms_per_step"] for r in rows))  # room for the legend above the bars
    ax.set_ylabel("decode ms / step (log)")
    ax.set_xticks(range(len(groups)), [f"{shape.upper()} b={b}" for shape, b in groups])
    device = data.get("device") or "device not recorded"
    ax.set_title(f"qerl rollout decode, {device} ({data['date'][:10]}){' — PARTIAL run' if 'partial' in data else ''}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = path.with_suffix(".png")
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=120)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where to write the JSON (GPU run)")
    parser.add_argument("--plot", type=Path, help="make the PNG for an existing JSON and exit")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hf-tokens", type=int, default=32)
    parser.add_argument("--shapes", nargs="+", default=["7b", "32b"], choices=list(SHAPES))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a kernel profile of eager decode first")
    parser.add_argument("--lora-sweep", action="store_true", help="only the 7B NVFP4 LoRA cost sweep (see above)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="with --lora-sweep")
    parser.add_argument("--from-partial", type=Path, help="turn the rows of a run cut off at its limit into the JSON")
    parser.add_argument("--bandwidth-tb-s", type=float, help="with --from-partial: that run's copy bandwidth")
    parser.add_argument("--partial-note", default="run cut off at its time limit; missing rows are null")
    parser.add_argument("--bnb", action="store_true", help="also 7B bitsandbytes NF4+LoRA via generate (b=1/8)")
    parser.add_argument("--bnb-only", action="store_true", help="only those rows (merge them with --vllm-rows)")
    parser.add_argument("--vllm-rows", type=Path, nargs="+", help="benchmarks/rollout_vllm.py JSON(s) to merge in")
    parser.add_argument("--merge-into", type=Path, help="with --vllm-rows and --out: merge into this result JSON")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    for path in args.vllm_rows or []:  # fail now, not after a long run
        if not path.is_file():
            sys.exit(f"benchmarks/rollout.py: --vllm-rows {path}: no such file")
    if args.merge_into:
        if not args.vllm_rows or args.out is None:
            sys.exit("benchmarks/rollout.py: --merge-into needs --vllm-rows FILE... and --out PATH")
        try:
            data = json.loads(args.merge_into.read_text())
            rows, bw, setup = data["results"], data["copy_bandwidth_tb_s"], data["setup"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"benchmarks/rollout.py: --merge-into {args.merge_into}: expected this script's result JSON ({e})")
        rows, env = with_extra_rows(rows, args.vllm_rows, {k: data.get(k) for k in ("device", "versions", "decode_config")})
        args.tokens, args.hf_tokens = setup["new_tokens"], setup["hf_new_tokens"]
        result = build_result(rows, bw * 1e12, args, partial=data.get("partial"), env=env)
        result["date"], result["command"] = data["date"], f"{data['command']} ; merged: {result['command']}"
        atomic_write_text(args.out, json.dumps(result, indent=2))
        print(json.dumps(result["summary"], indent=2))
        return
    if args.from_partial:
        data = json.loads(args.from_partial.read_text())
        rows, bw = (
            (data, args.bandwidth_tb_s) if isinstance(data, list) else (data["rows"], data["copy_bandwidth_tb_s"])
        )
        if bw is None or args.out is None:
            sys.exit("benchmarks/rollout.py: --from-partial needs --out and the run's bandwidth (--bandwidth-tb-s)")
        env = (
            {k: data.get(k) for k in ("device", "versions")}
            if isinstance(data, dict)
            else {"device": None, "versions": None}
        )
        rows, env = with_extra_rows(rows, args.vllm_rows, env)
        result = build_result(rows, bw * 1e12, args, partial=args.partial_note, env=env)
        atomic_write_text(args.out, json.dumps(result, indent=2))
        print(json.dumps(result["summary"], indent=2))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/rollout.py: needs a CUDA device (use --plot for an existing JSON)")
    if args.out is None:
        sys.exit("benchmarks/rollout.py: --out PATH is required for a run")
    if args.profile:
        profile(args)
    result = lora_sweep(args) if args.lora_sweep else run(args)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))


def write_partial(args: argparse.Namespace, bw: float, rows: list[dict]) -> None:
    """The rows so far beside ``--out`` (``.partial.json``), so a run cut off at its time limit keeps them."""
    if args.out is not None:
        partial = {"copy_bandwidth_tb_s": bw / 1e12, **environment(), "rows": rows}
        atomic_write_text(args.out.with_suffix(".partial.json"), json.dumps(partial, indent=1))


if __name__ == "__main__":
    main()
