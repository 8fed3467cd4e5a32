"""Data-parallel GRPO on CPU: ``accelerate launch`` with training/accelerate/ddp.yaml, 2 processes
(gloo), two steps of QeRLTrainer on a tiny NVFP4 Llama (tests/ddp_grpo_worker.py), one prompt x 8
completions per step split 4 + 4 across the ranks. Checked: the trainable weights stay identical on
both ranks (gradients all-reduced) while the ranks drew different completions of the same prompt; and
with rollouts that do not depend on the process count, the loss, gradient norm and weights after two
steps equal a 1-process run over the same global batch (fp32, up to the order of the sums), also with each training
pass in row chunks (``qerl.train.chunked_pass``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_grpo_worker import GROUP, STEPS, run
from tiny_models import make_tiny_llama

from qerl.quantize.pipeline import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # ~50 s: two processes start trl each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    root = tmp_path_factory.mktemp("ddp")
    # The embedded model's vocabulary, so that its tokenizer (chat template, EOS) serves the tiny model.
    model = quantize_checkpoint(make_tiny_llama(root / "src", vocab=49152), root / "nvfp4", backend="qerl")
    out = root / "out"
    out.mkdir()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "training/accelerate/ddp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests/ddp_grpo_worker.py"),
        str(model),
        str(out),
        str(GROUP // 2),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = {kind: [torch.load(out / f"{kind}-rank{r}.pt") for r in (0, 1)] for kind in ("engine", "fixed", "chunked")}
    single = run(str(model), str(root / "single"), GROUP, fixed=True)
    return ranks, single


def test_weights_stay_identical_across_ranks(runs) -> None:
    ranks, _ = runs
    for kind, (r0, r1) in ranks.items():
        assert (r0["process_index"], r1["process_index"], r0["num_processes"]) == (0, 1, 2)
        assert len(r0["losses"]) == STEPS and r0["losses"] == r1["losses"] and r0["grad_norms"] == r1["grad_norms"]
        assert set(r0["weights"]) == set(r1["weights"]) and len(r0["weights"]) == 2 * 7 * 2 + 2 * 2  # LoRA A/B + norms
        for name, w in r0["weights"].items():
            assert torch.equal(w, r1["weights"][name]), (kind, name)
        assert any("lora_B" in n and w.abs().max() > 0 for n, w in r0["weights"].items())  # trained (B starts at 0)


def test_ranks_split_a_group_and_sample_differently(runs) -> None:
    """Each step's 8 completions of one prompt are drawn 4 per rank: same prompt, different samples
    (a rank-blind sampling seed would give both ranks the same 4 completions)."""
    ranks, _ = runs
    r0, r1 = ranks["engine"]
    assert len(r0["rollouts"]) == STEPS == len(r1["rollouts"])
    for (p0, c0), (p1, c1) in zip(r0["rollouts"], r1["rollouts"], strict=True):
        assert len(p0) == len(p1) == GROUP // 2 and all(p == p0[0] for p in p0 + p1)
        assert {tuple(c) for c in c0}.isdisjoint({tuple(c) for c in c1})


@pytest.mark.parametrize("kind", ["fixed", "chunked"], ids=["whole-passes", "chunked-passes"])
def test_two_processes_match_one_over_the_same_global_batch(runs, kind: str) -> None:
    ranks, single = runs
    ddp = ranks[kind][0]
    assert ddp["chunk_passes"] == ({1: STEPS} if kind == "chunked" else {})  # one pass of 4 rows per step and rank
    assert single["num_processes"] == 1 and len(single["rollouts"][0][0]) == GROUP
    assert single["losses"][-1] > 0  # the KL term: a loss that can disagree
    # abs: the policy term is a sum of zero-mean advantages, 0 up to fp32 rounding (~1e-8)
    assert ddp["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=5e-8)
    assert ddp["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    worst = max((ddp["weights"][n] - w).abs().max().item() for n, w in single["weights"].items())
    print(
        f"\n2 ranks: loss {ddp['losses']}, grad norm {ddp['grad_norms']}; 1 process: loss {single['losses']}, "
        f"grad norm {single['grad_norms']}; max |weight difference| {worst:.3g}"
    )
    for name, w in single["weights"].items():
        torch.testing.assert_close(ddp["weights"][name], w, rtol=1e-4, atol=1e-6, msg=name)
