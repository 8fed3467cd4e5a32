"""The context table: the longest completion whose GRPO step runs on this card, per model shape, found by a search.

Each trial is one real step of ``benchmarks.grpo_step`` (random weights in the real shapes, NVFP4, 8 completions of
a 1024-token prompt forced to the trial's length, LoRA r16, the recipe's optimizer, recompute and row chunks as
auto picks them) built afresh, so that an out-of-memory trial leaves nothing behind for the next. The search assumes
that what fits at a length fits at every shorter one: from ``--start`` it grows by ``--grow`` while the step runs (or
halves while it does not), then bisects between the longest length that ran and the shortest that did not, on
multiples of ``--step``; every trial is recorded. ``--start estimate`` (the default on a GPU) starts from the longest
length that ``qerl.train.memory``'s estimate puts on the card's free memory, as ``python -m qerl.train`` weighs a run:
a long trial takes minutes, so the few trials around a good start are what the device time affords. A search that
needs more than one command's time runs one shape per command, each merged into the table (``--merge-into``).
README's context table comes from the result file.

    python -m benchmarks.context_table --shapes 7b 14b 32b --grow 1.25 --out $OUT/context_table.json   # on one GPU
    python -m benchmarks.context_table --shapes 32b --grow 1.25 --out $OUT/ct.json --merge-into benchmarks/results/context_table.json
    python -m benchmarks.context_table --tiny --start 16 --step 8 --ceiling 64 --out /tmp/context.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import grpo_step
from benchmarks.common import command, device_name, utc_now, versions, write_json


def longest_that_fits(
    runs: Callable[[int], bool], start: int, step: int, ceiling: int, grow: float = 2.0
) -> tuple[int | None, int | None, list[int]]:
    """(the longest multiple of ``step`` up to ``ceiling`` for which ``runs`` is true, the shortest for which it is
    false, every length tried in order); None where no length ran, or none failed up to ``ceiling``. ``runs`` must be
    monotonic: true at a length, true at every shorter one. Upwards each trial is ``grow`` times the last (at least
    one ``step`` more)."""
    tried: list[int] = []

    def trial(length: int) -> bool:
        tried.append(length)
        return runs(length)

    length = min(max(step, start // step * step), ceiling // step * step)
    ok, bad = (length, None) if trial(length) else (None, length)
    while ok is not None and bad is None and ok < ceiling // step * step:  # up while it runs
        length = min(max(int(grow * ok) // step * step, ok + step), ceiling // step * step)
        ok, bad = (length, None) if trial(length) else (ok, length)
    while ok is None and bad is not None and bad > step:  # down while it does not
        length = max(bad // 2 // step * step, step)
        ok, bad = (length, bad) if trial(length) else (None, length)
    while ok is not None and bad is not None and bad - ok > step:  # bisect on multiples of step
        length = (ok + bad) // 2 // step * step
        ok, bad = (length, bad) if trial(length) else (ok, length)
    return ok, bad, tried


def estimated_start(shape: str, args: argparse.Namespace, free: int, total: int) -> int:
    """The longest multiple of ``--step`` up to ``--ceiling`` whose step ``qerl.train.memory.estimate`` puts within
    ``free`` bytes less the headroom (NVFP4, fused layers, no padding, recompute and the engine's cache freed where
    the pass needs it, as auto runs the trials); ``--step`` where none is."""
    from qerl.train.memory import ModelShape, RunShape, estimate
    from qerl.train.recompute import HEADROOM

    config = {**grpo_step.SHAPES[shape], "vocab_size": grpo_step.vocab_size(shape)}
    model, room = ModelShape.from_config(config, nvfp4=True), free - HEADROOM * total

    def fits(length: int) -> bool:
        run = RunShape(args.n, args.micro_batch, args.prompt, length, 16, masked=False, fused=True, release_engine=True)
        return estimate(model, run).peak <= room

    return max((n for n in range(args.step, args.ceiling + 1, args.step) if fits(n)), default=args.step)


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

    start = args.start
    if start == "estimate":
        start = estimated_start(shape, args, *torch.cuda.mem_get_info())
        print(f"{shape}: the memory estimate puts {start} new tokens on this card", flush=True)
    longest, first_failed, tried = longest_that_fits(runs, int(start), args.step, args.ceiling, args.grow)
    best = rows.get(longest) if longest is not None else None
    return {
        "shape": shape,
        "start": start,
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
    parser.add_argument(
        "--start", default="estimate", help="the first length tried, or 'estimate' (the memory estimate's; GPU only)"
    )
    parser.add_argument("--grow", type=float, default=2.0, help="upwards, each length this many times the last")
    parser.add_argument("--step", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--ceiling", type=int, default=65536, help="the longest length tried")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer tiny model (CPU ok): checks the search")
    parser.add_argument("--merge-into", type=Path, help="a table of earlier shapes: write it with these added")
    args = parser.parse_args(argv)
    if args.start != "estimate":
        try:
            args.start = int(args.start)
        except ValueError:
            parser.error(f"--start: expected a positive integer or 'estimate', got {args.start!r}")
    for flag in ("n", "micro_batch", "prompt", "step", "ceiling") + (("start",) if args.start != "estimate" else ()):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    if not args.grow > 1:
        parser.error(f"--grow: expected a factor above 1, got {args.grow}")
    if args.ceiling < args.step:
        parser.error(f"--ceiling: expected at least --step ({args.step}), got {args.ceiling}")
    if args.tiny:
        args.shapes = ["tiny"]
        if args.start == "estimate":
            parser.error("--start estimate: the estimate is of the real shapes; give --tiny a length")
    elif not torch.cuda.is_available():
        parser.error("the real shapes need a CUDA device (use --tiny on CPU)")
    if args.merge_into is not None and not args.merge_into.is_file():
        parser.error(f"--merge-into {args.merge_into}: no such file (a table this benchmark wrote)")
    return args


def merged(doc: dict[str, Any], into: Path) -> dict[str, Any]:
    """``into``'s table with ``doc``'s shapes in place of its own, and both commands; a table of another setup (its
    prompt, completions, micro-batch or step) is refused in one line."""
    old = json.loads(into.read_text())
    keys = ("n", "micro_batch", "prompt", "step")
    if not isinstance(old, dict) or {k: old.get("setup", {}).get(k) for k in keys} != {
        k: doc["setup"][k] for k in keys
    }:
        raise SystemExit(f"--merge-into {into}: expected a context table of the same setup ({keys}), not merged")
    shapes = {r["shape"] for r in doc["results"]}
    results = [r for r in old["results"] if r["shape"] not in shapes] + doc["results"]
    return {**doc, "command": f"{old['command']} ; {doc['command']}", "results": results}


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
        "setup": {k: getattr(args, k) for k in ("n", "micro_batch", "prompt", "start", "grow", "step", "ceiling")},
        "results": [search(shape, args) for shape in args.shapes],
    }
    if args.merge_into is not None:
        doc = merged(doc, args.merge_into)
    write_json(args.out, doc)
    for r in doc["results"]:
        print(f"{r['shape']}: {r['longest_new_tokens']} new tokens ({r['step_s_at_longest']} s a step)")
    return doc


if __name__ == "__main__":
    main()
