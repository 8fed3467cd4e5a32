"""The evaluation loop shared by every benchmark: arguments, generation, scoring, resumable output.

Order of work is chosen so that bad input costs nothing: arguments, data and an existing output
file are checked first, then every prompt is tokenized and held to the model's context
(``eval.prompting``), then the model and adapter are loaded (also validated: by content digest when
the adapter records its base), and only then is anything written. One run at a time writes an
output (``qerl.runlock``). Work already in the output JSONL is never regenerated as long as it was made with
the same settings and the same model/adapter weights (by content digest); when nothing is left to
do the model is not even loaded and the run just recounts the file.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.data import Problem, load_problems
from eval.prompting import LONG_PROMPT_MODES, bounded_prompts, prompt_budget, use_chat_template
from eval.results import ResultFile
from eval.stats import Accuracy, accuracy
from qerl.cli import ArgumentParser, UsageError
from qerl.fingerprint import adapter_sha256, model_sha256, tree_sha256
from qerl.runlock import run_lock
from qerl.tasks.answers import score
from qerl.tasks.prompts import PROMPT_STYLES

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Benchmark:
    """How one benchmark is read and scored."""

    name: str
    question_field: str
    answer_field: str
    gold: Callable[[str], str]  # raw answer field -> gold answer; ValueError when there is none
    numeric: bool  # True: answers are numbers (GSM8K); False: LaTeX judged by math-verify
    default_data: str | None = None
    default_config: str | None = None
    default_split: str = "test"


def add_arguments(parser: argparse.ArgumentParser, default_data: str | None = None) -> None:
    """The flags every benchmark CLI shares."""
    parser.add_argument("--model", default="smollm2-135m", help="model directory, hub id, or smollm2-135m (default)")
    parser.add_argument(
        "--load",
        choices=("auto", "nvfp4", "bf16"),
        default="auto",
        help="insist on an NVFP4 or a dense checkpoint; auto takes what is there",
    )
    parser.add_argument("--lora", default=None, help="peft LoRA adapter directory (LoRA + trained norms) to apply")
    parser.add_argument(
        "--allow-base-mismatch",
        action="store_true",
        help="apply --lora even if it records a different base model (by digest, or by name for "
        "adapters without qerl_base.json; shapes are still checked)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code the model directory names (auto_map in config.json / tokenizer_config.json); "
        "without it such a model is refused",
    )
    parser.add_argument(
        "--engine",
        choices=("native", "vllm", "hf"),
        default="native",
        help="rollout engine: native (default, fastest; LoRA unmerged), hf (transformers generate, the "
        "reference), vllm",
    )
    parser.add_argument(
        "--data",
        default=default_data,
        required=default_data is None,
        help="local .jsonl/.json/.parquet file or hub dataset id",
    )
    parser.add_argument("--config", default=None, help="hub dataset config name (ignored for local files)")
    parser.add_argument("--split", default=None, help="hub dataset split (ignored for local files)")
    parser.add_argument("--question-field", default=None, help="field holding the question")
    parser.add_argument("--answer-field", default=None, help="field holding the gold answer")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N questions only")
    parser.add_argument("--batch-size", type=int, default=32, help="samples generated per engine call")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--samples", type=int, default=1, help="samples per question; pass@1 is averaged over them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompt-style",
        choices=sorted(PROMPT_STYLES),
        default="tags",
        help="tags (default: the reference's evaluation prompt), plain (the question alone: the "
        "reference's and qerl.train.run's default GSM8K training prompt) or dapo; match training",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template file for a model whose tokenizer has none (or to replace its own)",
    )
    parser.add_argument(
        "--long-prompts",
        choices=LONG_PROMPT_MODES,
        default="refuse",
        help="a prompt longer than the model's context less --max-new-tokens: refuse the run "
        "(default) or cut the question to fit, with a warning",
    )
    parser.add_argument("--output", default=None, help="results JSONL (default outputs/eval/<benchmark>-<model>.jsonl)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="compute dtype (auto: bf16 on GPU, fp32 on CPU)"
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


#: The most ``--samples`` per question: every (question, sample) pair is planned in memory before the first
#: generation, and pass@1 over more samples than this changes in the fourth decimal at most.
MAX_SAMPLES = 1024


def _check_arguments(args: argparse.Namespace) -> None:
    positive = {
        "--limit": args.limit,
        "--batch-size": args.batch_size,
        "--max-new-tokens": args.max_new_tokens,
        "--samples": args.samples,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected a positive integer, got {value}")
    if args.samples is not None and args.samples > MAX_SAMPLES:
        raise UsageError(f"--samples: expected at most {MAX_SAMPLES} samples per question, got {args.samples}")
    if not 0 <= args.temperature < math.inf:  # false for nan, which the results would record as invalid JSON
        raise UsageError(f"--temperature: expected a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p: expected a value in (0, 1], got {args.top_p}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(text).rstrip("/")).name) or "model"


def default_output(bench: Benchmark, args: argparse.Namespace) -> Path:
    parts = [bench.name, _slug(args.model)] + ([_slug(args.lora)] if args.lora else [])
    return Path("outputs") / "eval" / ("-".join(parts) + ".jsonl")


def run_settings(bench: Benchmark, args: argparse.Namespace) -> dict[str, Any]:
    """Everything that decides what a sample is (recorded beside the output and checked on resume),
    the content of the model and adapter weights included: the same ``--lora`` path after retraining
    is another adapter.

    --samples, --limit, --batch-size and --output are left out on purpose: they choose how much work
    is done, or how fast, so a resumed run may change them. A chat template file and prompt truncation
    are recorded only when used, so that results made before those flags existed still resume."""
    keys = (
        "model",
        "load",
        "lora",
        "engine",
        "data",
        "config",
        "split",
        "question_field",
        "answer_field",
        "max_new_tokens",
        "temperature",
        "top_p",
        "seed",
        "prompt_style",
        "dtype",
    )
    digests = {
        "model_sha256": model_sha256(args.model),
        "lora_sha256": adapter_sha256(args.lora) if args.lora else None,
    }
    optional = {
        "chat_template_sha256": tree_sha256(args.chat_template) if args.chat_template else None,
        "long_prompts": args.long_prompts if args.long_prompts != "refuse" else None,
    }
    return {
        "benchmark": bench.name,
        **{k: getattr(args, k) for k in keys},
        **digests,
        **{k: v for k, v in optional.items() if v is not None},
    }


def _load_tokenizer(args: argparse.Namespace) -> tuple[Any, int, str]:
    """(tokenizer with a checked chat template, the model's context in positions, the template's name for
    messages), read without the weights."""
    from transformers import AutoConfig

    from qerl.hub import local_model_dir
    from qerl.load.loader import check_supported, load_tokenizer

    try:
        trust = args.trust_remote_code
        check_supported(args.model, trust_remote_code=trust)  # before transformers reads anything of it
        tokenizer = load_tokenizer(args.model, trust_remote_code=trust)
        config = AutoConfig.from_pretrained(local_model_dir(args.model), trust_remote_code=trust)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {args.model}: {str(e).strip().splitlines()[0]}") from None
    template = use_chat_template(tokenizer, args.model, args.chat_template, args.prompt_style)
    context = getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 0)
    return tokenizer, int(context), template


def _load_engine(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, list[int]]:
    """(engine, stop token ids) for the model (+ adapter) under evaluation."""
    import torch

    from eval.loading import apply_adapter, load_base
    from qerl.rollout import get_engine

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = load_base(args.model, args.load, dtype, args.device, trust_remote_code=args.trust_remote_code)
    if args.lora:
        model = apply_adapter(model, args.lora, args.model, allow_base_mismatch=args.allow_base_mismatch)
    stop = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    try:
        engine = get_engine(model, tokenizer, args.engine)
    except (ImportError, ValueError, RuntimeError) as e:
        raise UsageError(f"--engine {args.engine}: {str(e).splitlines()[0]}") from None
    return engine, sorted(t for t in stop if t is not None)


def plan_engine_calls(pending: list[tuple[Problem, int]], batch_size: int) -> list[list[tuple[Problem, list[int]]]]:
    """Group pending samples into engine calls of ~``batch_size`` samples. A call is a list of
    (problem, sample indices) with the same number of samples each, so that one ``generate(..., n=m)``
    shares each prompt's prefill among its m samples (all K of them in a fresh run)."""
    missing: dict[int, tuple[Problem, list[int]]] = {}
    for problem, sample in pending:
        missing.setdefault(problem.index, (problem, []))[1].append(sample)
    by_count: dict[int, list[tuple[Problem, list[int]]]] = {}
    for problem, samples in missing.values():
        by_count.setdefault(len(samples), []).append((problem, samples))
    calls = []
    for m, items in by_count.items():
        per_call = max(1, batch_size // m)
        calls += [items[i : i + per_call] for i in range(0, len(items), per_call)]
    return calls


def _generate(
    args: argparse.Namespace, bench: Benchmark, pending: list[tuple[Problem, int]], results: ResultFile
) -> None:
    """Sample every pending (problem, sample) pair, scoring and appending the results of each engine call."""
    from tqdm import tqdm

    from qerl.rollout import SamplingParams

    tokenizer, context, template = _load_tokenizer(args)
    problems = list({problem.index: problem for problem, _ in pending}.values())
    prompts = bounded_prompts(
        tokenizer,
        problems,
        args.prompt_style,
        prompt_budget(context, args.max_new_tokens),
        args.long_prompts,
        args.data,
        template,
    )
    engine, stop_ids = _load_engine(args, tokenizer)
    with tqdm(total=len(pending), desc=bench.name, unit="sample") as bar:
        for call in plan_engine_calls(pending, args.batch_size):
            first, first_samples = call[0]
            # Seeded by the run's seed and the call's first item, so rerunning the same work reproduces it.
            params = SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop_ids,
                seed=args.seed * 1_000_003 + first.index * args.samples + first_samples[0],
            )
            out = engine.generate([prompts[problem.index] for problem, _ in call], params, n=len(first_samples))
            work = [(problem, sample) for problem, samples in call for sample in samples]  # the engine's output order
            records = []
            for (problem, sample), ids, reason in zip(work, out.completion_ids, out.finish_reasons, strict=True):
                completion = tokenizer.decode(ids, skip_special_tokens=True)
                extraction, correct = score(completion, problem.gold, numeric=bench.numeric)
                records.append(
                    {
                        "index": problem.index,
                        "sample": sample,
                        "question": problem.question,
                        "gold": problem.gold,
                        "completion": completion,
                        "extracted": extraction.text if extraction else None,
                        "method": extraction.method if extraction else None,
                        "correct": correct,
                        "finish_reason": reason,
                        "completion_tokens": len(ids),
                    }
                )
            results.append(records)
            bar.update(len(records))


