"""``qerl.train.memory``: the peak-memory estimate against every peak recorded on a GPU in ``benchmarks/results/``,
its terms against hand counts, and ``python -m qerl.train`` refusing, before loading anything, a run that would not
fit on its card (``torch.cuda`` mocked: no GPU here)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from qerl.cli import UsageError
from qerl.cli import run as run_cli
from qerl.kernels import backend
from qerl.train import run as train_run
from qerl.train.data import prompt_budget
from qerl.train.memory import GB, NATIVE_KV_BLOCK, ModelShape, RunShape, check_fits, estimate, planned_run
from qerl.train.recompute import HEAD_ACTIVATIONS, no_recompute_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def recorded_rows() -> list[tuple[str, dict[str, Any], RunShape, float]]:
    """(file, row, the row's configuration as a RunShape, the peak it measured in bytes) for every row of a qerl
    GRPO step recorded on a GPU: grpo_step.json and grpo_step_72b.json (micro-batch 2, trained norms, as their setup
    says; the peak above what the process held before building the model) and the qerl arms of e2e.json (micro-batch
    8, LoRA without trained norms: e2e.build_trainer's lora_config(r)). trl's own arm (trl_vllm_bf16) is not a
    qerl.train run: its peak is vLLM's pool and trl's trainer, which the estimate does not model."""
    out = []
    for name in ("grpo_step.json", "grpo_step_72b.json"):
        doc = json.loads((RESULTS / name).read_text())
        assert "trainable norms" in doc["setup"]["lora"]
        for row in doc["results"]:
            assert row["status"] == "ok" and row["gradient_checkpointing"] is True  # they ran full recompute
            assert "adamw" in row["optimizer"].lower() and "8bit" not in row["optimizer"]
            run = RunShape(row["n"], row["micro_batch"], row["prompt_tokens"], row["new_tokens"], row["lora_r"])
            out.append((name, row, run, (row["peak_gb_step"] - row["allocated_before_build_gb"]) * GB))
    e2e = json.loads((RESULTS / "e2e.json").read_text())
    for row in e2e["results"]:
        if row["trainer"] != "qerl":
            continue
        # These rows predate auto recompute (e2e.py records the mode each row ran since then): trl's default ran,
        # full recompute in every pass.
        assert row["status"] == "ok" and "recompute" not in row and row["engine"] == "native"
        sizes = (row["sequences"], row["micro_batch"], row["prompt_tokens"], row["new_tokens"], row["lora_r"])
        out.append(("e2e.json", row, RunShape(*sizes, trained_norms=False), row["peak_allocated_gb"] * GB))
    ab = json.loads((RESULTS / "grpo_step_pass_ab.json").read_text())
    for row in ab["results"]:
        # No recompute, each micro-batch of 8 in two chunks of 4 rows: the pass holds one chunk's activations.
        assert row["recompute"]["mode"] == "none" and row["chunking"]["rows_per_chunk"] == {"4": 4}
        run = RunShape(
            row["n"],
            4,
            row["prompt_tokens"],
            row["new_tokens"],
            row["lora_r"],
            recompute=False,
            masked=not row["aligned_rows"],  # aligned rows run without a mask, at the longest row's length
            fused=row["fused_layers"]["swapped"],
        )
        out.append(("grpo_step_pass_ab.json", row, run, row["peak_gb_step"] * GB))
    return out


def row_model(row: dict[str, Any]) -> ModelShape:
    """The row's model: grpo_step's shape by name, e2e's Qwen2.5-7B (``e2e.model_shape``)."""
    from benchmarks.e2e import model_shape
    from benchmarks.grpo_step import SHAPES, vocab_size

    shape, vocab = (SHAPES[row["shape"]], vocab_size(row["shape"])) if "shape" in row else model_shape(tiny=False)
    return ModelShape.from_config({**shape, "vocab_size": vocab}, nvfp4=row["base"] == "nvfp4")


def test_the_estimate_is_within_10_percent_of_every_recorded_peak() -> None:
    """The peak of each row, and where the row records it (grpo_step's), what the step held at its start: the
    resident terms apart from the training pass."""
    rows = recorded_rows()
    # 7B NVFP4 / bf16 and 32B NVFP4, 72B NVFP4, e2e's two qerl arms; the pass A/B's four 7B arms (fused layers on
    # and off, aligned and masked rows)
    assert len(rows) == 10
    ratios = {}
    for name, row, run, measured in rows:
        est = estimate(row_model(row), run)
        key = f"{name} {row.get('arm', row.get('shape', '7b'))} {row['base']} micro {run.micro_batch}"
        ratios[key] = est.peak / measured
        if "allocated_at_step_start_gb" in row:
            start = (row["allocated_at_step_start_gb"] - row["allocated_before_build_gb"]) * GB
            ratios[f"{key} start"] = est.resident / start
    assert len(ratios) == 17 and all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}


def test_the_terms_against_hand_counts() -> None:
    """Weights, trainable state (fp32 and 8-bit AdamW), the engines' memory and both training passes of a 2-layer
    shape (h 64, i 128, 4 heads of 16, 2 KV heads), counted by hand."""
    linear = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k and v, o, gate / up / down, 2 layers
    dense = ModelShape.from_config(TINY)
    assert dense.linear_params == linear and not dense.nvfp4
    run = RunShape(rollout_rows=5, micro_batch=2, prompt_tokens=100, completion_tokens=200, lora_r=4, masked=False)
    e = estimate(dense, run)
    assert e.weights == linear * 2 + 2 * 1000 * 64 * 2  # bf16 Linears, embeddings and an untied head
    lora = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert e.trainable_states == (lora + 2 * 2 * 64) * 16 and e.engine_lora == lora * 2
    # 5 rows -> the engine's bucket of 8; 300 positions -> 512, its 256-position blocks; K and V of 2 x 16, bf16
    assert e.kv_cache == 2 * (2 * 2 * 16 * 2) * 8 * 512 and e.engine_pool == 0
    assert e.checkpointed == 2 * 2 * 300 * 64 * 2
    assert e.layer_recompute == 2 * 300 * (3 * 128 + 4 * 64) * 2  # no dequantized copies for a dense model
    assert e.head_and_grads == HEAD_ACTIVATIONS * 2 * 300 * 64 * 2 and e.no_recompute_pass == 0
    assert e.peak == e.resident + e.training_pass
    none = estimate(dense, dataclasses.replace(run, recompute=False))
    assert none.training_pass == none.no_recompute_pass == no_recompute_bytes(dense.dims(), 2, 300, 4, nvfp4=False)
    assert none.resident == e.resident
    fused = estimate(dense, dataclasses.replace(run, recompute=False, fused=True))
    assert fused.no_recompute_pass == no_recompute_bytes(dense.dims(), 2, 300, 4, nvfp4=False, fused=True)
    assert fused.no_recompute_pass < none.no_recompute_pass
    hf = estimate(dense, dataclasses.replace(run, engine="hf"))
    assert hf.kv_cache == 2 * (2 * 2 * 16 * 2) * 5 * 300 and hf.engine_lora == 0  # as many rows and positions
    vllm = estimate(dense, dataclasses.replace(run, engine="vllm", engine_share=0.25), card_total=8 * GB)
    assert vllm.engine_pool == 2 * GB and vllm.kv_cache == vllm.engine_lora == 0
    # 8-bit AdamW: 2 B of moments (+ fp32 absmax per 256) for tensors of >= 4096 values; the rest stays 32-bit
    big = estimate(dense, dataclasses.replace(run, lora_r=64, eight_bit=True, trained_norms=False))
    sizes = dense.trainable_tensors(
        64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False
    )
    assert big.trainable_states == pytest.approx(sum(n * (8 + (2 * (1 + 4 / 256) if n >= 4096 else 8)) for n in sizes))
    assert (
        big.trainable_states
        < estimate(dense, dataclasses.replace(run, lora_r=64, trained_norms=False)).trainable_states
    )


def test_the_checkpoint_decides_how_the_weights_are_stored() -> None:
    """An NVFP4A16 checkpoint's config packs its Linears at 9/16 B except what its ignore list keeps in bf16; a tied
    head costs nothing beyond the embeddings; a config value that is not a positive integer is named."""
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    plain = ModelShape.from_config({**TINY, "quantization_config": {**nvfp4, "ignore": ["lm_head"]}})
    assert plain.nvfp4 and not plain.packed_head and plain.dense_linear_params == 0
    run = RunShape(8, 2, 100, 200, 4)
    packed = plain.linear_params * 9 / 16
    assert estimate(plain, run).weights == int(packed + 2 * 1000 * 64 * 2)
    ignore = ["re:.*mlp.down_proj$", "model.layers.0.self_attn.q_proj"]
    mixed = ModelShape.from_config({**TINY, "quantization_config": {**nvfp4, "ignore": ignore}})
    assert mixed.packed_head and mixed.dense_linear_params == 2 * 128 * 64 + 64 * 64
    head = 1000 * 64 * 9 / 16
    dense_part = mixed.dense_linear_params
    assert estimate(mixed, run).weights == int(
        (mixed.linear_params - dense_part) * 9 / 16 + dense_part * 2 + 1000 * 64 * 2 + head
    )
    tied = ModelShape.from_config({**TINY, "tie_word_embeddings": True})
    assert estimate(tied, run).weights == tied.linear_params * 2 + 1000 * 64 * 2
    with pytest.raises(ValueError, match=r"^config.json: hidden_size is '64'; expected a positive integer$"):
        ModelShape.from_config({**TINY, "hidden_size": "64"})


def test_the_native_kv_block_is_the_engines_default() -> None:
    from qerl.rollout.native import NativeEngine

    assert inspect.signature(NativeEngine).parameters["kv_block"].default == NATIVE_KV_BLOCK


class Proceeded(Exception):
    """Raised where the run would build the trainer: it got past the memory check."""


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``python -m qerl.train`` on a mocked CUDA card (``card["free"]``, ``card["total"]`` bytes): the flags are parsed
    on this CPU machine as on a CUDA one (``use_cpu`` off), then torch.cuda reports the card; building the trainer
    raises :class:`Proceeded` instead of loading the model."""
    parse = train_run.parse_args
    state: dict[str, Any] = {"free": 7.5 * GB, "total": 8 * GB}

    real = {name: getattr(torch.cuda, name) for name in ("is_available", "mem_get_info", "get_device_properties")}

    def parse_on_a_card(argv: Any) -> Any:
        for name, function in real.items():  # a main() before this one left the card in place
            monkeypatch.setattr(torch.cuda, name, function)
        script, config = parse(argv)
        config.use_cpu = False
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(state["free"]), int(state["total"])))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(name="Mock GPU"))
        return script, config

    def build(*args: Any, **kwargs: Any) -> None:
        raise Proceeded

    monkeypatch.setattr(train_run, "parse_args", parse_on_a_card)
    monkeypatch.setattr(train_run, "build_trainer", build)
    return state


def _argv(model: Path, out: Path, *extra: str, prompt_bound: bool = True) -> list[str]:
    """SmolLM2 on arithmetic: 16 completions of up to 4096 tokens in one training pass of 16; prompts bounded to 256
    tokens (``prompt_bound``), else the default bound."""
    argv = [
        "--model-name", str(model), "--dataset", "arithmetic", "--num-samples", "32", "--output-dir", str(out),
        "--report-to", "none", "--max-completion-length", "4096", "--num-generations", "16",
        "--per-device-train-batch-size", "16", "--gradient-accumulation-steps", "1",
    ]  # fmt: skip
    return argv + (["--max-prompt-length", "256"] if prompt_bound else []) + list(extra)


def test_a_run_that_will_not_fit_is_refused_before_anything_loads(
    smollm2_dir: Path,
    tmp_path: Path,
    card: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SmolLM2-135M, 16 completions of 256 + 4096 tokens in passes of 16 on an 8 GB card with 6.5 GB free: ~6.6 GB
    with the engine's cache freed for the pass, refused in one line naming the estimate, the free memory and the
    micro-batch that fits, before the data, the model's digest or the model; nothing is left in or beside the output
    dir."""
    card["free"] = 6.5 * GB
    for owner, name in ((train_run.data, "load_dataset"), (train_run, "resolved_sha256")):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran before the memory check"))
    assert run_cli(train_run.main, _argv(smollm2_dir, tmp_path / "run")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and not any("Traceback" in line for line in lines), lines
    assert errors[0] == (
        "error: will not fit on Mock GPU (cuda:0): the run's peak is estimated at 6.6 GB (weights 0.3 + LoRA and "
        "optimizer 0.1 + rollout engine 1.6 + training pass 6.3 GB, the engine's 1.6 GB freed for the pass) and the "
        "card has 6.5 GB free of 8.0 GB (5% of it kept as headroom); --per_device_train_batch_size 8 "
        "--gradient_accumulation_steps 2 would fit it (~3.5 GB), or --force runs it anyway"
    )
    assert list(tmp_path.iterdir()) == []  # no output dir, no lock file beside it


def test_force_runs_anyway_and_a_run_that_fits_goes_on(
    smollm2_dir: Path,
    tmp_path: Path,
    card: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refused run with ``--force`` gets past the check (the refusal logged as a warning; ``--force`` is not part
    of the run's settings record, so a resume with or without it is the same run), and so does the run with the
    suggested micro-batch, without one."""
    card["free"] = 6.5 * GB
    continuation, recorded = train_run.resume.continuation, []
    monkeypatch.setattr(
        train_run.resume,
        "continuation",
        lambda out, wanted, *a: recorded.append(wanted) or continuation(out, wanted, *a),
    )
    with caplog.at_level(logging.INFO, logger="qerl.train.memory"), pytest.raises(Proceeded):
        train_run.main(_argv(smollm2_dir, tmp_path / "forced", "--force"))
    assert len(recorded) == 1 and "force" not in recorded[0] and "plot" in recorded[0]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("will not fit on Mock GPU (cuda:0): the run's peak is estimated at 6.6 GB")
    assert warning.endswith("; running anyway (--force)")
    caplog.clear()
    fits = ("--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "2")
    with caplog.at_level(logging.INFO, logger="qerl.train.memory"), pytest.raises(Proceeded):
        train_run.main(_argv(smollm2_dir, tmp_path / "fits", *fits))
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].getMessage().startswith("memory: peak estimated at 3.5 GB")


@pytest.mark.parametrize(
    ("flags", "prompt_bound", "free_gb", "fix"),
    [
        # the engine's memory kept through the pass: freeing it for the pass fits (and changes no result)
        (
            ["--release-rollout-memory", "False"],
            True,
            7.5,
            "--release_rollout_memory unset (or True) would fit it (~6.6 GB)",
        ),
        # no recompute asked for: ~60 GB; recompute alone fits (and changes no result)
        (["--gradient-checkpointing", "False"], True, 16, "--gradient_checkpointing True would fit it (~6.6 GB)"),
        # vLLM's 90% of 16 GB beside the trainer's 6.6 GB: half the card fits
        (
            ["--rollout-engine", "vllm", "--vllm-gpu-memory-utilization", "0.9"],
            True,
            16,
            "--vllm_gpu_memory_utilization 0.5 would fit it (~14.6 GB)",
        ),
        # --max_prompt_length left at its default bound (4096 here): a shorter bound first
        ([], False, 8, "--max_prompt_length 768 would fit it (~7.3 GB)"),
        # lengths fixed by the flags and a micro-batch of 1: the completion budget last
        (
            ["--per-device-train-batch-size", "1", "--gradient-accumulation-steps", "16"],
            True,
            1.6,
            "--max_completion_length 2816 would fit it (~1.5 GB)",
        ),
        # nothing single does on a 1 GB card
        (
            [],
            True,
            1,
            "no single change of --gradient_checkpointing, --per_device_train_batch_size or the lengths makes it fit",
        ),
    ],
)
def test_the_refusal_names_the_flag_that_makes_it_fit(
    smollm2_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    prompt_bound: bool,
    free_gb: float,
    fix: str,
) -> None:
    script, config = train_run.parse_args(_argv(smollm2_dir, tmp_path / "run", *flags, prompt_bound=prompt_bound))
    config.use_cpu = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gb * GB), int(free_gb * GB)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(name="Mock GPU"))
    monkeypatch.setenv("LOCAL_RANK", "1")  # under accelerate launch: this process's card
    with pytest.raises(UsageError) as refused:
        budget = prompt_budget(script.max_prompt_length, config.max_completion_length, smollm2_dir)
        check_fits(script, config, budget, smollm2_dir)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("will not fit on Mock GPU (cuda:1): the run's peak is estimated at ")
    assert f"the card has {free_gb:.1f} GB free of {free_gb:.1f} GB" in line and fix in line, line


def test_without_cuda_there_is_no_check(smollm2_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script, config = train_run.parse_args(_argv(smollm2_dir, tmp_path / "run", "--max-completion-length", "100000"))
    with caplog.at_level(logging.INFO, logger="qerl.train.memory"):
        assert check_fits(script, config, 4096, smollm2_dir) is None
    assert [r.getMessage() for r in caplog.records] == [
        "memory check skipped: no CUDA device (the run trains on the CPU)"
    ]


def test_the_run_shape_of_the_flags(smollm2_dir: Path, tmp_path: Path) -> None:
    """A generation batch of per-device batch x steps_per_generation completions, the micro-batch, the lengths, the
    recompute asked for; a kv_block of 0 in the engine's kwargs is its default block, not a division by zero."""
    extra = ("--steps-per-generation", "2", "--gradient-checkpointing", "False")
    extra += ("--rollout-engine-kwargs", '{"kv_block": 0}', "--lora-rank", "8", "--ln", "False")
    script, config = train_run.parse_args(_argv(smollm2_dir, tmp_path / "run", *extra))
    shape = planned_run(script, config, 256)
    assert (shape.rollout_rows, shape.micro_batch, shape.prompt_tokens, shape.completion_tokens) == (32, 16, 256, 4096)
    assert (shape.lora_r, shape.trained_norms, shape.recompute, shape.kv_block) == (8, False, False, NATIVE_KV_BLOCK)
    assert shape.engine == "native" and not shape.eight_bit
    assert shape.fused == backend.enabled()  # fused layers are the default where the Triton kernels serve
    script, config = train_run.parse_args(_argv(smollm2_dir, tmp_path / "run", "--fused-layers", "False"))
    assert not planned_run(script, config, 256).fused
