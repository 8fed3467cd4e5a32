"""How far one bf16 forward of an NVFP4 checkpoint sits from the exact (fp32) one: the noise floor of
``tests/test_vllm_gpu.py``'s comparison of vLLM with our forward.

    python -m benchmarks.bf16_noise [--methods rtn gptq] [--sequences 8] [--out benchmarks/results/bf16_noise_cpu.json]

Each method's checkpoint of the embedded SmolLM2-135M is written to a temporary folder of this run's
own; both forwards dequantize the same codes (our loader, CPU), one with fp32 activations and
weights, one with bf16. On sequences made as that test makes them (16 random prompt tokens, 48 tokens
sampled from the fp32 model, a fixed seed per sequence), the mean and max over the 63 scored
positions of |teacher-forced log-prob (bf16) - (fp32)|, per sequence, and their mean and standard
deviation over sequences. Two correct bf16 implementations (vLLM: Marlin + punica + FlashAttention;
ours: dequantize + cuBLAS + SDPA) each sit about this far from exact, so their gap can reach up to
twice it (triangle inequality), and a 63-token mean varies by the standard deviation shown.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import command, device_name, utc_now, versions, write_json

PROMPT_LEN, SEQ_LEN = 16, 64  # as tests/test_vllm_gpu.py


@torch.no_grad()
def sequence_noise(m32: torch.nn.Module, m16: torch.nn.Module, seed: int) -> dict:
    """One test-like sequence: |log-prob difference| of bf16 vs fp32 over its scored positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m32.config.vocab_size, (1, PROMPT_LEN), generator=gen)
    for _ in range(SEQ_LEN - PROMPT_LEN):
        logits = m32(input_ids=ids).logits[0, -1].float()
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)[None]], dim=1)
    logprobs, largest = [], 0.0
    for model in (m32, m16):
        logits = model(input_ids=ids).logits[0, :-1].float()
        logprobs.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])
        largest = max(largest, logits.abs().max().item())
    diff = (logprobs[0] - logprobs[1]).abs()
    return {
        "mean": round(diff.mean().item(), 5),
        "max": round(diff.max().item(), 4),
        "max_abs_logit": round(largest, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq"], choices=["rtn", "mse", "gptq"])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16_noise_cpu.json"))
    args = ap.parse_args()
    import qerl
    from qerl.hub import embedded_model_dir
    from qerl.quantize.pipeline import quantize_checkpoint

    src = embedded_model_dir()
    result = {
        "benchmark": "bf16 vs fp32 teacher-forced log-probs of our forward (the vLLM test's noise floor)",
        "date": utc_now(),
        "device": device_name(torch.device("cpu")),
        "versions": versions("transformers", "compressed-tensors"),
        "command": command("benchmarks.bf16_noise"),
        "setup": {"model": "SmolLM2-135M-Instruct (embedded)", "prompt_tokens": PROMPT_LEN, "sequence_tokens": SEQ_LEN},
        "methods": {},
    }
    with tempfile.TemporaryDirectory(prefix="qerl-bf16-noise-") as tmp:
        for method in args.methods:
            ckpt = quantize_checkpoint(src, Path(tmp) / method, method=method)
            m32 = qerl.load_model(ckpt, load="nvfp4", device="cpu", dtype=torch.float32).eval()
            m16 = qerl.load_model(ckpt, load="nvfp4", device="cpu", dtype=torch.bfloat16).eval()
            rows = [sequence_noise(m32, m16, seed) for seed in range(args.sequences)]
            means = torch.tensor([r["mean"] for r in rows])
            result["methods"][method] = {
                "sequences": rows,
                "mean": round(means.mean().item(), 5),
                "sd_over_sequences": round(means.std().item(), 5),
            }
            print(
                f"{method}: bf16 vs fp32 mean |d log-prob| {means.mean():.4f} (sd over {len(rows)} sequences "
                f"{means.std():.4f}; per sequence {[r['mean'] for r in rows]})",
                flush=True,
            )
            write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
