"""What the integrity check at load (``qerl.load.integrity``) costs: its share of loading a 7B NVFP4 checkpoint.

Every command that reads a checkpoint checks each tensor once, where it was loaded (finite, in its format's
range). The check must not make loading noticeably slower: the target is under 2% of the load. The checkpoint has
Qwen2.5-7B's shapes and random NVFP4 tensors written straight to safetensors (:func:`synthetic_checkpoint`: valid
codes and scales, no quantizer run, about 20 s for the 5.85 GB on a GPU host), loaded by ``qerl.load.loader.load_model``
exactly as train, eval and export load it. Two measures, both in one process:

* ``check_s``: what the checks of a load cost on their own: right after the load, the same checks (the loader's
  ``Verdicts`` over the tensors it checked, in its order) run again, alone, synchronized before and after, and
  timed by the wall clock (median of 3), beside that load's wall time: the direct share. On a GPU this counts host
  and device time one after the other, where in the load the device time overlaps the copies: a bound from above;
* an A/B of whole loads, the checks on and off (``Verdicts`` replaced by no-ops), in pairs run back to back
  (alternating which goes first), after one discarded load that fills the page cache: the median paired
  difference over the median unchecked load, the share as a user would see it (far noisier than the first:
  on a shared 2-core machine single loads vary by a second).

    python -m benchmarks.integrity --dir /tmp/ck7b --repeats 8 --out benchmarks/results/integrity.json
    python -m benchmarks.integrity --dir /tmp/cktiny --tiny --repeats 1 --out /tmp/integrity.json   # smoke run

On a GPU the load goes to the device and the checks run there; the result names the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import qerl.load.loader
from benchmarks.common import MAX_POSITIONS, command, device_name, utc_now, versions, write_json
from benchmarks.e2e import model_shape
from qerl import checkpoint
from qerl.fsutil import atomic_directory
from qerl.load.headers import expected_tensors
from qerl.load.integrity import Verdicts

#: The share of the load the check may take.
TARGET_SHARE = 0.02


@contextmanager
def checks(mode: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The loader's ``Verdicts`` as they are, noting each tensor they check (``"on"``), or no-ops (``"off"``);
    yields the (name, tensor) pairs checked, in order."""
    real: type[Verdicts] = qerl.load.loader.Verdicts
    checked: list[tuple[str, torch.Tensor]] = []

    class Noted(Verdicts):
        def add(self, name: str, tensor: torch.Tensor) -> None:
            checked.append((name, tensor))
            super().add(name, tensor)

    class Off(Verdicts):
        def add(self, name: str, tensor: torch.Tensor) -> None:
            pass

        def finish(self) -> None:
            pass

    qerl.load.loader.Verdicts = Noted if mode == "on" else Off
    try:
        yield checked
    finally:
        qerl.load.loader.Verdicts = real


def replay(checked: list[tuple[str, torch.Tensor]], where: Path, device: torch.device) -> float:
    """Wall seconds of one load's checks run again, alone: host and device, synchronized before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    verdicts = Verdicts(where)
    for name, tensor in checked:
        verdicts.add(name, tensor)
    verdicts.finish()
    sync()
    return time.perf_counter() - start


def synthetic_checkpoint(root: Path, tiny: bool) -> Path:
    """``root/nvfp4``: a Qwen2 NVFP4A16 checkpoint of Qwen2.5-7B's shapes (a 2-layer one with ``tiny``), every
    decoder Linear packed, its tensors random but valid (codes uniform, block scales in [0.25, 1.75), global scale
    150, norms 1, the rest N(0, 0.02) in bf16), generated on the GPU when there is one; kept if already complete.
    The tensor list, shapes and dtypes are the ones ``qerl.load.headers.expected_tensors`` derives from the config,
    which the export checks checkpoints against."""
    from transformers import Qwen2Config

    out = root / "nvfp4"
    if (out / "config.json").exists():
        return out
    shape, vocab = model_shape(tiny)
    config = Qwen2Config(
        vocab_size=vocab, max_position_embeddings=MAX_POSITIONS, rope_theta=1e6, tie_word_embeddings=False, **shape
    ).to_dict()
    config["quantization_config"] = checkpoint.quantization_config(["lm_head"])
    layers = [
        f"model.layers.{i}.{m}"
        for i in range(shape["num_hidden_layers"])
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    with atomic_directory(out) as tmp:  # complete or absent
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        expected, _ = expected_tensors(tmp, set(layers))
        writer = checkpoint.ShardWriter(tmp)
        for name, (shape_, dtypes) in expected.items():
            writer.add(name, _random(name, shape_, dtypes, gen, device).cpu())
        writer.finish()
    return out


def _random(
    name: str, shape: tuple[int, ...], dtypes: frozenset[str], gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One random tensor that passes ``qerl.load.integrity``'s checks, in the (first) dtype the model expects."""
    if dtypes == {"U8"}:
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
    if dtypes == {"F8_E4M3"}:
        return (torch.rand(shape, generator=gen, device=device) * 1.5 + 0.25).to(torch.float8_e4m3fn)
    if name.endswith(checkpoint.GLOBAL_SCALE):
        return torch.full(shape, 150.0, device=device)
    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)


def timed_load(model_dir: Path, device: torch.device, dtype: torch.dtype, mode: str) -> dict[str, float]:
    """One whole load with checks ``mode``: its wall seconds and, checks on, the seconds of its checks on their own
    (:func:`replay`, median of 3)."""
    with checks(mode) as checked:
        start = time.perf_counter()
        model = qerl.load.loader.load_model(model_dir, device=device, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - start
    check_s = statistics.median(replay(checked, model_dir, device) for _ in range(3)) if checked else 0.0
    row = {"load_s": load_s, "check_s": check_s, "tensors_checked": len(checked)}
    del model, checked
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def measure(model_dir: Path, device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """One discarded load (page cache), then ``repeats`` pairs of loads with the checks on and off, alternating
    which goes first."""
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
        # to the microsecond: the checks of a tiny checkpoint take about a millisecond, where 4 decimals would
        # round a share computed back from these lists by up to 5%
        "load_s_checks_on": [round(r["load_s"], 6) for r in on],
        "load_s_checks_off": [round(r["load_s"], 6) for r in off],
        "check_s": [round(r["check_s"], 6) for r in on],
        "paired_difference_s": [round(d, 6) for d in paired],
        "check_share_of_load": round(statistics.median(shares), 5),
        "ab_share_of_load": round(statistics.median(paired) / load_off, 5),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="where the synthetic checkpoint is kept (made if absent)")
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
    model_dir = synthetic_checkpoint(args.dir, args.tiny)
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
        "versions": versions("transformers", "safetensors"),
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
