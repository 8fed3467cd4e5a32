"""What the benchmark scripts share: CUDA-graph timing over rotating weight copies, the copy
bandwidth it is compared with, random models of the real Qwen2.5 shapes, child processes that stop
with their driver (``run_stoppable``), and the environment block, command line and atomic JSON write of
every result file.

Importable without a GPU or Triton (the CPU tests import the scripts): the Triton kernels are
imported where a GPU path first needs them.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qerl import nvfp4
from qerl.fsutil import atomic_file, atomic_write_text

#: Decoder shapes of Qwen2.5-7B (hidden 3584, intermediate 18944, 28 q / 4 kv heads of 128), -14B and -32B.
SHAPES = {
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
    "14b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8
    ),
    "32b": dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8
    ),
    # Qwen3-8B / -32B (their config.json): heads of 128 whatever the hidden size (32B: 64 x 128 = 8192 > 5120).
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "qwen3-32b": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
    ),
    # Llama-3.1-8B (its config.json): heads of 128, untied LM head; its RoPE is FAMILY_CONFIGS'.
    "llama3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
}
#: Qwen2.5's vocabulary (7B and up; untied LM head).
VOCAB = 152064
#: The shapes that are not Qwen2.5's: their model_type and vocabulary (Qwen3: 151936, untied from 8B up).
MODEL_TYPES = {"qwen3-8b": "qwen3", "qwen3-32b": "qwen3", "llama3.1-8b": "llama"}
VOCABS = {"qwen3-8b": 151936, "qwen3-32b": 151936, "llama3.1-8b": 128256}
#: Positions the real Qwen2.5-7B/32B configs declare; the random models and vLLM's config-only dirs declare the same.
MAX_POSITIONS = 32768
#: Config a shape's family sets beyond the dimensions, where it is not Qwen2.5's (``MAX_POSITIONS``, rope theta 1e6):
#: Llama 3.1's 128k context and its ``llama3`` frequency scaling past 8,192 positions (its config.json's values).
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}
#: Prompt tokens of every rollout benchmark row (benchmarks/rollout.py, rollout_vllm.py).
PROMPT = 256
#: Bytes of weight copies a timing rotates over: > 4x the H200's 60 MB L2, so every call reads HBM.
ROTATE_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------- timing


def graph_time(fns: list[Callable[[], Any]], target_s: float = 2e-3, replays: int = 15) -> float:
    """Median seconds per call of a CUDA graph that runs ``fns`` round-robin (R calls per replay)."""
    for fn in fns:
        fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) / len(fns), 1e-6)
    reps = max(len(fns), min(256, int(target_s / est)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(reps):
                fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second) on 1 GiB, two ways.

    ``copy_`` inside a CUDA graph becomes a memcpy node (copy engines, slower), so the eager
    ``copy_`` (event-timed median) and an SM copy kernel in a graph (``mul(src, 1)``) are both
    measured; the larger (``max``) is the ceiling.
    """
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * 4
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    eager = nbytes / statistics.median(times)
    kernel = nbytes / graph_time([lambda: torch.mul(src, 1.0, out=dst)], target_s=20e-3)
    return {"eager_copy": eager, "graph_mul_copy": kernel, "max": max(eager, kernel)}


