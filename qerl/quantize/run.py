"""Quantize a Hugging Face model to NVFP4A16 (compressed-tensors), the checkpoint qerl and vLLM load.

    python llm-compressor/quantize_nvfp4.py --model smollm2-135m
    python llm-compressor/quantize_nvfp4.py --model Qwen/Qwen2.5-7B-Instruct --output qmodel/qwen7b
    python llm-compressor/quantize_nvfp4.py --model DIR --gguf-file model.gguf --backend qerl
    python llm-compressor/quantize_nvfp4.py --model smollm2-135m --method gptq --calibration-samples 128

The quantize command (``qerl.quantize.pipeline`` does the work): ``llm-compressor/quantize_nvfp4.py`` (the
reference's script name, the command the README gives) is a thin front of this module, and ``python -m
qerl.quantize`` runs it too. Same flags as the QeRL reference script, plus ``--method``. The default backend streams
tensor by tensor (bounded memory); ``--backend llmcompressor`` runs llm-compressor's own oneshot and writes the same
bytes. ``--method mse`` searches block scales without data (streaming); ``--method gptq`` runs llm-compressor's GPTQ
on calibration text (default: GSM8K rows bundled with qerl).

The command ends with a short reply of the written checkpoint, loaded through qerl's loader (``qerl.load``), unless
``--skip_generation``: it is the one quantize module that uses a later stage, so ``tests/test_house.py`` ranks it
with the commands, above load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qerl.cli import ArgumentParser, UsageError, environment_error, run, shard_gb
from qerl.quantize.calibration import DEFAULT_MAX_TOKENS, DEFAULT_SAMPLES, Calibration
from qerl.quantize.pipeline import METHOD_BACKENDS, default_output, quantize_checkpoint

#: The name usage lines give the command: the one users run.
PROG = "llm-compressor/quantize_nvfp4.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The reference script's flags plus ours; no abbreviations, parse errors are one ``error:`` line."""
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory, hub id, or 'smollm2-135m' (embedded default)")
    p.add_argument("--gguf-file", default=None, help="a GGUF file (path, or name inside --model's directory)")
    p.add_argument(
        "--output",
        default=None,
        help="output directory (default ./qmodel/<name>-NVFP4A16; the reference wrote <name>-NVFP4A16-GPTQ "
        "for the same round-to-nearest result)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "qerl", "llmcompressor"],
        help="auto: qerl (streaming) for rtn and mse, llmcompressor for gptq",
    )
    _method_flags(p)
    p.add_argument(
        "--ignore",
        nargs="+",
        default=[],
        help="Linear modules to keep in bf16 besides lm_head: full or last-part names (down_proj) "
        "or re:REGEX patterns matched against full names, for both backends",
    )
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (kept in bf16 by default)")
    p.add_argument(
        "--max-shard-gb", type=shard_gb, default=4.0, help="output shard size; bounds the streaming peak memory"
    )
    p.add_argument(
        "--skip_generation", "--skip-generation", action="store_true", help="do not print a sample generation"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output directory (only an earlier NVFP4 output of this tool)",
    )
    return p.parse_args(argv)


def _method_flags(p: argparse.ArgumentParser) -> None:
    """``--method`` and the calibration flags of ``gptq``."""
    p.add_argument(
        "--method",
        default="rtn",
        choices=list(METHOD_BACKENDS),
        help="rtn: round-to-nearest (llm-compressor's bytes); mse: data-free block-scale search; "
        "gptq: GPTQ on calibration text (needs the quantize extra)",
    )
    p.add_argument(
        "--calibration-data",
        type=Path,
        default=None,
        help="gptq: .jsonl/.json/.parquet with a 'text' or 'question'+'answer' columns "
        "(default: the bundled GSM8K training rows)",
    )
    p.add_argument(
        "--calibration-samples",
        type=int,
        default=None,
        help=f"gptq: how many rows to calibrate on (default {DEFAULT_SAMPLES})",
    )
    p.add_argument(
        "--calibration-max-tokens",
        type=int,
        default=None,
        help=f"gptq: tokens kept per row (default {DEFAULT_MAX_TOKENS})",
    )


def sample_generation(out_dir: Path, prompt: str = "What is 12 * 7? Answer briefly.") -> str:
    """A short greedy reply from the quantized model, as a smoke test of the written checkpoint."""
    import torch

    from qerl.load.loader import load_model, load_tokenizer

    tok = load_tokenizer(out_dir)
    model = load_model(out_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = {k: v.to(model.device) for k, v in ids.items()}
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    """The CLI: 0, or 2 with ``error: <one line>`` for bad input (flags included), as every qerl command."""
    return run(command, argv)


def command(argv: list[str] | None) -> None:
    """The command itself: a mistake in the input raises ``UsageError`` (a full or read-only disk its ``OSError``),
    which :func:`main` turns into its one line and exit status (``qerl.cli.run``)."""
    args = parse_args(argv)
    output = args.output or default_output(args.gguf_file or args.model)
    given = (args.calibration_data, args.calibration_samples, args.calibration_max_tokens)
    calibration = None
    if any(v is not None for v in given) or args.method == "gptq":
        calibration = Calibration(
            args.calibration_data,
            DEFAULT_SAMPLES if args.calibration_samples is None else args.calibration_samples,
            DEFAULT_MAX_TOKENS if args.calibration_max_tokens is None else args.calibration_max_tokens,
        )
    try:
        out_dir = quantize_checkpoint(
            args.model,
            output,
            gguf_file=args.gguf_file,
            backend=args.backend,
            method=args.method,
            calibration=calibration,
            overwrite=args.overwrite,
            ignore=tuple(args.ignore),
            quantize_lm_head=args.quantize_lm_head,
            max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        )
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        if environment_error(e) is not None:
            raise  # a full or read-only disk: qerl.cli.run reports it as "cannot write FILE: reason"
        raise UsageError(str(e)) from e
    print(f"wrote {out_dir}")
    if not args.skip_generation:
        print("sample:", sample_generation(out_dir))


if __name__ == "__main__":
    sys.exit(main())