def evaluate(args: argparse.Namespace, bench: Benchmark) -> Accuracy:
    """Run (or resume) one evaluation and return its accuracy, recounted from the output file."""
    _check_arguments(args)
    problems = load_problems(
        args.data,
        question_field=args.question_field or bench.question_field,
        answer_field=args.answer_field or bench.answer_field,
        gold=bench.gold,
        split=args.split or bench.default_split,
        config=args.config
        if args.config is not None
        else (bench.default_config if args.data == bench.default_data else None),
        limit=args.limit,
    )
    output = Path(args.output) if args.output else default_output(bench, args)
    with run_lock(output):
        results = ResultFile(output, run_settings(bench, args))
        pending = [
            (p, s) for p in problems for s in range(args.samples) if (p.index, p.question, s) not in results.records
        ]
        done = len(problems) * args.samples - len(pending)
        if done:
            print(f"{output}: resuming, {done} samples done, {len(pending)} to generate")
        if pending:
            _generate(args, bench, pending, results)
    records = [[results.records[(p.index, p.question, s)] for s in range(args.samples)] for p in problems]
    result = accuracy([sum(bool(r["correct"]) for r in rs) for rs in records], args.samples)
    flat = [r for rs in records for r in rs]
    # How answers were found and how many completions ran out of tokens: a high "last-number" or
    # "length" share means the budget or the prompt format, not the maths, is being measured.
    methods = Counter(r["method"] or "none" for r in flat)
    cut = sum(r["finish_reason"] == "length" for r in flat)
    label = scored(bench, args.data)
    print(
        f"{label}: {cut}/{len(flat)} completions hit --max-new-tokens; answers found by "
        + ", ".join(f"{m} {n}" for m, n in methods.most_common())
    )
    print(f"{label}: {result.describe()} -> {output}")
    return result


def scored(bench: Benchmark, data: str) -> str:
    """What a run scored, as its lines name it: the benchmark, or for other data (``--data runs/x/heldout.jsonl``
    under ``python -m eval.gsm8k``) that data, scored the benchmark's way; "gsm8k:" over arithmetic misled."""
    return bench.name if bench.default_data in (None, data) else f"{data} ({bench.name} scoring)"


def make_parser(prog: str, description: str, default_data: str | None = None) -> argparse.ArgumentParser:
    """The shared flags on qerl's strict parser (no flag abbreviations; errors are one line)."""
    parser = ArgumentParser(prog=prog, description=description)
    add_arguments(parser, default_data=default_data)
    return parser
