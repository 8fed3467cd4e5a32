"""CPU smoke test of benchmarks/e2e.py (``--tiny``), so the end-to-end benchmark cannot rot between its H200 runs:
the two native-engine arms train warm-up + timed steps on a 2-layer Qwen2 checkpoint (the real run's model type) that ``prepare`` writes (bf16,
then NVFP4 through qerl's quantizer), every timed step is split into phases that add up to it, completions are
forced to full length, the LoRA moves, and the report's summary and plot come out of the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import e2e


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("e2e")
    out = root / "results" / "e2e.json"
    assert (
        e2e.main(
            [
                "run",
                "--tiny",
                "--dir",
                str(root / "ckpt"),
                "--arms",
                "qerl_native_nvfp4",
                "qerl_native_bf16",
                "--batches",
                "b8",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text()) | {"_out": str(out)}


def test_checkpoints_are_real(tiny_run: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = Path(tiny_run["_out"]).parents[1] / "ckpt"
    config = json.loads((ckpt / "bf16" / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768 and config["model_type"] == "qwen2"
    quant = json.loads((ckpt / "nvfp4" / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "nvfp4-pack-quantized"


def test_native_arms_time_every_phase(tiny_run: dict) -> None:
    rows = tiny_run["results"]
    assert [(r["arm"], r["batch"]) for r in rows] == [("qerl_native_nvfp4", "b8"), ("qerl_native_bf16", "b8")]
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["forced_length"] and r["completion_lengths"] == [16] and r["rollout_rows"] == 8
        assert r["lora_updated"] and r["optimizer_steps"] == 3 and len(r["timed_steps"]) == 2
        for step in r["timed_steps"]:
            assert step["step_s"] == pytest.approx(sum(step["phases_s"].values()), rel=1e-3, abs=1e-4)
            assert all(step["phases_s"][p] > 0 for p in ("rollout", "fwd_bwd", "optimizer"))
            assert step["phases_s"]["sync"] == 0  # the native engine reads the trainer's weights in place
            assert step["phases_s"]["logprobs"] == 0  # the IS ratio comes from the loss forward (qerl.train.is_ratio)
        assert set(r["floors_s"]) == {"rollout", "sync", "logprobs", "fwd_bwd", "fwd_bwd_no_recompute", "optimizer"}
        # auto without CUDA: every training pass recomputed (warm-up + 2 timed steps of one pass each), and the
        # training pass's floor counts it; the floor without recompute is reported beside it.
        assert r["recompute"] == {"mode": "full", "share": 1.0, "passes": {"none": 0, "full": 3}}
        assert r["chunking"] == {
            "chunked_passes": 0,
            "rows_per_chunk": {},
            "rollout_memory_freed": 0,
        }  # auto without CUDA: whole passes
        assert r["floors_s"]["fwd_bwd"] > r["floors_s"]["fwd_bwd_no_recompute"] > 0
        assert r["over_floor"]["fwd_bwd_no_recompute"] > r["over_floor"]["fwd_bwd"]
        assert r["generated_tokens_per_s"]["rollout"] > r["generated_tokens_per_s"]["step"] > 0
        assert r["command"].startswith("python") and "--arm" in r["command"]
    assert Path(tiny_run["_out"]).with_suffix(".png").stat().st_size > 0


def test_summary_ratios_point_the_right_way() -> None:
    def row(arm: str, batch: str, step_s: float) -> dict:
        return {"arm": arm, "batch": batch, "status": "ok", "step_s": step_s}

    rows = [
        row("trl_vllm_bf16", "b8", 9.0),
        row("qerl_native_nvfp4", "b8", 4.5),
        row("qerl_vllm_nvfp4", "b128", 6.0),
        row("qerl_native_nvfp4", "b128", 5.0),
        {**row("trl_vllm_bf16", "b128", 1.0), "status": "oom"},
    ]
    s = e2e.summarize(rows)
    assert s["step_speedup_vs_trl_vllm_bf16_b8"] == 2.0 and s["step_speedup_vs_trl_vllm_bf16_b8_met"] is True
    assert (
        s["step_speedup_vs_vllm_rollout_nvfp4_b128"] == 1.2
        and s["step_speedup_vs_vllm_rollout_nvfp4_b128_met"] is False
    )
    assert s["step_speedup_vs_trl_vllm_bf16_b128"] is None  # an arm that ran out of memory gives no ratio


def test_every_arm_gets_prompts_of_the_asked_length(tiny_run: dict) -> None:
    """The checkpoint's saved tokenizer, reloaded for the arms, encodes each prompt to ``--prompt`` ids (AutoTokenizer
    on a qwen2 checkpoint gives transformers' Qwen2Tokenizer, which encoded them to none), and a tokenizer that does
    not is refused by name before any arm is built."""
    from benchmarks.grpo_harness import load_benchmark_tokenizer

    ckpt = Path(tiny_run["_out"]).parents[1] / "ckpt" / "nvfp4"
    prompt = e2e.prompt_rows(1, 8, e2e.TINY_VOCAB)[0]["prompt"]
    assert len(load_benchmark_tokenizer(ckpt, prompt, 8)(prompt).input_ids) == 8
    with pytest.raises(ValueError, match=r"nvfp4: its tokenizer encodes a 9-token benchmark prompt to 8 ids"):
        load_benchmark_tokenizer(ckpt, prompt, 9)
