"""The fused decode-step ops the native engine calls (``qerl.kernels.step_kernels()``; imported only where Triton
exists), one namespace over the modules that hold them by role: ``step_norm`` (residual-add + RMSNorm with its LoRA
shrink), ``step_silu`` (SiLU gating with its LoRA shrink), ``step_rope`` (RoPE + KV-cache write), ``step_attention``
(split-K decode attention), ``step_sampler`` (the sampler and the step's bookkeeping). Their plain-torch twins are
``reference``'s functions of the same names.
"""

from __future__ import annotations

from .step_attention import decode_attention
from .step_norm import rms_norm, rms_norm_shrink
from .step_rope import rope_and_cache
from .step_sampler import finish_step, sample
from .step_silu import silu_mul, silu_mul_shrink

__all__ = [
    "decode_attention",
    "finish_step",
    "rms_norm",
    "rms_norm_shrink",
    "rope_and_cache",
    "sample",
    "silu_mul",
    "silu_mul_shrink",
]
