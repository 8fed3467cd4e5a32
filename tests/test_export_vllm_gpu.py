"""vLLM serves ``qerl.export``'s output and reproduces the trained policy (GPU + vLLM only).

The checkpoint is ``$QERL_VLLM_TEST_CKPT`` (an NVFP4A16 checkpoint, e.g. SmolLM2-135M) or a tiny random
Llama quantized here, as in tests/test_vllm_gpu.py, and a tiny random model of each other family quantized here
(Llama 3, Qwen3, Mistral: ``helpers.vllm_checkpoint``). A "trained" adapter is made on it: LoRA r16 with
random B scaled until it moves our next-token log-probs by >= 0.5 nat (the tiny random Llama saturates
below 1 nat: 0.87 on the H200), norms perturbed by 10%. It is
exported both ways (``--format bf16`` and ``--format nvfp4``), each export is loaded by a fresh vLLM
``LLM`` in a child process (one engine per process: vLLM does not free a second in-process engine
cleanly), and vLLM's teacher-forced prompt log-probs are compared with our forward of the *adapter
model* (NVFP4 base + unmerged peft LoRA, bf16 on the GPU).

Bounds: those of tests/test_vllm_gpu.py (mean 0.08 nat + 10% of the adapter's own effect; max
max(0.6, 3% of the largest |logit|)); the NVFP4 export may differ by its re-quantization error on
top (mean and max), measured here as our forward of the NVFP4 export against our forward of the bf16
export, and must keep more than half of the LoRA update (``lora_delta_retained``).

    QERL_VLLM_TEST_CKPT=/path/to/SmolLM2-135M-NVFP4A16 python -m pytest -q -s tests/test_export_vllm_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ_LEN = 64


def serve_prompt_logprobs(model_dir: str, seq: list[int]) -> list[float]:
    """vLLM's log-prob of seq[t] given seq[:t], t = 1..len-1 (runs in the child process)."""
    import vllm

    llm = vllm.LLM(
        model=model_dir,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )  # token ids in and out: no tokenizer needed
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
    out = llm.generate([{"prompt_token_ids": seq}], params, use_tqdm=False)[0]
    return [out.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(seq))]


def served(model_dir: Path, seq: list[int], tmp_path: Path) -> torch.Tensor:
    result = tmp_path / f"{model_dir.name}.json"
    subprocess.run([sys.executable, __file__, str(model_dir), json.dumps(seq), str(result)], check=True, timeout=900)
    return torch.tensor(json.loads(result.read_text()))


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen3", "mistral"])
def test_vllm_serves_both_exports(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    """Per family (issue 73): Llama (the checkpoint above), Llama 3's llama3 RoPE and tied head, Qwen3's q/k norms,
    Mistral's sliding window (400 positions, beyond this test's 64)."""
    pytest.importorskip("vllm")
    from helpers import vllm_checkpoint
    from peft import get_peft_model
    from test_vllm_gpu import EFFECT_REL, MAX_TOL, MAX_TOL_REL, MEAN_TOL, NORM_EFFECT, calibrate, ours

    import qerl
    from qerl.export import export
    from qerl.load.lora import lora_config

    ckpt = vllm_checkpoint(tmp_path_factory, family)
    tmp = tmp_path_factory.mktemp("export")
    model = get_peft_model(
        qerl.load_model(ckpt, load="nvfp4", device="cuda", dtype=torch.bfloat16),
        lora_config(r=16, alpha=32, train_norms=True),
    ).eval()
    seq = torch.randint(0, model.config.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    base, _ = ours(model, seq)
    gen = torch.Generator(device="cuda").manual_seed(1)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    noise = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p in lora_b]

    def set_b(scale: float) -> None:
        for p, z in zip(lora_b, noise, strict=True):
            p.copy_(z * scale)

    calibrate(model, seq, set_b, NORM_EFFECT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype))
    model.save_pretrained(tmp / "adapter")
    ref, logit_scale = ours(model, seq)
    effect = (ref - base).abs().mean().item()
    del model
    torch.cuda.empty_cache()

    dirs = {fmt: tmp / f"export-{fmt}" for fmt in ("bf16", "nvfp4")}
    records = {fmt: export(ckpt, tmp / "adapter", path, fmt=fmt) for fmt, path in dirs.items()}
    ours_export = {
        fmt: ours(qerl.load_model(path, device="cuda", dtype=torch.bfloat16), seq)[0] for fmt, path in dirs.items()
    }
    requant = (ours_export["nvfp4"] - ours_export["bf16"]).abs()
    retained = records["nvfp4"]["lora_delta_retained"]
    print(
        f"\nadapter effect {effect:.3f} nats; NVFP4 re-quantization error mean {requant.mean():.3f} / max "
        f"{requant.max():.3f} nats; LoRA delta retained {retained:.3f}"
    )
    assert retained > 0.5  # the adapter survives re-quantization (else the NVFP4 check means little)
    for fmt, path in dirs.items():
        diff = (served(path, seq, tmp) - ref).abs()
        extra = requant if fmt == "nvfp4" else torch.zeros(1)
        mean_tol = MEAN_TOL + EFFECT_REL * effect + extra.mean().item()
        max_tol = max(MAX_TOL, MAX_TOL_REL * logit_scale) + extra.max().item()
        print(
            f"vLLM on the {fmt} export vs the adapter model: mean {diff.mean():.4f} max {diff.max():.4f} nats "
            f"(bounds {mean_tol:.3f} / {max_tol:.3f})"
        )
        assert diff.mean().item() <= mean_tol and diff.max().item() <= max_tol


if __name__ == "__main__":  # the child process: serve one export, write its prompt log-probs
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    directory, sequence, result_path = sys.argv[1:4]
    Path(result_path).write_text(json.dumps(serve_prompt_logprobs(directory, json.loads(sequence))))
