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
holds) for LoRA with shrinks fused into the producing kernels, the same with one FP4 launch per
projection instead of per stacked q/k/v and gate/up group (``step_plan.STACK_GROUPS = False``), LoRA
with one cuBLAS shrink per group (``step_plan.FUSED_LORA_MAX_ROWS = 0``), and LoRA disabled.

``--kernel-ab`` / ``--ab-constant`` time one engine setting against another in one process
(benchmarks/rollout_ab.py says how).

``--profile`` writes only a per-kernel GPU-time profile of one eager decode step at ``--batches``, with
LoRA and with the adapter disabled.

    python -m benchmarks.rollout --out $OUT/rollout.json            # on the GPU
    python -m benchmarks.rollout --lora-sweep --tokens 256 --out $OUT/rollout_lora.json
    python -m benchmarks.rollout --plot benchmarks/results/rollout.json  # PNG beside the JSON
    python -m benchmarks.rollout --out $OUT/rollout.json --vllm-rows $OUT/rollout_vllm.json
    python -m benchmarks.rollout --merge-into rollout.json --vllm-rows rollout_vllm.json --out merged.json
    python -m benchmarks.rollout --bnb-only --shapes 7b --out $OUT/rollout_bnb.json  # merge it like vLLM rows
    python -m benchmarks.rollout --skip-hf --shapes 7b --batches 64 128 --tokens 4096 --out $OUT/t4096.json
        # long completions: merge its native rows (and rollout_vllm.py's --tokens 4096 rows) with --vllm-rows
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import PROMPT, SHAPES, VOCAB, utc_now, write_json
from benchmarks.rollout_ab import AB_SWITCHES, constant_ab, kernel_ab, parse_ab_constants
from benchmarks.rollout_models import (
    build_bnb_model,
    build_model,
    copy_bandwidth,
    environment,
    kv_bytes_per_step,
    ms_per_step,
    weight_bytes,
)
from benchmarks.rollout_report import build_result, from_partial, merge_into, plot, with_extra_rows

#: Batch sizes of the main run per shape (``--batches`` replaces them for every shape).
MAIN_BATCHES = {"7b": (1, 8, 64, 128), "32b": (8, 1), "qwen3-8b": (1, 8, 64), "qwen3-32b": (1, 8)}


