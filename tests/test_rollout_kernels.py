"""The native engine's Triton kernels (qerl.kernels.fused_step) against the plain-torch ops.

On CPU they run through Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before
triton is imported); skipped where triton is not installed (CI). On the GPU they run compiled, on
small and on 7B shapes (the split/ticket heuristics only spread rows over many programs there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
HAS_TRITON = importlib.util.find_spec("triton") is not None

#: Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays, which numpy >= 2.4
#: refuses to convert to int in a runtime-bounded loop: such a setup cannot interpret these kernels.
_INTERPRETER_BROKEN = "only 0-dimensional arrays can be converted to Python scalars"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter)")
def test_rollout_kernels_interpreted() -> None:
    """Every fused kernel in fp32/fp16 vs torch, then a tiny NVFP4+LoRA generation through all of them."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}"}
    run = subprocess.run(
        [sys.executable, str(HERE / "rollout_kernel_checks.py")], env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0 and _INTERPRETER_BROKEN in run.stderr:
        pytest.skip("this triton/numpy pair cannot interpret runtime-bounded loops (numpy >= 2.4 with triton 3.6)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "interpreted checks passed" in run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
def test_gpu_rollout_kernels_match_torch() -> None:
    import rollout_kernel_checks as checks

    checks.check_kernels("cuda", torch.float32, 1e-4)
    checks.check_kernels("cuda", torch.bfloat16, 0.02)
    checks.check_7b_shapes("cuda", torch.bfloat16, 0.02)
    checks.check_stacked_decode("cuda", torch.bfloat16, 0.02, ms=(1, 16, 64, 128))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (fused_step imports it)")
def test_rank_block_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shrinks' split: by rank up to 32 rows, the fewest ranks a program that
    keep a launch at 128 programs (at most 8; the choices measured fastest on the H200 at the 7B shapes), and the
    column split otherwise or with ``schedule.SHRINK_BY_RANK`` off."""
    from qerl.kernels import fused_step, schedule

    monkeypatch.setattr(schedule, "SHRINK_BY_RANK", True)
    assert [fused_step.rank_block(m, 48) for m in (1, 2, 4, 8, 16, 32)] == [1, 1, 2, 4, 8, 8]
    assert [fused_step.rank_block(m, 32) for m in (1, 4, 8, 16, 32)] == [1, 1, 2, 4, 8]
    assert fused_step.rank_block(1, 5) == 1 and fused_step.rank_block(32, 4) == 1 and fused_step.rank_block(32, 8) == 2
    assert fused_step.rank_block(33, 48) == 0
    monkeypatch.setattr(schedule, "SHRINK_BY_RANK", False)
    assert fused_step.rank_block(1, 48) == 0
