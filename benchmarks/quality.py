"""NVFP4 vs bf16 quality of the embedded default, per quantization method (rtn / mse / gptq).

    python -m benchmarks.quality [--data ../shared/data/gsm8k/train.jsonl] [--n 50] [--methods rtn mse gptq]
                                 [--calibration-samples 128] [--layers] [--out benchmarks/results/quality_cpu.json]

For each method the embedded SmolLM2-135M is quantized in a child process (wall time and that
process's peak RSS are the method's quantize cost), then scored against the bf16 model on the same
texts: perplexity (over all tokens but the first), top-1 next-token agreement with bf16, and the
mean per-token KL(bf16 || NVFP4). Each text is a GSM8K training question followed by its reference
answer, the first ``--n`` rows; gptq calibrates on the bundled rows at the end of the same split
(``qerl.quantize.calibration``), so no scored text was calibrated on. ``gap_closed`` is the share of
rtn's perplexity gap to bf16 that a method removes.

``--layers`` adds the weight reconstruction error of rtn and mse on random Gaussian weights of the
Qwen2.5-7B layer shapes (no data: gptq, which minimises output error on calibration activations,
has nothing to work with there; no model either, so mse weighs all input columns alike), with each
layer's quantize time.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import SHAPES, command, device_name, utc_now, versions, write_json
from qerl import nvfp4
from qerl.hub import embedded_model_dir
from qerl.load.loader import load_model, load_tokenizer
from qerl.quantize import mse
from qerl.quantize.calibration import DEFAULT_SAMPLES, Calibration
from qerl.quantize.pipeline import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def layer_shapes(shape: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of a decoder's distinct Linear shapes."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {"q_proj/o_proj": (h, h), "k_proj/v_proj": (kv, h), "gate_proj/up_proj": (i, h), "down_proj": (h, i)}


def texts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [f"{r['question']}\n{r['answer']}" for r in rows]


def quantize_one(method: str, out: Path, samples: int) -> dict[str, float]:
    """Quantize the embedded model in this process; its wall time and peak RSS (run as a child)."""
    torch.set_num_threads(1)
    start = time.time()
    calibration = Calibration(samples=samples) if method == "gptq" else None
    quantize_checkpoint(embedded_model_dir(), out, method=method, calibration=calibration)
    return {
        "quantize_seconds": round(time.time() - start, 1),
        "quantize_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def quantize_in_child(method: str, out: Path, samples: int) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.quality",
        "--quantize-one",
        method,
        str(out),
        "--calibration-samples",
        str(samples),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"quantize --method {method} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@torch.no_grad()
def compare(dense_dir: Path, quant_dirs: dict[str, Path], samples: list[str]) -> dict[str, Any]:
    """Perplexity of bf16 and of each quantized model, top-1 agreement and KL to bf16, on ``samples``."""
    tok = load_tokenizer(dense_dir)
    dense = load_model(dense_dir, device="cpu")
    quant = {m: load_model(d, device="cpu") for m, d in quant_dirs.items()}
    tokens = 0
    nll = dict.fromkeys(["bf16", *quant], 0.0)
    agree, kl = dict.fromkeys(quant, 0), dict.fromkeys(quant, 0.0)
    for text in samples:
        ids = tok(text, return_tensors="pt").input_ids
        target = ids[0, 1:]
        ref = dense(ids).logits[0, :-1].float().log_softmax(-1)
        nll["bf16"] -= ref.gather(1, target[:, None]).sum().item()
        for m, model in quant.items():
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
            nll[m] -= logp.gather(1, target[:, None]).sum().item()
            agree[m] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            kl[m] += (ref.exp() * (ref - logp)).sum().item()
        tokens += target.numel()
    ppl = {m: math.exp(v / tokens) for m, v in nll.items()}
    rtn_gap = ppl["rtn"] - ppl["bf16"] if "rtn" in ppl else None
    methods = {
        m: {
            "ppl": ppl[m],
            "ppl_gap_to_bf16": ppl[m] - ppl["bf16"],
            "gap_closed": None if not rtn_gap else (ppl["rtn"] - ppl[m]) / rtn_gap,
            "top1_agreement": agree[m] / tokens,
            "kl_to_bf16": kl[m] / tokens,
        }
        for m in quant
    }
    return {"texts": len(samples), "tokens": tokens, "ppl_bf16": ppl["bf16"], "methods": methods}


def layer_errors(seed: int = 0) -> dict[str, Any]:
    """rtn and mse on random N(0, 0.02) bf16 weights of the 7B shapes: relative squared error, time."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for name, shape in layer_shapes(SHAPES["7b"]).items():
        w = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        row: dict[str, Any] = {"shape": list(shape)}
        for method, quantize in (("rtn", nvfp4.quantize), ("mse", mse.quantize)):
            start = time.time()
            q = quantize(w)
            seconds = time.time() - start
            err = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float32) - w.float()
            row[method] = {
                "rel_sq_error": (err.square().sum() / w.float().square().sum()).item(),
                "seconds": round(seconds, 2),
            }
        rows[name] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=str(ROOT.parent / "shared/data/gsm8k/train.jsonl"))
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--methods", nargs="+", default=["rtn", "mse", "gptq"], choices=["rtn", "mse", "gptq"])
    p.add_argument("--calibration-samples", type=int, default=DEFAULT_SAMPLES)
    p.add_argument("--layers", action="store_true", help="add rtn/mse error on random 7B-shaped weights")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality_cpu.json"))
    p.add_argument("--quantize-one", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quantize_one:
        print(json.dumps(quantize_one(args.quantize_one[0], Path(args.quantize_one[1]), args.calibration_samples)))
        return
    torch.set_num_threads(1)
    dense_dir = embedded_model_dir()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        costs = {m: quantize_in_child(m, Path(tmp) / m, args.calibration_samples) for m in args.methods}
        result = compare(dense_dir, {m: Path(tmp) / m for m in args.methods}, texts(Path(args.data), args.n))
    for m, cost in costs.items():
        result["methods"][m].update(cost)
    if "gptq" in args.methods:
        result["methods"]["gptq"]["calibration"] = (
            f"{args.calibration_samples} bundled GSM8K training rows "
            "(qerl/quantize/gsm8k_calibration.jsonl), chat-templated, <= 512 tokens"
        )
    if args.layers:
        result["random_7b_layers"] = layer_errors()
    result.update(
        {
            "model": "SmolLM2-135M-Instruct (embedded default; bf16 from the Q4_1 GGUF)",
            "date": utc_now(),
            "device": device_name(torch.device("cpu")) + ", fp32 activations",
            "versions": versions("transformers", "compressed_tensors", "llmcompressor"),
            "command": command("benchmarks.quality"),
            "seconds": round(time.time() - start, 1),
        }
    )
    write_json(Path(args.out), result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
