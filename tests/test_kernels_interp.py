"""Kernel checks that run on the GPU (compiled) and on CPU through Triton's interpreter (twins of the same code).

Each ``check_*`` takes a device and an activation dtype: ``tests/test_kernels_gpu.py`` calls them on CUDA in bf16/fp16,
``test_kernels_interpreted`` runs this file as a script under ``TRITON_INTERPRET=1`` (which must be set before
triton is imported, hence the subprocess) with CPU tensors routed to the kernels, in fp16 (the interpreter rounds
bf16 products and casts wrongly) and on tiny shapes (it runs every program in Python): the fused grad_x kernel, the
dequantize kernel (exactly ``nvfp4.dequantize`` there), the LoRA gradients of a peft model over ``NVFP4Linear`` and a
``torch.compile(fullgraph=True)`` MLP over the custom ops, forward and backward.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl import nvfp4

HERE = Path(__file__).resolve().parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Triton 3.6's interpreter cannot run runtime-bounded loops with numpy >= 2.4 (see test_rollout_kernels.py).
_INTERPRETER_BROKEN = "only 0-dimensional arrays can be converted to Python scalars"


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The larger of ||got - want|| / ||want|| and max |got - want| / max |want|: a relative norm alone hides one
    wrong row or edge tile of a large output; the element-wise bound scaled to the output's maximum does not."""
    assert torch.isfinite(got).all(), "output has non-finite entries (unwritten or poisoned)"
    diff, want = got.double() - want.double(), want.double()
    return max((diff.norm() / want.norm()).item(), (diff.abs().max() / want.abs().max()).item())


def _weight(n: int, k: int, device: str, seed: int) -> nvfp4.NVFP4Tensors:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    return nvfp4.quantize(w.to(device))


def check_backward(device: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]], tol: float) -> None:
    """``fp4_gemm.matmul_t`` (grad_x = grad_y @ W_hat: the fused kernel up to ``FUSED_BWD_MAX_M`` rows, dequantize +
    matmul above) into a NaN-poisoned output against float64, for each (M, N, K)."""
    from qerl.kernels import fp4_gemm

    for i, (m, n, k) in enumerate(shapes):
        q = _weight(n, k, device, i)
        gy = torch.randn(m, n, generator=torch.Generator().manual_seed(100 + i)).to(device, dtype)
        out = torch.full((m, k), float("nan"), dtype=dtype, device=device)
        gx = fp4_gemm.matmul_t(gy, q, out=out)
        w64 = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, torch.float64)
        err = max_err(gx, gy.double() @ w64)
        assert err < tol, f"grad_x M={m} N={n} K={k} {dtype}: error {err:.3g} >= {tol}"


def dequantize_ulps(device: str, dtype: torch.dtype, n: int, k: int) -> float:
    """The dequantize kernel's ``W_hat`` against ``nvfp4.dequantize``'s (the same numbers by definition): the largest
    difference in units of the output dtype's epsilon times each element's magnitude (0.0: bitwise equal)."""
    from qerl.kernels import fp4_gemm

    q = _weight(n, k, device, n + k)
    got = fp4_gemm.dequantize(q, dtype)
    want = nvfp4.dequantize(q.weight_packed, q.weight_scale, q.weight_global_scale, dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    diff = (got.float() - want.float()).abs()
    assert not (diff[want == 0] > 0).any(), "a zero weight decoded nonzero"
    scale = want.float().abs().clamp_min(torch.finfo(torch.float32).tiny) * torch.finfo(dtype).eps
    return (diff / scale).max().item()


def _twin(model: torch.nn.Module, act: torch.dtype, dense: torch.dtype | None) -> torch.nn.Module:
    """``model`` (in ``act``) with its decoder Linears as ``NVFP4Linear`` (``dense`` None), or all in ``dense`` with
    plain Linears holding the NVFP4 weights dequantized to ``act`` (the references the kernels' model is held to)."""
    from qerl.load.linear import NVFP4Linear, replace_linears

    twin = copy.deepcopy(model)
    replace_linears(twin, lambda name, lin: None if name == "lm_head" else NVFP4Linear.from_linear(lin))
    if dense is None:
        return twin
    for layer in twin.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, NVFP4Linear):
                    lin = torch.nn.Linear(
                        child.in_features, child.out_features, bias=False, device=child.weight_packed.device
                    )
                    lin.weight.data = child.dequantized_weight(act).float()
                    setattr(parent, name, lin)
    return twin.to(dense)


