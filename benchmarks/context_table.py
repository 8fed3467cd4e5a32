"""The context table: the longest completion whose GRPO step runs on this card, per model shape, found by a search.

Each trial is one real step of ``benchmarks.grpo_step`` (random weights in the real shapes, NVFP4, 8 completions of
a 1024-token prompt forced to the trial's length, LoRA r16, the recipe's optimizer, recompute and row chunks as
auto picks them) built afresh, so that an out-of-memory trial leaves nothing behind for the next. The search assumes
that what fits at a length fits at every shorter one: from ``--start`` it doubles while the step runs (or halves while
it does not), then bisects between the longest length that ran and the shortest that did not, on multiples of
``--step``; every trial is recorded. README's context table comes from the result file.

    python -m benchmarks.context_table --shapes 7b 14b 32b --out $OUT/context_table.json    # on one GPU
    python -m benchmarks.context_table --tiny --start 16 --step 8 --ceiling 64 --out /tmp/context.json   # CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import grpo_step
from benchmarks.common import command, device_name, utc_now, versions, write_json


def longest_that_fits(
    runs: Callable[[int], bool], start: int, step: int, ceiling: int
) -> tuple[int | None, int | None, list[int]]:
    """(the longest multiple of ``step`` up to ``ceiling`` for which ``runs`` is true, the shortest for which it is
    false, every length tried in order); None where no length ran, or none failed up to ``ceiling``. ``runs`` must be
    monotonic: true at a length, true at every shorter one."""
    tried: list[int] = []

    def trial(length: int) -> bool:
        tried.append(length)
        return runs(length)

    length = min(max(step, start // step * step), ceiling // step * step)
    ok, bad = (length, None) if trial(length) else (None, length)
    while ok is not None and bad is None and ok < ceiling // step * step:  # up while it runs
        length = min(2 * ok, ceiling // step * step)
        ok, bad = (length, None) if trial(length) else (ok, length)
    while ok is None and bad is not None and bad > step:  # down while it does not
        length = max(bad // 2 // step * step, step)
        ok, bad = (length, bad) if trial(length) else (None, length)
    while ok is not None and bad is not None and bad - ok > step:  # bisect on multiples of step
        length = (ok + bad) // 2 // step * step
        ok, bad = (length, bad) if trial(length) else (ok, length)
    return ok, bad, tried


def search(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """The search for one shape: its rows (one per trial, as grpo_step records them) and the longest that ran."""
    rows: dict[int, dict] = {}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dense = torch.bfloat16 if device.type == "cuda" else torch.float32

    def runs(length: int) -> bool:
        trial = grpo_step.parse(
            (["--tiny"] if args.tiny else ["--shapes", shape])
            + ["--bases", "nvfp4", "--steps", "1", "--n", str(args.n), "--micro-batch", str(args.micro_batch)]
        )
        trial.tokens = length  # after --tiny, which sets its own
        trial.prompt = args.prompt
        row = grpo_step.run_config(shape, True, trial, device, dense)
        rows[length] = row
        print(
            f"{shape} {length} new tokens: {row['status']}, step {row.get('step_s')} s, "
            f"peak {row.get('peak_gb_step')} GB",
            flush=True,
        )
        if row["status"] == "error":
            raise RuntimeError(f"{shape} at {length} new tokens: {row.get('error')}")
        return row["status"] == "ok"

    longest, first_failed, tried = longest_that_fits(runs, args.start, args.step, args.ceiling)
    best = rows.get(longest) if longest is not None else None
    return {
        "shape": shape,
        "longest_new_tokens": longest,
        "shortest_that_failed": first_failed,
        "step_s_at_longest": None if best is None else best.get("step_s"),
        "peak_gb_at_longest": None if best is None else best.get("peak_gb_step"),
        "tried": [{"new_tokens": n, "status": rows[n]["status"], "step_s": rows[n].get("step_s")} for n in tried],
        "rows": [rows[n] for n in tried],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_table", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/context_table.json"))
    parser.add_argument("--shapes", nargs="+", default=["7b", "14b", "32b"], choices=list(grpo_step.SHAPES))
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--micro-batch", type=int, default=1, help="rows per training pass")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--start", type=int, default=8192, help="the first length tried")
    parser.add_argument("--step", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--ceiling", type=int, default=65536, help="the longest length tried")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer tiny model (CPU ok): checks the search")
    args = parser.parse_args(argv)
    for flag in ("n", "micro_batch", "prompt", "start", "step", "ceiling"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    if args.ceiling < args.step:
        parser.error(f"--ceiling: expected at least --step ({args.step}), got {args.ceiling}")
    if args.tiny:
        args.shapes = ["tiny"]
    elif not torch.cuda.is_available():
        parser.error("the real shapes need a CUDA device (use --tiny on CPU)")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    doc = {
        "benchmark": "the longest completion whose GRPO step runs on one card (benchmarks/context_table.py)",
        "date": utc_now(),
        "device": device_name(device),
        "versions": versions("transformers", "trl", "peft", "triton"),
        "command": command("benchmarks.context_table", argv),
        "setup": {k: getattr(args, k) for k in ("n", "micro_batch", "prompt", "start", "step", "ceiling")},
        "results": [search(shape, args) for shape in args.shapes],
    }
    write_json(args.out, doc)
    for r in doc["results"]:
        print(f"{r['shape']}: {r['longest_new_tokens']} new tokens ({r['step_s_at_longest']} s a step)")
    return doc


if __name__ == "__main__":
    main()
