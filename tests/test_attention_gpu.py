"""The training step's attention backward stays finite where cuDNN's SDPA backward returns NaN.

pytorch/pytorch#196678 (torch >= 2.11, Hopper): with an explicit mask, a sequence length of 64 mod 128
and rows whose log-sum-exp is below ln(FLT_MAX) ~ -88.7, cuDNN's backward gives NaN ``grad_q`` while
the forward is fine; two 200-step SmolLM2 runs died of it on our H200. ``cudnn_attention_disabled``
(which wraps every QeRLTrainer training step) must give finite gradients on exactly such inputs, and on the
builds the bug is known on (``KNOWN_BROKEN``) the same inputs must give NaN with cuDNN on: the test shows the bug
it guards against, not only its absence.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qerl.train.trainer import cudnn_attention_disabled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _known_broken() -> bool:
    """Hopper with cuDNN and torch >= 2.11: where the bug was measured (H200, torch 2.11: 24,576 / 90,112 / 270,336
    non-finite grad_q values at the three lengths below) and reported (trl#7181, torch 2.13). A torch that fixes it
    makes ``test_attention_backward_is_finite_inside_the_training_step`` fail here, which is the cue to bound this."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] == 9
        and torch.backends.cudnn.is_available()
        and version >= (2, 11)
    )


KNOWN_BROKEN = _known_broken()


def _grad_q(length: int) -> torch.Tensor:
    """grad_q of a causal, explicitly masked bf16 attention whose every score is ~ -120 (so every
    row's log-sum-exp is far below -88.7), for fresh random inputs."""
    head_dim = 64
    gen = torch.Generator(device="cuda").manual_seed(length)
    shape = (1, 2, length, head_dim)
    q = torch.randn(shape, device="cuda", generator=gen) * 0.1
    k = torch.randn(shape, device="cuda", generator=gen) * 0.1
    v = torch.randn(shape, device="cuda", generator=gen)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(head_dim)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(torch.randn(out.shape, device="cuda", generator=gen, dtype=out.dtype))
    assert torch.isfinite(out).all()
    return q.grad


@pytest.mark.parametrize("length", [192, 704, 2112])  # 64 mod 128: the failing lengths
def test_attention_backward_is_finite_inside_the_training_step(length: int) -> None:
    # The flag as this process found it: another import (vLLM, on the H200 with its bundle on the path) may
    # have turned cuDNN SDPA off already, so the test sets each prior state itself and checks it comes back.
    found = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        bare_nan = int((~torch.isfinite(_grad_q(length))).sum())
        if KNOWN_BROKEN:
            assert bare_nan > 0, (
                f"L={length}: cuDNN SDPA gave a finite grad_q on torch {torch.__version__}: the inputs "
                "no longer reproduce pytorch#196678 (fixed in this build? then bound KNOWN_BROKEN)"
            )
        for prior in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(prior)
            with cudnn_attention_disabled():
                assert not torch.backends.cuda.cudnn_sdp_enabled()
                assert torch.isfinite(_grad_q(length)).all()
            assert torch.backends.cuda.cudnn_sdp_enabled() == prior  # restored
    finally:
        torch.backends.cuda.enable_cudnn_sdp(found)
    print(f"L={length}: default SDPA backends gave {bare_nan} non-finite grad_q values; with cuDNN off: 0")