def check_lora_grads(device: str, dtype: torch.dtype, **config: int) -> None:
    """The LoRA gradients of a peft model over ``NVFP4Linear`` (activations in ``dtype``, the FP4 kernels forward and
    backward) are as close to an fp32 model of the same dequantized weights as a dense ``dtype`` model is (2x slack,
    or 2e-2 of the gradient's norm): every A and B of all seven projections of each layer, with B nonzero."""
    from peft import get_peft_model
    from tiny_models import tiny_model

    from qerl.load.lora import lora_config

    base = tiny_model("llama", 0, **config).to(device, dtype)  # cast before the swap: .to(dtype) would cast fp8 too
    models = [_twin(base, dtype, None), _twin(base, dtype, dtype), _twin(base, dtype, torch.float32)]
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    grads = []
    for model in models:
        torch.manual_seed(7)
        peft_model = get_peft_model(model, lora_config(r=8))
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # non-zero B so that A gets gradients too
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        peft_model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.detach().float() for n, p in peft_model.named_parameters() if p.requires_grad})
    ours, dense, ref = grads
    assert ours.keys() == ref.keys() and len(ours) == 2 * 7 * base.config.num_hidden_layers
    for name in ref:
        e_ours, e_dense = (((g - ref[name]).norm() / ref[name].norm()).item() for g in (ours[name], dense[name]))
        assert e_ours < max(2 * e_dense, 2e-2), (name, e_ours, e_dense)


