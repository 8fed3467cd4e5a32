"""vLLM decode ms/step on the shapes of benchmarks/rollout.py: the baseline rows of its table.

vLLM 0.26 serving random ("dummy") weights of real Qwen2.5-7B/32B shapes, as NVFP4A16 through
compressed-tensors (Marlin FP4 GEMM on Hopper) or bf16, each with a LoRA r=16 adapter on all seven
projections (a peft adapter directory written once, loaded by vLLM from disk as usual). The method is
benchmarks/rollout.py's ``ms_per_step``: prompts of 256 random token ids, 1024 tokens forced
(``ignore_eos``), temperature 1, the sampled tokens' log-probs returned (as the RL engine asks);
ms/step = (t(1024 tokens) - t(1 token)) / 1023 after a warm-up generate of the same shape.
Prefix caching is off so that the timed runs prefill like the warm-up did.

Every (shape, weights) configuration runs in its own process (``--config 7b:nvfp4``), so the GPU
memory of one ``LLM`` is surely gone before the next; the driver collects the rows, writing the
output after every configuration so that a run cut off at its time limit keeps what it measured. A
SIGTERM to the driver (``timeout``'s signal) stops the running child too, keeps the rows it had finished
and ends the run with that failure noted: a child left running would hold the GPU for whatever the caller
runs next (H200, 2026-12-02: ``timeout 230`` on this driver lost a finished b = 1 / 8 / 64 of 7B nvfp4).

    python -m benchmarks.rollout_vllm --out $OUT/rollout_vllm.json                 # all configs
    python -m benchmarks.rollout_vllm --shapes 7b --weights nvfp4 --out $OUT/v.json
    python -m benchmarks.rollout --merge-into rollout.json --vllm-rows v.json --out merged.json

Rows follow benchmarks/rollout.py's schema (engine="vllm"); ``floor_ms`` etc. are null here and are
filled from the native row of the same configuration when the rows are merged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    PROMPT,
    SHAPES,
    command,
    device_name,
    family_config,
    head_dim,
    model_type,
    run_stoppable,
    utc_now,
    versions,
    vocab_size,
    write_json,
)
from qerl.checkpoint import quantization_config
from qerl.fsutil import atomic_file
from qerl.load.lora import DEFAULT_TARGETS

#: The repository root: the children run ``python -m benchmarks.rollout_vllm`` from there.
REPO = Path(__file__).resolve().parents[1]
BATCHES = {"7b": (1, 8, 64, 128), "32b": (1, 8), "qwen3-8b": (1, 8, 64), "qwen3-32b": (1, 8), "llama3.1-8b": (1, 8, 64)}
#: The architecture vLLM loads for each model_type of ``common.MODEL_TYPES``.
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
WEIGHTS = ("nvfp4", "bf16")
LORA_R = 16


def write_model_dir(root: Path, shape: str, weights: str) -> Path:
    """A config-only directory of ``shape``'s family (vLLM's dummy loader needs no tensors, and no tokenizer here)."""
    kind = model_type(shape)
    out = root / f"{kind}-{shape}-{weights}"
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": vocab_size(shape),
        **family_config(shape),
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        **SHAPES[shape],
    }
    if weights == "nvfp4":  # exactly the block our quantizer writes (lm_head stays bf16)
        config["quantization_config"] = quantization_config(ignore=["lm_head"])
    write_json(out / "config.json", config)
    return out


def write_adapter_dir(root: Path, shape: str, seed: int = 0) -> Path:
    """A peft LoRA adapter (r=16, alpha=16, all seven projections, random A and B) in peft's file format."""
    import torch
    from safetensors.torch import save_file

    s = SHAPES[shape]
    h, inter, kv = s["hidden_size"], s["intermediate_size"], s["num_key_value_heads"] * head_dim(s)
    q = s["num_attention_heads"] * head_dim(s)
    dims = {  # (in, out)
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    out = root / f"lora-{shape}-r{LORA_R}"
    if (out / "adapter_config.json").exists():  # written by the other weights' config of this shape
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(s["num_hidden_layers"]):
        for proj in DEFAULT_TARGETS:
            k_in, n_out = dims[proj]
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{i}.{block}.{proj}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(LORA_R, k_in, generator=gen) / k_in**0.5).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(n_out, LORA_R, generator=gen) * 0.01).bfloat16()
    with atomic_file(out / "adapter_model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_R,
        "lora_alpha": LORA_R,
        "lora_dropout": 0.0,
        "target_modules": list(DEFAULT_TARGETS),
        "bias": "none",
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    write_json(out / "adapter_config.json", adapter_config)
    return out


def environment() -> dict:
    return {"device": device_name(), "versions": versions("vllm", "transformers")}


def run_config(args: argparse.Namespace) -> None:
    """Child process: one LLM for (shape, weights), one row per batch size, rows rewritten after each."""
    import torch
    import vllm
    from vllm.lora.request import LoRARequest

    shape, weights = args.config
    root = Path(args.workdir)
    model_dir = write_model_dir(root, shape, weights)
    adapter = write_adapter_dir(root, shape)
    batches = sorted(b for b in args.batches if b in BATCHES[shape])
    t0 = time.perf_counter()
    llm = vllm.LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        generation_config="vllm",
        dtype="bfloat16",
        seed=0,
        max_model_len=PROMPT + args.tokens + 256,
        max_num_seqs=max(batches),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        enable_lora=True,
        max_lora_rank=LORA_R,
        max_loras=1,
        logprobs_mode="processed_logprobs",
        compilation_config={"cudagraph_capture_sizes": batches},
    )
    init_s = time.perf_counter() - t0
    print(f"{shape} vllm {weights}: LLM init {init_s:.1f} s", flush=True)
    lora = LoRARequest("bench-r16", 1, str(adapter))
    env = environment()
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    def generate(prompts: list[list[int]], tokens: int) -> list:
        params = vllm.SamplingParams(
            temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False, seed=None
        )
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)

    def timed(prompts: list[list[int]], tokens: int) -> tuple[float, list]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(prompts, tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    for b in batches:
        prompts = [torch.randint(0, vocab_size(shape), (PROMPT,), generator=gen).tolist() for _ in range(b)]
        generate(prompts, args.tokens)  # warm-up of the same shape
        generate(prompts, 1)  # and of the 1-token run's own prefill
        t_one, _ = timed(prompts, 1)
        t_full, out = timed(prompts, args.tokens)
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in out), "a completion stopped early"
        ms = (t_full - t_one) / (args.tokens - 1) * 1e3
        rows.append(
            dict(
                shape=shape,
                engine="vllm",
                weights=weights,
                lora=True,
                batch=b,
                tokens=args.tokens,
                ms_per_step=round(ms, 4),
                prefill_plus_1_s=round(t_one, 4),
                floor_ms=None,
                weight_gb=None,
                lora_gb=None,
                kv_gb_mean=None,
                llm_init_s=round(init_s, 1),
            )
        )
        write_json(Path(args.out), {**env, "rows": rows}, indent=1)
        print(f"{shape} vllm   {weights}+lora   b={b:3d}: {ms:8.3f} ms/step (prefill+1 {t_one:.3f} s)", flush=True)


