"""The decoder's RMSNorms and SiLU MLPs swapped for modules that run ``qerl.kernels.train_fused`` in training.

Why: transformers runs each as a chain of elementwise ops, forward and backward, and keeps copies for the backward
(the kernel module's docstring). The swapped modules hold the same parameters and children under the same names, so
state dicts, peft's adapters and trained norms (``modules_to_save``: the copy inside the wrapper is swapped), AQN's
noise and the rollout engine's view (which reads ``weight``, ``variance_epsilon`` and the projections) see no
difference. Only the four families' own classes are swapped (``arch.FAMILIES``: their RMSNorm and MLP are the
standard ones); the kernels run where ``qerl.kernels.backend`` serves the tensors (CUDA), transformers' math in
torch elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl.kernels import backend, reference

#: transformers' classes of the supported families that the swap replaces.
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


class FusedRMSNorm(nn.Module):
    """An RMSNorm over the last dimension whose output is in its input's dtype; holds the swapped module's weight."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if backend.available(x):
            from qerl.kernels import train_fused  # Triton: only where it serves

            return train_fused.rms_norm(x, self.weight, self.variance_epsilon)
        return reference.rms_norm(x, None, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedSwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` over the swapped MLP's own projections."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if backend.available(gate) and gate.dtype == up.dtype:
            from qerl.kernels import train_fused  # Triton: only where it serves

            return self.down_proj(train_fused.swiglu(gate, up))
        return self.down_proj(reference.silu_mul(gate, up))


#: The SiLU activations transformers builds for ``hidden_act`` ``silu`` / ``swish``.
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})


def _silu_mlp(module: nn.Module) -> bool:
    return type(module).__name__ in MLP_CLASSES and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES


def fuse_layers(model: nn.Module) -> dict[str, int]:
    """Swap every RMSNorm and SiLU MLP of a supported family inside ``model`` (in place); how many of each."""
    counts = {"norms": 0, "mlps": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in NORM_CLASSES and hasattr(child, "variance_epsilon"):
                setattr(parent, name, FusedRMSNorm(child))
                counts["norms"] += 1
            elif _silu_mlp(child):
                setattr(parent, name, FusedSwiGLU(child))
                counts["mlps"] += 1
    return counts