class MLP(torch.nn.Module):
    """up (with bias) -> SiLU -> down, both ``NVFP4Linear``: a graph of the custom ops with a bias and a nonlinearity."""

    def __init__(self, device: str, dtype: torch.dtype, width: int = 512, hidden: int = 1040) -> None:
        super().__init__()
        from qerl.load.linear import NVFP4Linear

        torch.manual_seed(0)
        self.up = NVFP4Linear.from_linear(torch.nn.Linear(width, hidden, bias=True).to(device))
        self.down = NVFP4Linear.from_linear(torch.nn.Linear(hidden, width, bias=False).to(device))
        self.up.bias.data = self.up.bias.data.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same MLP in float64 on the dequantized weights."""
        h = torch.nn.functional.linear(x.double(), self.up.dequantized_weight(torch.float64), self.up.bias.double())
        return torch.nn.functional.linear(torch.nn.functional.silu(h), self.down.dequantized_weight(torch.float64))


def check_compile(
    device: str, dtype: torch.dtype, rows: tuple[int, ...], tol: float, backend: str = "inductor"
) -> None:
    """``torch.compile(fullgraph=True)`` over the FP4 custom ops (no graph break: their fake impls and autograd
    formula trace) gives the float64 MLP's output and input gradient at each row count (decode kernel, dequantize
    + matmul above ``DECODE_MAX_M``; grad_x through ``nvfp4_mm_t``)."""
    model = MLP(device, dtype)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for m in rows:
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m, 512, generator=gen).to(device, dtype).requires_grad_(True)
        gy = torch.randn(m, 512, generator=gen).to(device, dtype)
        y = compiled(x)
        (gx,) = torch.autograd.grad(y, x, gy)
        x64 = x.detach().double().requires_grad_(True)
        y64 = model.reference(x64)
        (gx64,) = torch.autograd.grad(y64, x64, gy.double())
        assert max_err(y, y64) < tol and max_err(gx, gx64) < tol, (m, max_err(y, y64), max_err(gx, gx64))


def check_train_fused(device: str, dtype: torch.dtype, tol: float) -> None:
    """The training pass's fused RMSNorm (``train_fused.rms_norm``: output, input and weight gradients; a trained
    fp32 weight and a frozen one in ``dtype``; rows below, at and past the weight-gradient programs, columns off a
    power of two) and SwiGLU (output, both gradients; sizes off the block) against float64."""
    from qerl.kernels import train_fused

    gen = torch.Generator().manual_seed(7)
    for rows, cols in ((1, 64), (5, 100), (train_fused.NORM_GRAD_PROGRAMS + 44, 64)):
        x = (torch.randn(rows, cols, generator=gen) * 3).to(device, dtype)
        for w_dtype in (torch.float32, dtype):
            w = (
                (1 + 0.3 * torch.randn(cols, generator=gen))
                .to(device, w_dtype)
                .requires_grad_(w_dtype == torch.float32)
            )
            dy = torch.randn(rows, cols, generator=gen).to(device, dtype)
            xg = x.clone().requires_grad_(True)
            y = train_fused.rms_norm(xg, w, 1e-6)
            assert y.dtype == dtype
            y.backward(dy)
            x64, w64 = x.double().requires_grad_(True), w.detach().double().requires_grad_(True)
            y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
            y64.backward(dy.double())
            errs = [max_err(y, y64), max_err(xg.grad, x64.grad)] + (
                [max_err(w.grad, w64.grad)] if w.requires_grad else []
            )
            assert max(errs) < tol, f"rms_norm [{rows}, {cols}] weight {w_dtype}: errors {errs}"
    for n in (1, 1000, 3 * train_fused.SWIGLU_BLOCK + 5):
        g, u = (torch.randn(n, generator=gen) * 3).to(device, dtype), torch.randn(n, generator=gen).to(device, dtype)
        dout = torch.randn(n, generator=gen).to(device, dtype)
        gg, ug = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
        out = train_fused.swiglu(gg, ug)
        out.backward(dout)
        g64, u64 = g.double().requires_grad_(True), u.double().requires_grad_(True)
        out64 = torch.nn.functional.silu(g64) * u64
        out64.backward(dout.double())
        errs = [max_err(out, out64), max_err(gg.grad, g64.grad), max_err(ug.grad, u64.grad)]
        assert max(errs) < tol, f"swiglu [{n}]: errors {errs}"


def check_fused_model(device: str, dtype: torch.dtype, tol: float) -> float:
    """A tiny Qwen2 with LoRA and trained fp32 norms, its norms and MLPs swapped (``qerl.train.fused_layers``: the
    kernels) against the same model unswapped (transformers' ops): logits and every trainable gradient within
    ``tol`` (``max_err``) in ``dtype``; returns the largest error."""
    from peft import get_peft_model
    from tiny_models import tiny_model

    from qerl.load.lora import lora_config
    from qerl.train.fused_layers import fuse_layers
    from qerl.train.trainer import keep_trainable_fp32

    def build() -> torch.nn.Module:
        model = tiny_model("qwen2", 0, vocab_size=64, max_position_embeddings=64).to(device, dtype)
        model = get_peft_model(model, lora_config(r=4, train_norms=True))
        keep_trainable_fp32(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
        return model

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for swap in (False, True):
        model = build()
        if swap:
            assert fuse_layers(model)["mlps"] == 2
        logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1)[..., :8].sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    errs = [max_err(got, want)] + [max_err(got_grads[n], g) for n, g in want_grads.items()]
    assert max(errs) < tol, f"fused model {dtype}: errors {errs}"
    return max(errs)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter)")
def test_kernels_interpreted() -> None:
    """The checks above through Triton's interpreter on CPU (the GPU runs them compiled: test_kernels_gpu.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and _INTERPRETER_BROKEN in run.stderr:
        pytest.skip("this triton/numpy pair cannot interpret runtime-bounded loops (numpy >= 2.4 with triton 3.6)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "interpreted kernel checks passed" in run.stdout


if __name__ == "__main__":
    torch.set_num_threads(1)
    from qerl.kernels import backend

    backend.serves = lambda device: True  # CPU tensors to the (interpreted) Triton kernels
    f16 = torch.float16
    # fused grad_x at 1 / 17 rows (K off the 128-code tile, N off the 64-row step), dequantize + matmul at 65
    check_backward("cpu", f16, [(1, 200, 1040), (17, 72, 272), (65, 64, 128)], 4e-3)
    for n, k in ((520, 1040), (64, 2048)):  # K // 8 words off and on the kernel's 128-word block
        ulps = dequantize_ulps("cpu", f16, n, k)  # (the interpreter's bf16 cast does not round to nearest)
        assert ulps == 0.0, f"dequantize fp16 [{n}, {k}]: {ulps} eps from nvfp4.dequantize"
    check_lora_grads("cpu", f16, num_hidden_layers=1)
    check_compile("cpu", f16, (1, 5, 130), 4e-3, backend="aot_eager")
    check_train_fused("cpu", f16, 2e-3)
    check_fused_model("cpu", f16, 2e-3)  # observed: bitwise equal
    print("interpreted kernel checks passed")
