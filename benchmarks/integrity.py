"""What the integrity check at load (``qerl.integrity``) costs: its share of loading a 7B NVFP4 checkpoint.

Every command that reads a checkpoint checks each tensor once, where it was loaded (finite, in its format's
range). The check must not make loading noticeably slower: the target is under 2% of the load. The checkpoint is
``benchmarks.e2e prepare``'s (Qwen2.5-7B shapes, random weights, NVFP4 from our quantizer), loaded by
``qerl.loader.load_model`` exactly as train, eval and export load it. Two measures, both in one process:

* ``check_s``: the time spent inside the checks during a load (a timer around ``qerl.loader.check_tensor``),
  beside that load's wall time: the direct share;
* an A/B of whole loads, checks on and off (``check_tensor`` replaced by a no-op), in pairs run back to back
  (alternating which goes first), after one discarded load that fills the page cache: the median paired
  difference over the median unchecked load, the share as a user would see it (far noisier than the first:
  on a shared 2-core machine single loads vary by a second).

    python -m benchmarks.integrity --dir .e2e --repeats 8 --out benchmarks/results/integrity.json
    python -m benchmarks.integrity --dir /tmp/e2e --tiny --repeats 1 --out /tmp/integrity.json   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import qerl.loader
from benchmarks.common import command, device_name, utc_now, versions, write_json
from benchmarks.e2e import prepare

#: The share of the load the check may take.
TARGET_SHARE = 0.02


@contextmanager
def checks(mode: str) -> Iterator[list[float]]:
    """``qerl.loader.check_tensor`` timed (``"on"``) or replaced by a no-op (``"off"``); yields the list that
    collects each check's seconds."""
    real: Callable[..., None] = qerl.loader.check_tensor
    spent: list[float] = []

    def timed(name: str, tensor: torch.Tensor, where: object) -> None:
        start = time.perf_counter()
        real(name, tensor, where)  # its reductions end in a host read: the timer needs no sync of its own
        spent.append(time.perf_counter() - start)

    qerl.loader.check_tensor = timed if mode == "on" else (lambda name, tensor, where: None)
    try:
        yield spent
    finally:
        qerl.loader.check_tensor = real


def timed_load(model_dir: Path, device: torch.device, dtype: torch.dtype, mode: str) -> dict[str, float]:
    """One whole load with checks ``mode``: its wall seconds, and the seconds spent in the checks."""
    with checks(mode) as spent:
        start = time.perf_counter()
        model = qerl.loader.load_model(model_dir, device=device, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - start
    tensors = len(spent)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"load_s": load_s, "check_s": sum(spent), "tensors_checked": tensors}


def measure(model_dir: Path, device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """One discarded load (page cache), then ``repeats`` pairs of loads with checks on and off, alternated."""
    timed_load(model_dir, device, dtype, "off")
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    for i in range(repeats):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            (on if mode == "on" else off).append(timed_load(model_dir, device, dtype, mode))
    load_off = statistics.median(r["load_s"] for r in off)
    paired = [a["load_s"] - b["load_s"] for a, b in zip(on, off, strict=True)]  # each pair ran back to back
    shares = [r["check_s"] / r["load_s"] for r in on]
    return {
        "checkpoint_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        "tensors_checked": on[0]["tensors_checked"],
        "load_s_checks_on": [round(r["load_s"], 4) for r in on],
        "load_s_checks_off": [round(r["load_s"], 4) for r in off],
        "check_s": [round(r["check_s"], 4) for r in on],
        "paired_difference_s": [round(d, 4) for d in paired],
        "check_share_of_load": round(statistics.median(shares), 5),
        "ab_share_of_load": round(statistics.median(paired) / load_off, 5),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="benchmarks.e2e prepare's directory (made if absent)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama: a smoke run")
    p.add_argument("--device", default=None, help="where the model loads (cuda if there is one, else cpu)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the non-quantized tensors' dtype (what a GPU load uses by default)",
    )
    p.add_argument("--repeats", type=int, default=3, help="pairs of loads, checks on and off")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = prepare(args.dir, args.tiny)["nvfp4"]
    row = measure(model_dir, device, getattr(torch, args.dtype), args.repeats)
    summary = {
        "check_share_of_load": row["check_share_of_load"],
        "ab_share_of_load": row["ab_share_of_load"],
        "target_share": TARGET_SHARE,
        "met": row["check_share_of_load"] < TARGET_SHARE,
    }
    doc = {
        "benchmark": "integrity",
        "date": utc_now(),
        "device": device_name(device),
        "versions": versions("transformers"),
        "command": command("benchmarks.integrity", argv),
        "model": "qwen2.5-7b shapes" if not args.tiny else "tiny",
        "dtype": args.dtype,
        "summary": summary,
        "row": row,
    }
    write_json(args.out, doc)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