def drive(args: argparse.Namespace) -> dict:
    """Parent: one child process per (shape, weights); collect rows, rewrite the output after each. On SIGTERM
    the running child is terminated, its finished rows are kept, and no further configuration starts."""
    rows: list[dict] = []
    env: dict = {}
    failures: list[str] = []
    result = build_result(rows, env, args, failures)
    child_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    child_env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    with tempfile.TemporaryDirectory(prefix="qerl-vllm-bench-") as tmp:
        for shape in args.shapes:
            for weights in args.weights:
                if not any(b in BATCHES[shape] for b in args.batches):
                    continue
                part = Path(tmp) / f"{shape}-{weights}.json"
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.rollout_vllm",
                    "--config",
                    f"{shape}:{weights}",
                    "--out",
                    str(part),
                    "--workdir",
                    tmp,
                    "--tokens",
                    str(args.tokens),
                    "--gpu-memory-utilization",
                    str(args.gpu_memory_utilization),
                    "--batches",
                    *map(str, args.batches),
                ]
                code, stopped = run_stoppable(cmd, env=child_env, cwd=REPO)
                if part.exists():  # rows measured before any failure still count
                    data = json.loads(part.read_text())
                    rows.extend(data["rows"])
                    env = {k: data[k] for k in ("device", "versions")}
                if stopped is not None:
                    failures.append(f"{shape}:{weights} stopped by {stopped} (rows it had finished are kept)")
                elif code != 0:
                    failures.append(f"{shape}:{weights} exited with {code}")
                    print(f"benchmarks/rollout_vllm.py: config {shape}:{weights} failed (exit {code})", flush=True)
                result = build_result(rows, env, args, failures)
                write_json(args.out, result)
                if stopped is not None:
                    return result
    return result


def build_result(rows: list[dict], env: dict, args: argparse.Namespace, failures: list[str]) -> dict:
    return {
        "benchmark": "rollout decode ms/step, vLLM baseline",
        "date": utc_now(),
        **env,
        "command": command("benchmarks.rollout_vllm"),
        "setup": {
            "prompt_tokens": PROMPT,
            "new_tokens": args.tokens,
            "lora_r": LORA_R,
            "temperature": 1.0,
            "weights": "vLLM load_format=dummy (random, real shapes)",
            "model": "Qwen2.5 7B/32B shapes",
            "nvfp4": "compressed-tensors NVFP4A16 (vLLM picks Marlin FP4 on Hopper)",
            "vllm": "in-process engine, CUDA graphs for the timed batch sizes, prefix caching off, logprobs=0",
        },
        "failures": failures,
        "results": rows,
    }


def parse_config(text: str) -> tuple[str, str]:
    shape, _, weights = text.partition(":")
    if shape not in SHAPES or weights not in WEIGHTS:
        raise argparse.ArgumentTypeError(
            f"expected SHAPE:WEIGHTS with SHAPE in {list(SHAPES)} and WEIGHTS in {list(WEIGHTS)}, got {text!r}"
        )
    return shape, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON to write (rewritten after every row)")
    parser.add_argument("--shapes", nargs="+", default=["7b", "32b"], choices=list(SHAPES))
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1, 8, 64, 128],
        help="of each shape's BATCHES (7b: 1/8/64/128, 32b: 1/8, qwen3-8b: 1/8/64, qwen3-32b: 1/8)",
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--config", type=parse_config, help="(internal) run one SHAPE:WEIGHTS in this process")
    parser.add_argument("--workdir", help="(internal, with --config) where the config and adapter dirs go")
    args = parser.parse_args()
    if args.tokens < 2:
        sys.exit(f"benchmarks/rollout_vllm.py: --tokens must be >= 2, got {args.tokens}")
    if args.config is not None:
        if args.workdir is None:
            sys.exit("benchmarks/rollout_vllm.py: --config needs --workdir")
        run_config(args)
        return
    result = drive(args)
    print(json.dumps([{k: r[k] for k in ("shape", "weights", "batch", "ms_per_step")} for r in result["results"]]))
    if result["failures"]:
        sys.exit(f"benchmarks/rollout_vllm.py: failed configs: {result['failures']}")


if __name__ == "__main__":
    main()