def profile(args: argparse.Namespace) -> dict:
    """GPU time of one eager 7B NVFP4+LoRA decode step, per kernel, at each of ``--batches``, with LoRA
    (``lora``) and with the adapter disabled (``nolora``): where the LoRA share of the step goes.

    Context: prompts of ``PROMPT + tokens / 2`` positions, the mean KV length of the timed runs, so the
    attention share matches theirs. Per kernel: (time in a generate of 1 + S tokens - time in a
    1-token generate) / S, i.e. decode steps only, prefill and the first sampled token cancelled.
    Eager launches leave gaps between kernels, but each kernel's own time is what a graph replays.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from qerl.rollout import SamplingParams
    from qerl.rollout.native import NativeEngine

    steps, context = 16, PROMPT + args.tokens // 2
    variants = ("lora", "nolora")
    model = build_model("7b", nvfp4=True)
    gen = torch.Generator().manual_seed(1)
    result: dict = {"steps": steps, "context": context, "batches": {}}

    def kernel_us(engine: NativeEngine, prompts: list[list[int]], tokens: int) -> dict[str, float]:
        params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
        engine.generate(prompts, params)  # compiles and sizes the cache outside the profile
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        return {e.key: e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0}

    for b in args.batches:
        prompts = [torch.randint(0, VOCAB, (context,), generator=gen).tolist() for _ in range(b)]
        result["batches"][str(b)] = {}
        for variant in variants:
            with model.disable_adapter() if variant == "nolora" else contextlib.nullcontext():
                engine = NativeEngine(model, 0, cuda_graphs=False)
                one, many = kernel_us(engine, prompts, 1), kernel_us(engine, prompts, 1 + steps)
            per_step = {k: (v - one.get(k, 0.0)) / steps for k, v in many.items()}
            per_step = dict(sorted(((k, round(v, 2)) for k, v in per_step.items() if v > 0.5), key=lambda kv: -kv[1]))
            result["batches"][str(b)][variant] = {"total_us": round(sum(per_step.values()), 1), "kernels_us": per_step}
            print(f"--- 7b nvfp4+lora b={b}, context {context}, {variant}: GPU us per eager decode step", flush=True)
            for k, v in list(per_step.items())[:16]:
                print(f"{v:10.1f}  {k[:100]}")
            print(f"{sum(per_step.values()):10.1f}  total", flush=True)
    return result


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
    from qerl.rollout import step_plan
    from qerl.rollout.native import NativeEngine

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    model = build_model("7b", nvfp4=True)
    wbytes, lbytes = weight_bytes(model)
    fused_rows = step_plan.FUSED_LORA_MAX_ROWS
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for b in args.batches:
        prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        kv = kv_bytes_per_step("7b", b, args.tokens)
        for variant in ("lora_fused", "lora_per_projection", "lora_cublas", "nolora"):
            step_plan.FUSED_LORA_MAX_ROWS = 0 if variant == "lora_cublas" else fused_rows
            step_plan.STACK_GROUPS = variant != "lora_per_projection"
            try:
                with model.disable_adapter() if variant == "nolora" else contextlib.nullcontext():
                    engine = NativeEngine(model, 0)  # fresh graphs: the shrink placement is baked in
                    ms, t_one = ms_per_step(engine, prompts, args.tokens)
                    del engine
                    launches = launches_per_step(model, prompts)
            finally:
                step_plan.FUSED_LORA_MAX_ROWS = fused_rows
                step_plan.STACK_GROUPS = True
            gc.collect()
            torch.cuda.empty_cache()
            floor = (wbytes + (0 if variant == "nolora" else lbytes) + kv) / bw * 1e3
            rows.append(
                dict(
                    shape="7b",
                    engine="native",
                    weights="nvfp4",
                    variant=variant,
                    lora=variant != "nolora",
                    batch=b,
                    tokens=args.tokens,
                    ms_per_step=round(ms, 4),
                    launches_per_step=launches,
                    prefill_plus_1_s=round(t_one, 4),
                    floor_ms=round(floor, 4),
                )
            )
            write_partial(args, bw, rows)
            print(
                f"7b nvfp4 {variant:11s} b={b:3d}: {ms:8.3f} ms/step, {launches:6.1f} launches/step "
                f"(floor {floor:.3f})",
                flush=True,
            )
    by = {(r["variant"], r["batch"]): r["ms_per_step"] for r in rows}
    summary = {}
    for b in args.batches:
        off = by.get(("nolora", b))
        for variant in ("lora_fused", "lora_per_projection", "lora_cublas"):
            on = by.get((variant, b))
            summary[f"{variant}_overhead_ms_b{b}"] = None if on is None or off is None else round(on - off, 4)
            summary[f"{variant}_share_b{b}"] = None if on is None or off is None else round((on - off) / on, 4)
    return {
        "benchmark": "rollout LoRA cost sweep (decode ms/step, launches/step)",
        "date": utc_now(),
        **environment(),
        "command": common.command("benchmarks.rollout"),
        "setup": {
            "prompt_tokens": PROMPT,
            "new_tokens": args.tokens,
            "lora_r": 16,
            "temperature": 1.0,
            "weights": "random (real shapes)",
            "model": "Qwen2.5-7B shapes, NVFP4 decoder Linears",
            "fused_lora_max_rows": fused_rows,
        },
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
    for shape, default_batches in MAIN_BATCHES.items():
        if shape not in args.shapes or args.bnb_only:
            continue
        batches = args.batches or default_batches
        for variant in ("nvfp4", "bf16"):
            model = build_model(shape, nvfp4=variant == "nvfp4")
            wbytes, lbytes = weight_bytes(model)
            native = get_engine(model, 0, kind="native")
            hf = get_engine(model, 0, kind="hf")
            for b in batches:
                prompts = [
                    torch.randint(0, common.vocab_size(shape), (PROMPT,), generator=gen).tolist() for _ in range(b)
                ]
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
                    row = dict(
                        shape=shape,
                        engine=engine_name,
                        weights=variant,
                        lora=with_lora,
                        batch=b,
                        tokens=tokens,
                        ms_per_step=round(ms, 4),
                        prefill_plus_1_s=round(t_one, 4),
                        floor_ms=round(floor, 4),
                        weight_gb=round(wbytes / 1e9, 3),
                        lora_gb=round(lbytes / 1e9, 4),
                        kv_gb_mean=round(kv / 1e9, 3),
                    )
                    record(rows, row, bw, args)
            del native, hf, model
            gc.collect()
            torch.cuda.empty_cache()
    if (args.bnb or args.bnb_only) and "7b" in args.shapes:
        bnb_rows(rows, gen, bw, args)
    rows, env = with_extra_rows(rows, args.vllm_rows, environment())
    return build_result(rows, bw, args, env)


def record(rows: list[dict], row: dict, bw: float, args: argparse.Namespace) -> None:
    """Append a row, save the partial results (they survive a run cut off at its limit), print it."""
    rows.append(row)
    write_partial(args, bw, rows)
    print(
        f"{row['shape']} {row['engine']:6s} {row['weights']}+{'lora' if row['lora'] else 'nolora':6s} "
        f"b={row['batch']:3d}: {row['ms_per_step']:8.3f} ms/step (floor {row['floor_ms']:.3f}, "
        f"tokens {row['tokens']})",
        flush=True,
    )


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
        record(
            rows,
            dict(
                shape="7b",
                engine="hf",
                weights="nf4",
                lora=True,
                batch=b,
                tokens=args.hf_tokens,
                ms_per_step=round(ms, 4),
                prefill_plus_1_s=round(t_one, 4),
                floor_ms=round(floor, 4),
                weight_gb=round(wbytes / 1e9, 3),
                lora_gb=round(lbytes / 1e9, 4),
                kv_gb_mean=round(kv / 1e9, 3),
            ),
            bw,
            args,
        )
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where to write the JSON (GPU run)")
    parser.add_argument("--plot", type=Path, help="make the PNG for an existing JSON and exit")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hf-tokens", type=int, default=32)
    parser.add_argument("--shapes", nargs="+", default=["7b", "32b"], choices=list(SHAPES))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only a per-kernel GPU-time profile of one 7B NVFP4+LoRA decode step at --batches",
    )
    parser.add_argument("--lora-sweep", action="store_true", help="only the 7B NVFP4 LoRA cost sweep (see above)")
    parser.add_argument("--kernel-ab", choices=list(AB_SWITCHES), help="only the A/B of that engine switch (see above)")
    parser.add_argument(
        "--ab-constant",
        nargs="+",
        metavar="MODULE.NAME=BASE:VARIANT",
        help="only the A/B of these module constants, set together (see above)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="batch sizes (default: 7b 1 8 64 128 and 32b 8 1 in the main run; 1 8 64 with --lora-sweep, "
        "--kernel-ab, --ab-constant or --profile)",
    )
    parser.add_argument("--from-partial", type=Path, help="turn the rows of a run cut off at its limit into the JSON")
    parser.add_argument("--bandwidth-tb-s", type=float, help="with --from-partial: that run's copy bandwidth")
    parser.add_argument("--partial-note", default="run cut off at its time limit; missing rows are null")
    parser.add_argument("--bnb", action="store_true", help="also 7B bitsandbytes NF4+LoRA via generate (b=1/8)")
    parser.add_argument("--bnb-only", action="store_true", help="only those rows (merge them with --vllm-rows)")
    parser.add_argument("--vllm-rows", type=Path, nargs="+", help="benchmarks/rollout_vllm.py JSON(s) to merge in")
    parser.add_argument("--merge-into", type=Path, help="with --vllm-rows and --out: merge into this result JSON")
    args = parser.parse_args()
    if args.batches is None and (args.lora_sweep or args.kernel_ab or args.ab_constant or args.profile):
        args.batches = [1, 8, 64]
    if args.plot:
        print(plot(args.plot))
        return
    for path in args.vllm_rows or []:  # fail now, not after a long run
        if not path.is_file():
            sys.exit(f"benchmarks/rollout.py: --vllm-rows {path}: no such file")
    if args.merge_into or args.from_partial:
        result = merge_into(args) if args.merge_into else from_partial(args)
        write_json(args.out, result)
        print(json.dumps(result["summary"], indent=2))
        return
    constants = None
    if args.ab_constant:  # fail now, not after the model is built
        try:
            constants = parse_ab_constants(args.ab_constant)
        except ValueError as err:
            sys.exit(f"benchmarks/rollout.py: {err}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/rollout.py: needs a CUDA device (use --plot for an existing JSON)")
    if args.out is None:
        sys.exit("benchmarks/rollout.py: --out PATH is required for a run")
    if args.profile:
        write_json(
            args.out,
            {
                "date": utc_now(),
                **environment(),
                "command": common.command("benchmarks.rollout"),
                "profile": profile(args),
            },
        )
        return
    if args.kernel_ab or constants:
        write_json(args.out, kernel_ab(args) if args.kernel_ab else constant_ab(args, *constants))
        return
    result = lora_sweep(args) if args.lora_sweep else run(args)
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=2))


def write_partial(args: argparse.Namespace, bw: float, rows: list[dict]) -> None:
    """The rows so far beside ``--out`` (``.partial.json``), so a run cut off at its time limit keeps them."""
    if args.out is not None:
        partial = {"copy_bandwidth_tb_s": bw / 1e12, **environment(), "rows": rows}
        write_json(args.out.with_suffix(".partial.json"), partial, indent=1)


if __name__ == "__main__":
    main()