class Layer:
    """Rotating copies of one quantized weight, its bf16 dequantization and activations: each
    ``*_fns`` list holds one call per copy, for ``graph_time``."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = nvfp4.quantize(w)
        self.packed_bytes = nvfp4.packed_nbytes(n, k)
        copies = max(1, -(-ROTATE_BYTES // self.packed_bytes))
        self.q = [q] + [
            nvfp4.NVFP4Tensors(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
            for _ in range(copies - 1)
        ]
        wd = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.bfloat16)
        self.w = [wd] + [wd.clone() for _ in range(max(1, -(-ROTATE_BYTES // (2 * n * k))) - 1)]

    def fwd_fns(self, x: torch.Tensor, config: Any = None) -> list[Callable[[], torch.Tensor]]:
        """``fp4_gemm.matmul`` per copy; where it runs a Gluon kernel (``gluon_kernel``) x is handed over in that
        kernel's K order, as the rollout engine's producers write it (no permute inside the timed call), and launched as
        the engine launches it (``pdl``: the calls of the graph overlap as the engine's chain of kernels does)."""
        from qerl.kernels import fp4_gemm as fg
        from qerl.kernels import gluon_layout

        gluon_k = config is None and fg.gluon_kernel(x.shape[0], self.n, self.k, x.dtype, x.device) is not None
        xin = gluon_layout.to_gluon_k(x) if gluon_k else x
        return [
            lambda q=q: fg.matmul(
                xin,
                q,
                config=config,
                gluon_k=gluon_k,
                pdl=gluon_k,
            )
            for q in self.q
        ]

    def bwd_fns(self, gy: torch.Tensor, config: Any = None) -> list[Callable[[], torch.Tensor]]:
        from qerl.kernels import fp4_gemm as fg

        return [lambda q=q: fg.matmul_t(gy, q, config=config) for q in self.q]

    def dq_fwd_fns(self, x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        """The large-M path: dequantize to bf16, then cuBLAS."""
        from qerl.kernels import fp4_gemm as fg

        return [lambda q=q: F.linear(x, fg.dequantize(q)) for q in self.q]

    def dq_bwd_fns(self, gy: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        from qerl.kernels import fp4_gemm as fg

        return [lambda q=q: gy @ fg.dequantize(q) for q in self.q]

    def dequant_fns(self, block: tuple[int, int, int]) -> list[Callable[[], torch.Tensor]]:
        """The dequantize kernel alone, with program ``block`` (rows, int32 words, warps)."""
        from qerl.kernels import fp4_gemm as fg

        return [lambda q=q: fg.dequantize(q, block=block) for q in self.q]

    def bf16_fwd_fns(self, x: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        return [lambda w=w: F.linear(x, w) for w in self.w]

    def bf16_bwd_fns(self, gy: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
        return [lambda w=w: gy @ w for w in self.w]

    def free(self) -> None:
        self.q.clear()
        self.w.clear()


# ---------------------------------------------------------------------------------------------- children


class _Stopped(Exception):
    """A SIGTERM reached this process while ``run_stoppable``'s child ran."""


def _stop(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: a second signal must not cut the cleanup short
    raise _Stopped(signal.Signals(signum).name)


def run_stoppable_group(calls: list[tuple[list[str], dict[str, Any]]]) -> tuple[list[int], str | None]:
    """Run every ``(cmd, popen_kwargs)`` of ``calls`` at once, each in a process group of its own: ``(their exit
    codes, None)``, or, when this process gets a SIGTERM meanwhile (``timeout``'s signal), every group still
    running terminated and ``(their exit codes, "SIGTERM")``, so the caller can keep what the children finished
    and stop. Without this a time limit kills only the driver: the children (a vLLM engine, training runs and
    their own children) keep the GPU for whatever the caller runs next, and their rows are lost. Main thread
    only (Python's signal handlers run there)."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        children = [subprocess.Popen(cmd, start_new_session=True, **kwargs) for cmd, kwargs in calls]
        try:
            return [child.wait() for child in children], None
        except _Stopped as stop:
            for child in children:
                if child.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # it may end between poll and kill
                        os.killpg(child.pid, signal.SIGTERM)
            return [child.wait() for child in children], str(stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_stoppable(cmd: list[str], **popen_kwargs: Any) -> tuple[int, str | None]:
    """``run_stoppable_group`` of one command: ``(exit code, None)`` or ``(exit code, "SIGTERM")``."""
    codes, stopped = run_stoppable_group([(cmd, popen_kwargs)])
    return codes[0], stopped


# ---------------------------------------------------------------------------------------------- models


def model_type(shape: str) -> str:
    """The ``model_type`` of a ``SHAPES`` entry (Qwen2.5's ``qwen2`` unless ``MODEL_TYPES`` says otherwise)."""
    return MODEL_TYPES.get(shape, "qwen2")


def family_config(shape: str) -> dict[str, Any]:
    """The config of a ``SHAPES`` entry beyond its dimensions: context length and RoPE (``FAMILY_CONFIGS``)."""
    return {"max_position_embeddings": MAX_POSITIONS, "rope_theta": 1e6, **FAMILY_CONFIGS.get(shape, {})}


def vocab_size(shape: str) -> int:
    """The vocabulary of a ``SHAPES`` entry."""
    return VOCABS.get(shape, VOCAB)


def head_dim(shape: dict[str, int]) -> int:
    """Per-head width: the config's ``head_dim`` where it sets one (Qwen3), else hidden / heads."""
    return shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])


def random_model(
    shape: dict[str, int],
    vocab: int,
    nvfp4: bool,
    device: torch.device,
    dtype: torch.dtype,
    arch: str = "qwen2",
    seed: int = 0,
    **config: Any,
) -> nn.Module:
    """A random causal LM of ``arch`` (``qwen2``, ``qwen3`` or ``llama``) and ``shape``, built by ``random_causal_lm``:
    32768 positions (as the real Qwen2.5 configs declare: vLLM refuses prompt + tokens beyond it), rope theta 1e6,
    untied LM head, ``config`` on top (e.g. token ids, or a shape's ``family_config``)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    cfg = config_cls(
        vocab_size=vocab,
        tie_word_embeddings=False,
        **{"max_position_embeddings": MAX_POSITIONS, "rope_theta": 1e6, **shape, **config},
    )
    return random_causal_lm(model_cls, cfg, nvfp4, device, dtype, seed)


def random_causal_lm(
    model_cls: type, cfg: object, nvfp4: bool, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """``model_cls(cfg)`` built straight on ``device`` (no dense copy of an NVFP4 model ever exists),
    decoder Linears as ``NVFP4Linear`` when ``nvfp4`` (lm_head stays ``dtype``, as in a real checkpoint),
    filled at random: FP4 codes uniform (never time on zeros), block scales in [0.25, 1.75), global
    scale 150 (weights of rms ~0.02), norms 1, everything else N(0, 0.02)."""
    from qerl.load.linear import NVFP4Linear, replace_linears, stack_fused_groups

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg)
            if nvfp4:
                replace_linears(
                    model, lambda name, lin: None if name == "lm_head" else NVFP4Linear.empty_like(lin, dtype)
                )
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=device, dtype=torch.uint8))
            elif t.dtype == torch.float8_e4m3fn:
                t.copy_((torch.rand(t.shape, generator=gen, device=device) * 1.5 + 0.25).to(t.dtype))
            elif name.endswith("weight_global_scale"):
                t.fill_(150.0)  # E2M1 rms 2.9 x scale ~1 / 150 -> weight rms ~0.02
            elif "norm" in name:
                t.fill_(1.0)
            elif "rotary" not in name:
                t.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):  # to_empty left its inv_freq uninitialized
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    if nvfp4:
        stack_fused_groups(model)  # as qerl.load.loader does for a checkpoint
    return model


# ---------------------------------------------------------------------------------------------- results


def versions(*packages: str) -> dict[str, str]:
    """Python's, torch's and each importable one of ``packages``' version."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in packages:
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return found


def device_name(device: torch.device | None = None) -> str:
    """The CUDA device's name, or for a CPU its core count and torch's thread count."""
    if device is not None and device.type == "cpu":
        return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return torch.cuda.get_device_name(device)


def utc_now() -> str:
    """The result's ``date``: UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reruns this result: ``python -m benchmarks.NAME ARGS``."""
    return " ".join([Path(sys.executable).name, "-m", module, *(sys.argv[1:] if argv is None else argv)])


def write_json(path: Path, doc: object, indent: int = 2) -> None:
    """``doc`` as JSON at ``path``, complete or not at all (temp file, then rename)."""
    atomic_write_text(path, json.dumps(doc, indent=indent))


def save_figure(fig: Any, path: Path) -> None:
    """A matplotlib figure as a PNG at ``path``, complete or not at all."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120)
