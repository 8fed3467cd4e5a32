"""What an FP4 GEMM adds to ``x @ W_hat^T`` before it stores y, as one frozen object every layer of the FP4 stack
passes on unopened: the dispatcher (``fp4_gemm.matmul``), the kernel families' launchers and the reference
(``reference.mm``) all take an ``Epilogue`` instead of six loose arguments in three different orders.

It imports torch only, so the reference path (CPU installs without Triton) can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The two column bounds of a segmented layout (``fp4_base.segmented``): columns [0, S1), [S1, S2), [S2, total)
#: each stored as a contiguous block.
Bounds = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Epilogue:
    """``y = acc + bias + lora_scale * lora_u @ lora_b^T``, y and u possibly segmented.

    * ``bias`` ``[N]``; ``lora_u`` ``[M, r]`` (or flat ``[M * r]`` with ``lora_bounds``: the buffer the rollout
      engine's fused shrinks write); ``lora_b`` ``[N, r]`` (block-diagonal for a row-stacked group, so one epilogue
      dot applies every member's expand);
    * ``out_bounds``: y comes back as a flat ``[M * N]`` buffer with its columns segmented at the two bounds (one
      contiguous output per member of a row-stacked group).

    Frozen: one object describes one launch, and a captured CUDA graph keeps the tensors it was built from.
    """

    bias: torch.Tensor | None = None
    lora_u: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: float = 1.0
    out_bounds: Bounds | None = None
    lora_bounds: Bounds | None = None

    @property
    def rank(self) -> int:
        """The LoRA rank: ``lora_b``'s columns (0 without it)."""
        return 0 if self.lora_b is None else self.lora_b.shape[1]

    def check(self, m: int, n: int) -> None:
        """A one-line error unless the LoRA operands fit an ``[m, n]`` output (``lora_u`` and ``lora_b`` together,
        ``lora_u`` ``[m, r]``, or ``[m * r]`` with ``lora_bounds``)."""
        if self.lora_u is None:
            return
        rank = -1 if self.lora_b is None else self.lora_b.shape[1]
        u_shape = (m * rank,) if self.lora_bounds is not None else (m, rank)
        if self.lora_b is None or self.lora_b.shape[0] != n or tuple(self.lora_u.shape) != u_shape:
            raise ValueError(
                f"LoRA epilogue needs lora_u {'[M*r]' if self.lora_bounds else '[M, r]'} (M={m}) and lora_B [N={n}, r], "
                f"got {tuple(self.lora_u.shape)} and {None if self.lora_b is None else tuple(self.lora_b.shape)}"
            )


#: No bias, no LoRA, y a plain ``[M, N]`` matrix.
PLAIN = Epilogue()
