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
from dataclasses import replace
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


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (step_norm imports it)")
def test_rank_block_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shrink's split: by rank up to 64 rows of at most 8192 (padded) columns, the fewest ranks a program that keep
    a launch at 128 programs (the choices measured fastest on the H200 at the 7B shapes), at most 128 values of A a
    thread (8 ranks of a 4096-column row, 4 of an 8192-column one), and the column split otherwise or with
    ``schedule.SWITCHES.shrink_by_rank`` off."""
    from qerl.kernels import schedule, step_norm

    monkeypatch.setattr(schedule, "SWITCHES", replace(schedule.SWITCHES, shrink_by_rank=True))
    assert [step_norm.rank_block(m, 48, 4096) for m in (1, 2, 4, 8, 16, 32)] == [1, 1, 2, 4, 8, 8]
    assert [step_norm.rank_block(m, 32, 4096) for m in (1, 4, 8, 16, 32)] == [1, 1, 2, 4, 8]
    assert [step_norm.rank_block(m, 48, 8192) for m in (1, 8, 16, 32)] == [1, 4, 4, 4]  # 32B: 4 ranks at most
    assert step_norm.rank_block(1, 5, 4096) == 1 and step_norm.rank_block(32, 4, 4096) == 1
    assert step_norm.rank_block(32, 8, 4096) == 2
    assert [step_norm.rank_block(m, 48, 4096) for m in (48, 64)] == [8, 8]  # measured at 48 / 64 rows: 8 ranks
    assert step_norm.rank_block(65, 48, 4096) == 0 and step_norm.rank_block(1, 48, 16384) == 0
    monkeypatch.setattr(schedule, "SWITCHES", replace(schedule.SWITCHES, shrink_by_rank=False))
    assert step_norm.rank_block(1, 48, 4096) == 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (compiles for sm_90 on any machine)")
@pytest.mark.parametrize("block", [4096, 8192])
def test_rank_kernel_fits_registers(block: int) -> None:
    """The by-rank RMSNorm shrink compiled for sm_90 at the most ranks ``rank_block`` gives a row of ``block`` padded
    columns (8 at the 7B width, 4 at the 32B one) keeps A in registers (no local-memory spills); twice that at the 32B
    width spills, which is why the rule bounds A's values a thread."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qerl.kernels import step_norm

    most = step_norm.rank_block(32, 4096, block)
    assert most == {4096: 8, 8192: 4}[block]

    def spills(rb: int) -> int:
        consts = {"HAS_DELTA": True, "BLOCK": block, "RB": rb, "GLUON_K": True}
        ptrs = ("h_ptr", "d_ptr", "w_ptr", "hout_ptr", "out_ptr", "a_ptr", "u_ptr")
        sig = {
            **dict.fromkeys(ptrs, "*bf16"),
            **dict.fromkeys(("M", "K", "share", "R", "S1", "S2"), "i32"),
            "eps": "fp32",
            **dict.fromkeys(consts, "constexpr"),
        }
        compiled = triton.compile(
            ASTSource(fn=step_norm._rms_norm_rank_kernel, signature=sig, constexprs=consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": step_norm.RANK_WARPS},
        )
        return len(re.findall(r"\b(?:LDL|STL)\b", compiled.asm["sass"]))

    assert spills(most) == 0
    if block == 8192:
        assert spills(2 * most) > 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (compiles for sm_90 on any machine)")
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_kernels_compile_for_sm90(qk_norm: bool) -> None:
    """The RoPE-cache kernel and the RoPE-in-attention partial kernel at Qwen3-8B's head shape (32 / 8 heads of 128)
    compile for sm_90 without local-memory spills, with Qwen3's head norms (weights given) and without them (None:
    a compile-time constant, so every other family's kernels are the ones compiled before the norms existed)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qerl.kernels import step_attention, step_rope

    norm = (
        ({"qw_ptr": "*fp32", "kw_ptr": "*fp32", "q_eps": "fp32", "k_eps": "fp32"}, {})
        if qk_norm
        else (
            dict.fromkeys(("qw_ptr", "kw_ptr", "q_eps", "k_eps"), "constexpr"),
            dict.fromkeys(("qw_ptr", "kw_ptr", "q_eps", "k_eps")),
        )
    )
    strides = dict.fromkeys(("skb", "skh", "sks", "svb", "svh", "svs"), "i32")

    def sass(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int) -> str:
        sig = {**sig, **norm[0], **strides, **dict.fromkeys(consts, "constexpr")}
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs={**consts, **norm[1]}),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        return compiled.asm["sass"]

    io = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "kc_ptr", "vc_ptr"), "*bf16")
    rope = sass(
        step_rope._rope_cache_kernel,
        {**io, "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64"},
        {"H": 32, "HKV": 8, "D": 128},
        1,
    )
    sig = {
        **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "kn_ptr", "vn_ptr", "cos_ptr", "sin_ptr"), "*bf16"),
        "pos_ptr": "*i64",
        **dict.fromkeys(("m_ptr", "l_ptr", "acc_ptr"), "*fp32"),
        "scale": "fp32",
        "chunk": "i32",
        "nsplit": "i32",
    }
    partial = sass(
        step_attention._attn_partial_kernel,
        sig,
        {"HKV": 8, "G": 4, "GP": 16, "D": 128, "BLOCK_N": 32, "IEEE": False, "ROPE": True},
        4,
    )
    for code in (rope, partial):
        assert not re.findall(r"\b(?:LDL|STL)\b", code)
    assert (code.count("MUFU.RSQ") > 0) == qk_norm  # the head norms' rsqrt, only where they are compiled in
