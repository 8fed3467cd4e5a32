"""Smoke test of benchmarks/grpo_step.py in ``--tiny`` mode, so that the GPU benchmark cannot rot
between its runs: one real QeRLTrainer GRPO step per base (NVFP4 and dense) on a 2-layer Llama,
micro-batched as on the H200 (one rollout of 8, four backward passes of 2, one optimizer step),
every phase timed, the JSON complete; micro-batching leaves the step's gradient unchanged. Also
checks the analytic decode floor against the floor that benchmarks/rollout.py computed from a real
7B-shape model's bytes on the H200."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grpo_step() -> ModuleType:
    from benchmarks import grpo_step

    return grpo_step


def test_tiny_run_writes_every_phase_and_the_summary(grpo_step: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "grpo_step.json"
    grpo_step.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert not (tmp_path / "grpo_step.partial.json").exists()  # superseded by the final JSON
    for key in ("date", "device", "versions", "command", "setup", "summary", "results"):
        assert doc[key], key
    assert "--tiny" in doc["command"] and doc["versions"]["trl"]

    rows = doc["results"]
    assert [(r["shape"], r["base"]) for r in rows] == [("tiny", "nvfp4"), ("tiny", rows[1]["base"])]
    assert rows[1]["base"] != "nvfp4"
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert set(r["phases_s"]) == set(grpo_step.PHASES) == set(r["peak_gb"])
        assert all(r["phases_s"][p] > 0 for p in ("rollout", "fwd_bwd", "optimizer"))
        assert r["phases_s"]["logprobs"] == 0  # the IS ratio comes from the loss forward (qerl.train.is_ratio)
        assert r["step_s"] == pytest.approx(sum(r["phases_s"].values()), rel=1e-3, abs=1e-3)
        assert r["forced_length"] and r["completion_lengths"] == [16] and r["decode_steps"] == 15
        assert r["lora_updated"]
        # Auto (the default) is full recompute without CUDA: every pass of the 2 timed steps recomputed, and the
        # training pass's floor counts it beside the floor without any recompute.
        assert r["gradient_checkpointing"] == "auto"
        assert r["recompute"] == {"mode": "full", "share": 1.0, "passes": {"none": 0, "full": 8}}
        assert r["pass_chunk_rows"] is None and r["chunking"] == {
            "chunked_passes": 0,
            "rows_per_chunk": {},
            "rollout_memory_freed": 0,
        }
        assert r["floors"]["fwd_bwd_s"] > r["floors"]["fwd_bwd_no_recompute_s"] > 0
        assert set(r["of_floor"]) >= {"fwd_bwd", "fwd_bwd_no_recompute"}
        # the estimate of the plan that ran (full recompute here) is recorded; there is no measured peak to set it by
        assert r["estimate_of_what_ran_gb"] > 0 and "estimate_over_measured" not in r
        assert (r["aqn_sigma"] > 0) is (r["base"] == "nvfp4")  # AQN defaults to on for NVFP4 models only (issue 15)
        # Default micro-batch 2 of n=8: one rollout, four backward passes of 2 completions, AdamW stepped
        # once per step (warm-up + 2 timed steps = 3), no weight moved while the gradients accumulated.
        assert (r["micro_batch"], r["gradient_accumulation_steps"]) == (2, 4)
        assert r["rollouts"] == 1 and r["micro_batch_rows"] == [2, 2, 2, 2]
        assert r["optimizer_steps_total"] == 3 and not r["lora_moved_during_accumulation"]
        # The reported step is the last of the timed ones, each listed with its phases.
        assert len(r["timed_steps"]) == 2 and r["timed_steps"][-1] == {"step_s": r["step_s"], "phases_s": r["phases_s"]}
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # LoRA r16 on 7 projections of 2 layers (64 hidden, 128 intermediate, 2 kv heads) + 4 norms
        assert r["trainable_params"] == 2 * 16 * (128 + 96 + 96 + 128 + 192 + 192 + 192) + 4 * 64
        assert set(r["floors"]) >= {"rollout_s", "logprobs_s", "fwd_bwd_s", "optimizer_s"}

    summary = doc["summary"]
    for key in ("peak_gb_32b_nvfp4", "peak_gb_7b_nvfp4", "step_speedup_7b", "peak_gb_72b_nvfp4"):
        assert key in summary and summary[key] is None  # not run in tiny mode: present, null
    dense = rows[1]
    assert summary["step_speedup_tiny"] == pytest.approx(dense["step_s"] / rows[0]["step_s"], rel=1e-2)
    assert f"peak_gb_tiny_{dense['base']}" in summary and "peak_gb_tiny_nvfp4" in summary
    assert set(summary["targets"]) == {
        "peak_gb_32b_nvfp4",
        "step_speedup_7b",
        "peak_gb_72b_nvfp4",
        "ddp_throughput_ratio_7b_nvfp4",
    }
    assert all(r["processes"] == 1 and r["n_per_process"] == 8 for r in rows)
    assert rows[0]["memory_estimate_gb"]["peak"] > rows[0]["memory_estimate_gb"]["start"] > 0


def test_micro_batching_leaves_the_step_gradient_unchanged(grpo_step: ModuleType, tmp_path: Path) -> None:
    """The same step (same weights, rollout, advantages) as one pass of 4 and as two accumulated passes
    of 2: trl's per-micro-step loss scaling must make the summed loss and pre-clip gradient norm equal
    (forced-length completions: equal token counts per micro-batch). Scaling the loss twice, or not at
    all, would change both by 2x."""
    rows = {}
    for micro in (4, 2):
        out = tmp_path / f"micro{micro}.json"
        grpo_step.main(["--tiny", "--n", "4", "--micro-batch", str(micro), "--bases", "nvfp4", "--out", str(out)])
        rows[micro] = json.loads(out.read_text())["results"][0]
        assert rows[micro]["status"] == "ok", rows[micro].get("error")
        assert rows[micro]["micro_batch_rows"] == [micro] * (4 // micro) and rows[micro]["rollouts"] == 1
    assert rows[2]["grad_norm"] > 0
    assert rows[2]["grad_norm"] == pytest.approx(rows[4]["grad_norm"], rel=1e-4)
    # The loss of a step is ~0 (group-normalised advantages sum to zero; here ~2e-5), so its relative
    # rounding differs with the AQN draw: with sigma_end 1e-4 the two passes differ by 2e-8 (0.11%).
    # A scaling error would show as ~2e-5.
    assert rows[2]["loss"] == pytest.approx(rows[4]["loss"], rel=1e-3, abs=1e-7)


def test_recompute_off_runs_no_recompute_and_its_floor(grpo_step: ModuleType, tmp_path: Path) -> None:
    """``--gradient-checkpointing off``: no pass recomputes, and the training pass's floor is the one without
    recompute. With full recompute the floor is one more forward of the decoder layers above it: the forward pass's
    floor (the old log-prob pass's) less the LM head, which no recompute repeats."""
    out = tmp_path / "off.json"
    grpo_step.main(
        ["--tiny", "--n", "4", "--bases", "nvfp4", "--steps", "1", "--gradient-checkpointing", "off", "--out", str(out)]
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "ok" and row["gradient_checkpointing"] == "off"
    assert row["recompute"] == {"mode": "none", "share": 0.0, "passes": {"none": 2, "full": 0}}
    assert row["floors"]["fwd_bwd_s"] == row["floors"]["fwd_bwd_no_recompute_s"]
    full = grpo_step.floors(grpo_step.TINY, grpo_step.TINY_VOCAB, True, 4, 32, 16, 16, 2)
    head = 2 * grpo_step.shape_counts(grpo_step.TINY, grpo_step.TINY_VOCAB, 16)["lm_head_params"] * 4 * 16
    assert full["fwd_bwd_s"] - full["fwd_bwd_no_recompute_s"] == pytest.approx(
        full["logprobs_s"] - head / grpo_step.MATMUL_FLOPS, rel=1e-9
    )
    assert full["fwd_bwd_no_recompute_s"] == pytest.approx(row["floors"]["fwd_bwd_s"], rel=1e-3)


def test_chunked_passes_are_recorded_and_leave_the_step_unchanged(grpo_step: ModuleType, tmp_path: Path) -> None:
    """``--pass-chunk-rows 1`` (no recompute): the row records each pass of 2 completions run in chunks of one row,
    the training pass's floor is the one without recompute, and the step's loss and pre-clip gradient norm are the
    whole passes' (qerl.train.chunked_pass: the micro-batch's loss, up to the order of sums)."""
    rows = {}
    for chunk in ([], ["--pass-chunk-rows", "1"]):
        out = tmp_path / f"chunk{len(chunk)}.json"
        argv = ["--tiny", "--n", "4", "--bases", "nvfp4", "--steps", "1", "--gradient-checkpointing", "off"]
        grpo_step.main([*argv, *chunk, "--out", str(out)])
        (rows[bool(chunk)],) = json.loads(out.read_text())["results"]
    whole, chunked = rows[False], rows[True]
    assert chunked["status"] == "ok" and chunked["pass_chunk_rows"] == 1
    assert chunked["chunking"] == {"chunked_passes": 2, "rows_per_chunk": {"1": 2}, "rollout_memory_freed": 0}
    assert whole["chunking"] == {"chunked_passes": 0, "rows_per_chunk": {}, "rollout_memory_freed": 0}
    assert chunked["recompute"] == {"mode": "none", "share": 0.0, "passes": {"none": 2, "full": 0}}
    assert chunked["floors"]["fwd_bwd_s"] == chunked["floors"]["fwd_bwd_no_recompute_s"] == whole["floors"]["fwd_bwd_s"]
    assert chunked["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5) and whole["grad_norm"] > 0
    # The loss sums terms of either sign near 1 that nearly cancel (~2e-4 left): fp32 order of sums, ~1e-8 absolute.
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)


def test_micro_batch_must_divide_the_group(grpo_step: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        grpo_step.parse(["--tiny", "--n", "8", "--micro-batch", "3"])
    assert "--micro-batch: expected a divisor of --n 8, got 3" in capsys.readouterr().err


def test_decode_floor_matches_the_measured_model_bytes(grpo_step: ModuleType) -> None:
    """The analytic 7B NVFP4 bytes per decode step equal the floor benchmarks/rollout.py derived
    from the built model's tensors (b=8, 128 new tokens, same copy bandwidth)."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "rollout_lora_b1_b8.json").read_text())
    row = next(r for r in measured["results"] if r["batch"] == 8 and r["variant"] == "lora_fused")
    floor = grpo_step.floors(grpo_step.SHAPES["7b"], grpo_step.vocab_size("7b"), True, 8, 256, 128, 16)[
        "decode_step_ms"
    ]
    scale = grpo_step.COPY_BW / (measured["copy_bandwidth_tb_s"] * 1e12)
    assert floor * scale == pytest.approx(row["floor_ms"], rel=5e-3)


def test_profile_table_summarizes_a_profiled_span(grpo_step: ModuleType) -> None:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a.t() / 64
    table = grpo_step.profile_table(prof, wall_s=0.5)
    assert table["wall_s"] == 0.5 and table["device_busy_s"] == 0.0  # CPU only: no kernels
    assert table["kernels"] == [] and table["qerl_ops"] == {} and table["by_kind_s"] == {}
    mm = next(op for op in table["host_ops"] if op["name"] == "aten::mm")
    assert mm["calls"] == 3 and mm["self_cpu_ms"] >= 0
    json.dumps(table)  # goes into the row as it is
    assert grpo_step.parse(["--tiny", "--profile"]).profile and not grpo_step.parse(["--tiny"]).profile
    assert table["idle"] == {"gaps": 0, "idle_s": 0.0, "between_events_s": 0.0, "host_during_idle": []}
    assert grpo_step.parse(["--tiny", "--profile", "--profile-python"]).profile_python
    with pytest.raises(SystemExit):
        grpo_step.parse(["--tiny", "--profile-python"])


def test_memory_estimate_reproduces_the_measured_peaks_and_fits_72b_in_80gb(grpo_step: ModuleType) -> None:
    """The estimate against the H200 rows it was fitted on (7B and 32B NVFP4; the 32B row started with
    what the previous configuration left allocated), then the 72B shape: Qwen2.5-72B's config, and an
    estimated peak under the 80 GB target with the benchmark's defaults (n 8, 2048 tokens, micro-batch 2)."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "grpo_step.json").read_text())
    for row in (r for r in measured["results"] if r["base"] == "nvfp4"):
        est = grpo_step.memory_estimate(
            grpo_step.SHAPES[row["shape"]], grpo_step.vocab_size(row["shape"]), True, 8, 256, 2048, 16, 2
        )
        assert est["start_gb"] == pytest.approx(
            row["allocated_at_step_start_gb"] - row["allocated_before_build_gb"], rel=0.05
        )
        assert est["peak_gb"] == pytest.approx(row["peak_gb_step"] - row["allocated_before_build_gb"], rel=0.03)
    shape = grpo_step.SHAPES["72b"]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (8192, 29568, 80)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], grpo_step.vocab_size("72b")) == (64, 8, 152064)
    est = grpo_step.memory_estimate(shape, grpo_step.vocab_size("72b"), True, 8, 256, 2048, 16, 2)
    assert 40 < est["weights_gb"] < 46 and est["peak_gb"] <= 70  # ~65 GB: 10+ GB of room under the target
    args = grpo_step.parse(["--shapes", "72b", "--bases", "nvfp4", "--steps", "1"])
    assert (args.shapes, args.bases, args.local_n, args.processes) == (["72b"], ["nvfp4"], 8, 1)


def test_memory_estimate_predicts_the_rows_it_was_not_fitted_on(grpo_step: ModuleType) -> None:
    """``HEAD_ACTIVATIONS`` was fitted on the 7B and 32B NVFP4 rows; the 7B bf16 row (another weight format: no
    dequantized layer copy, 2 B a weight) and the 72B NVFP4 row (another shape, measured after the fit) test it.
    Each within 3% of what the step added to what the process held before building the model."""
    held_out = [
        (json.loads((ROOT / "benchmarks" / "results" / name).read_text())["results"], keep)
        for name, keep in (("grpo_step.json", ("7b", "bf16")), ("grpo_step_72b.json", ("72b", "nvfp4")))
    ]
    rows = [r for results, keep in held_out for r in results if (r["shape"], r["base"]) == keep]
    assert len(rows) == 2
    for row in rows:
        est = grpo_step.memory_estimate(
            grpo_step.SHAPES[row["shape"]],
            grpo_step.vocab_size(row["shape"]),
            row["base"] == "nvfp4",
            row["n"],
            row["prompt_tokens"],
            row["new_tokens"],
            row["lora_r"],
            row["micro_batch"],
        )
        assert est["peak_gb"] == pytest.approx(row["peak_gb_step"] - row["allocated_before_build_gb"], rel=0.03)
        assert est["start_gb"] == pytest.approx(
            row["allocated_at_step_start_gb"] - row["allocated_before_build_gb"], rel=0.03
        )


def test_baseline_gives_the_data_parallel_throughput_ratio(grpo_step: ModuleType, tmp_path: Path, monkeypatch) -> None:
    """Run under 2 processes (WORLD_SIZE) against a 1-process baseline of the same global batch."""
    row = {"shape": "7b", "base": "nvfp4", "status": "ok", "step_s": 12.0, "peak_gb_step": 10.9}
    baseline = tmp_path / "one.json"
    baseline.write_text(
        json.dumps({"setup": {"completions": 8, "prompt_tokens": 256, "new_tokens": 2048}, "results": [row]})
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = grpo_step.parse(["--shapes", "7b", "--baseline", str(baseline)])
    assert (args.processes, args.local_n) == (2, 4)
    summary = grpo_step.summarize([{**row, "step_s": 6.4}], args.baseline_rows)
    assert summary["ddp_throughput_ratio_7b_nvfp4"] == pytest.approx(1.875)
    assert summary["targets"]["ddp_throughput_ratio_7b_nvfp4"]["met"] is True
    with pytest.raises(SystemExit):
        grpo_step.parse(["--shapes", "7b", "--baseline", str(baseline), "--tokens", "1024"])  # another global batch
    with pytest.raises(SystemExit):
        grpo_step.parse(["--n", "8", "--micro-batch", "8"])  # 4 per process cannot hold a micro-batch of 8


def test_trl_logprob_pass_is_timed_on_request(grpo_step: ModuleType, tmp_path: Path) -> None:
    """``--trl-logprob-pass`` restores trl's no-grad old-log-prob pass, so the A/B of that pass is one flag."""
    out = tmp_path / "grpo_step.json"
    grpo_step.main(["--tiny", "--bases", "nvfp4", "--trl-logprob-pass", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "ok" and row["phases_s"]["logprobs"] > 0


def test_kernel_kinds_sort_the_kernels_a_training_pass_launches() -> None:
    from benchmarks.grpo_harness import kernel_kind

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm",
        "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
        "_nvfp4_dequant_kernel": "qerl_triton",
        "void at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)": "copy_cast",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": "copy_cast",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>": "elementwise",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>": "reduction",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "log_softmax",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "ncclKernel_AllReduce": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names


def test_ragged_rows_take_the_aligned_pass_and_give_the_masked_loss(grpo_step: ModuleType, tmp_path: Path) -> None:
    """``--ragged`` cuts the 8 completions to 16 down to 8 tokens (the training pass then gets trl's padded rows);
    the aligned pass (qerl's) and ``--masked-pass`` (trl's) give the same loss and gradient norm, and the row says
    which ran."""
    rows = {}
    for name, flags in (("aligned", []), ("masked", ["--masked-pass"])):
        out = tmp_path / f"{name}.json"
        grpo_step.main(["--tiny", "--bases", "nvfp4", "--steps", "1", "--ragged", *flags, "--out", str(out)])
        (rows[name],) = json.loads(out.read_text())["results"]
    for name, r in rows.items():
        assert r["status"] == "ok", r.get("error")
        assert r["ragged"] and r["aligned_rows"] is (name == "aligned")
        assert r["completion_lengths"] == [8, 10, 11, 12, 13, 14, 15, 16] and not r["forced_length"]
    for key in ("loss", "grad_norm"):
        assert rows["aligned"][key] == pytest.approx(rows["masked"][key], rel=1e-3), key


def test_no_fused_layers_and_the_folded_expand_are_recorded(grpo_step: ModuleType, tmp_path: Path) -> None:
    """``--no-fused-layers`` reaches QeRLConfig.fused_layers, and the row says what was asked and what ran (on a CPU
    nothing is swapped: the kernels serve CUDA); ``--fold-lora-expand`` reaches QeRLConfig.fold_lora_expand and its
    step runs."""
    for flags, asked, fold in (
        ([], True, False),
        (["--no-fused-layers"], False, False),
        (["--fold-lora-expand"], True, True),
    ):
        out = tmp_path / f"{asked}-{fold}.json"
        grpo_step.main(["--tiny", "--bases", "nvfp4", "--steps", "1", *flags, "--out", str(out)])
        (row,) = json.loads(out.read_text())["results"]
        assert row["status"] == "ok" and row["fused_layers"] == {"asked": asked, "swapped": False}
        assert row["fold_lora_expand"] is fold and row["lora_updated"]


def test_idle_table_charges_the_device_gaps_to_what_the_host_ran() -> None:
    """Kernels at 0-100, 130-200 (a 30 us gap), 190-300 (overlapping: no gap) and 400-500 (a 100 us gap); the host
    ran ``outer`` 90-450 with ``inner`` 100-140 inside it and ``cudaLaunchKernel`` (the runtime's, so its time is
    its parent's) 330-360. The first gap is ``inner``'s, the second ``outer``'s own; a gap shorter than the threshold
    (500-505) is not one; idle time under no host event is Python between ops."""
    from torch.autograd import DeviceType

    from benchmarks.grpo_harness import idle_table

    def event(name: str, start: float, end: float, device: bool = False) -> SimpleNamespace:
        return SimpleNamespace(
            name=name,
            time_range=SimpleNamespace(start=start, end=end),
            device_type=DeviceType.CUDA if device else DeviceType.CPU,
            is_async=False,
            cpu_children=[],
            cpu_parent=None,
        )

    kernels = [event("k", a, b, device=True) for a, b in ((0, 100), (130, 200), (190, 300), (400, 500), (505, 600))]
    outer, inner, launch = event("outer", 90, 450), event("inner", 100, 140), event("cudaLaunchKernel", 330, 360)
    outer.cpu_children, inner.cpu_parent, launch.cpu_parent = [inner, launch], outer, outer
    table = idle_table([*kernels, outer, inner, launch], min_gap_us=20)
    # gaps: 100-130 (30 us) and 300-400 (100 us); 500-505 is under the threshold
    assert table["gaps"] == 2 and table["idle_s"] == pytest.approx(130e-6)
    # inner: 100-130 (30 us); outer: 300-400 (100 us, the runtime call's 30 us included); nothing between events
    assert table["host_during_idle"] == [{"name": "outer", "ms": 0.1}, {"name": "inner", "ms": 0.03}]
    assert table["between_events_s"] == 0.0
    alone = idle_table([*kernels, inner], min_gap_us=20)  # without outer: 100 us of the idle had no event open
    assert alone["between_events_s"] == pytest.approx(100e-6) and alone["host_during_idle"] == [
        {"name": "inner", "ms": 0.03}
    ]


def test_the_estimate_of_what_ran_reads_the_plan_from_the_row() -> None:
    """On the H100 pass A/B's rows (no recompute, chunks of 4 rows; fused layers on or off; aligned or masked rows)
    the benchmark's estimate of what ran is the one tests/test_memory.py holds against their peaks."""
    from benchmarks.common import SHAPES, vocab_size
    from benchmarks.grpo_floors import estimate_of_what_ran

    doc = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/grpo_step_pass_ab.json").read_text())
    got = {
        r["arm"]: round(
            estimate_of_what_ran(
                SHAPES["7b"], vocab_size("7b"), True, r["n"], r["prompt_tokens"], r["new_tokens"], 16, r
            ),
            2,
        )
        for r in doc["results"]
    }
    assert got == {"fused": 54.5, "unfused": 71.68, "ragged_aligned": 54.5, "ragged_masked": 58.86}
