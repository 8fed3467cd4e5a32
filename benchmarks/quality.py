"""NVFP4 vs bf16 quality of the embedded default: top-1 agreement and perplexity on GSM8K texts.

    python benchmarks/quality.py [--data ../shared/data/gsm8k/train.jsonl] [--n 50]

Each text is a GSM8K training question followed by its reference answer; perplexity is over all
tokens but the first. Writes benchmarks/results/quality_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qerl.hub import embedded_model_dir  # noqa: E402
from qerl.loader import load_model, load_tokenizer  # noqa: E402
from qerl.quantize import quantize_checkpoint  # noqa: E402


def texts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [f"{r['question']}\n{r['answer']}" for r in rows]


@torch.no_grad()
def compare(dense_dir: Path, quant_dir: Path, samples: list[str]) -> dict:
    tok = load_tokenizer(dense_dir)
    dense, quant = load_model(dense_dir, device="cpu"), load_model(quant_dir, device="cpu")
    agree = tokens = 0
    nll = {"bf16": 0.0, "nvfp4": 0.0}
    for text in samples:
        ids = tok(text, return_tensors="pt").input_ids
        target = ids[0, 1:]
        for name, model in (("bf16", dense), ("nvfp4", quant)):
            logits = model(ids).logits[0, :-1].float()
            nll[name] += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            if name == "bf16":
                ref = logits.argmax(-1)
            else:
                agree += (logits.argmax(-1) == ref).sum().item()
        tokens += target.numel()
    return {
        "texts": len(samples),
        "tokens": tokens,
        "top1_agreement": agree / tokens,
        "ppl_bf16": math.exp(nll["bf16"] / tokens),
        "ppl_nvfp4": math.exp(nll["nvfp4"] / tokens),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl"))
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "quality_cpu.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    dense_dir = embedded_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        quant_dir = quantize_checkpoint(dense_dir, Path(tmp) / "q")
        start = time.time()
        result = compare(dense_dir, quant_dir, texts(Path(args.data), args.n))
    result.update({
        "model": "SmolLM2-135M-Instruct (embedded default; bf16 from the Q4_1 GGUF)",
        "date": time.strftime("%Y-%m-%d"),
        "device": f"cpu ({platform.processor() or platform.machine()}), fp32 activations",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:]),
        "seconds": round(time.time() - start, 1),
    })
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
