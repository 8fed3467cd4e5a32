"""QeRLTrainer on the embedded default (SmolLM2-135M) in NVFP4: GRPO steps with AQN, resume, adapters.

CPU, fp32, one thread. One 3-step run (checkpoint at step 2) is shared by the tests that inspect it;
the resume test continues from its step-2 checkpoint and must reproduce its step-3 loss.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from qerl.load.loader import load_model, load_tokenizer
from qerl.load.lora import load_adapter, lora_config
from qerl.train.aqn import AQNSchedule, norm_weights
from qerl.train.data import load_dataset
from qerl.train.rollout_hooks import group_repeats
from qerl.train.trainer import (
    CHECKPOINT_MARKER,
    METRICS_FILE,
    QeRLConfig,
    QeRLTrainer,
    last_complete_checkpoint,
)

STEPS = 3


def varied_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A deterministic reward with spread, so that advantages (and gradients) are non-zero."""
    return [float(len(c[-1]["content"]) % 3) for c in completions]


def make_config(out: Path, **overrides: Any) -> QeRLConfig:
    base = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_steps=2,
        report_to=[],
        seed=0,
        num_stages=3,
        sigma_start=1e-2,
        sigma_end=1e-3,
        warmup_steps=0,
        learning_rate=1e-3,
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=1,
        aqn=True,  # AQN on the dense test model too (default: NVFP4 only)
    )
    base.update(overrides)
    return QeRLConfig(**base)


def make_trainer(model_dir: Path, out: Path, **overrides: Any) -> QeRLTrainer:
    torch.manual_seed(0)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    return QeRLTrainer(
        model,
        [varied_reward],
        make_config(out, **overrides),
        train_dataset=load_dataset("arithmetic", num_samples=32),
        processing_class=tok,
        peft_config=lora_config(r=4, train_norms=True),
    )


class Recorder:
    """Wraps the trainer's rollout to check the norm weights around it and keep the noisy ones."""

    def __init__(self, trainer: QeRLTrainer) -> None:
        self.trainer = trainer
        self.norms = [w for _, w in norm_weights(trainer.model)]
        self.restored: list[bool] = []
        self.noise_std: list[float] = []
        original = trainer._generate_single_turn
        engine_generate = None

        def during(*args: Any, **kwargs: Any) -> Any:
            self.noise_std.append(
                torch.cat([(w - c).flatten() for w, c in zip(self.norms, self.before, strict=True)]).std().item()
            )
            return engine_generate(*args, **kwargs)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal engine_generate
            engine = trainer.rollout_engine()
            if engine_generate is None:
                engine_generate = engine.generate
                engine.generate = during
            self.before = [w.detach().clone() for w in self.norms]
            out = original(*args, **kwargs)
            self.restored.append(all(torch.equal(w, b) for w, b in zip(self.norms, self.before, strict=True)))
            return out

        trainer._generate_single_turn = wrapped


@pytest.fixture(scope="module")
def run(smollm2_nvfp4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("qerl-run")
    trainer = make_trainer(smollm2_nvfp4_dir, out)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    recorder = Recorder(trainer)
    trainer.train()
    return {
        "trainer": trainer,
        "out": out,
        "recorder": recorder,
        "lora_before": lora_before,
        "model_dir": smollm2_nvfp4_dir,
    }


def step_logs(trainer: QeRLTrainer) -> list[dict[str, Any]]:
    return [r for r in trainer.state.log_history if "loss" in r]


def test_grpo_steps_with_aqn_train_lora(run: dict[str, Any]) -> None:
    trainer = run["trainer"]
    logs = step_logs(trainer)
    assert [r["step"] for r in logs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logs)
    assert any(r["loss"] != 0 for r in logs)
    changed = [
        n for n, p in trainer.model.named_parameters() if "lora_B" in n and not torch.equal(p, run["lora_before"][n])
    ]
    assert len(changed) == len([n for n in run["lora_before"] if "lora_B" in n])  # every B moved off its zero init


def test_norm_weights_are_bit_identical_around_every_rollout(run: dict[str, Any]) -> None:
    rec = run["recorder"]
    assert rec.restored == [True] * STEPS


def test_sigma_follows_the_schedule_over_the_real_run(run: dict[str, Any]) -> None:
    trainer, rec = run["trainer"], run["recorder"]
    sched = AQNSchedule(1e-2, 1e-3, 3)
    expected = [sched.sigma(step, STEPS) for step in range(STEPS)]
    assert expected == [0.0, 1e-2, pytest.approx(1e-3)]
    assert [r["aqn/sigma"] for r in step_logs(trainer)] == expected
    # what the rollout really saw: clean weights at stage 0, then noise of the scheduled size
    assert rec.noise_std[0] == 0.0
    assert rec.noise_std[1] == pytest.approx(1e-2, rel=0.1) and rec.noise_std[2] == pytest.approx(1e-3, rel=0.1)
    assert step_logs(trainer)[1]["aqn/changed_frac"] > 0.99


def test_logs_and_metrics_file(run: dict[str, Any]) -> None:
    first = step_logs(run["trainer"])[0]
    for key in (
        "rewards/varied_reward/mean",
        "rewards/varied_reward/std",
        "entropy",
        "completions/mean_length",
        "rollout/tokens_per_s",
        "step_time",
        "sampling/importance_sampling_ratio/mean",
    ):
        assert key in first and math.isfinite(first[key]), key
    lines = [json.loads(x) for x in (run["out"] / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]


def test_optimizer_holds_state_for_trainable_params_only(run: dict[str, Any]) -> None:
    trainer = run["trainer"]
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert in_opt == trainable
    norm_names = [n for n, p in trainer.model.named_parameters() if p.requires_grad and "layernorm" in n]
    assert len(norm_names) == 2 * trainer.model.config.num_hidden_layers  # --ln: input/post-attention norms train


def test_checkpoint_is_marked_complete_and_loads_in_peft(run: dict[str, Any]) -> None:
    from peft import get_peft_model_state_dict

    ckpt = run["out"] / "checkpoint-2"
    marker = json.loads((ckpt / CHECKPOINT_MARKER).read_text())
    assert marker["global_step"] == 2 and marker["aqn"]["stage"] == 2
    base = load_model(run["model_dir"], device="cpu", dtype=torch.float32)
    model = load_adapter(base, str(ckpt))
    saved = load_file(ckpt / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any("layernorm" in k for k in saved)  # the trained norms travel with the adapter
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "NVFP4LoraLinear"


def test_evaluation_applies_the_trained_adapter(run: dict[str, Any]) -> None:
    """Issue 6's proof that eval really applies an adapter: the one this trainer test produced, loaded
    through eval's own loader, changes the logits versus the base model."""
    from eval.loading import apply_adapter, load_base

    ckpt = run["out"] / "checkpoint-3"
    ids = torch.tensor([[1, 9690, 314, 216, 28, 33, 28, 47, 2]])
    base = load_base(str(run["model_dir"]), "nvfp4", torch.float32, "cpu")
    with torch.no_grad():
        before = base(ids).logits
        tuned = apply_adapter(base, str(ckpt), str(run["model_dir"]))
        after = tuned(ids).logits
        with tuned.disable_adapter():
            disabled = tuned(ids).logits
    assert (after - before).abs().max().item() > 1e-3
    assert torch.allclose(disabled, before, atol=1e-5)


def test_resume_reproduces_the_next_step_and_skips_half_written_checkpoints(
    run: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(run["out"], out)
    (out / "checkpoint-3" / CHECKPOINT_MARKER).unlink()  # as if the process died while saving step 3
    assert last_complete_checkpoint(out) == str(out / "checkpoint-2")
    assert not (out / "checkpoint-3").exists() and list(out.glob(".incomplete-checkpoint-3-*"))
    trainer = make_trainer(run["model_dir"], out)
    trainer.train(resume_from_checkpoint=True)
    history = step_logs(trainer)  # steps 1-2 come back with the checkpoint's trainer state
    assert [r["step"] for r in history] == [1, 2, 3] and history[:2] == step_logs(run["trainer"])[:2]
    resumed, uninterrupted = history[2], step_logs(run["trainer"])[2]
    assert resumed["aqn/sigma"] == uninterrupted["aqn/sigma"]
    assert resumed["reward"] == uninterrupted["reward"]  # same rollouts: sampler seeds follow the step
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5, abs=1e-9)
    assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=1e-5)
    assert resumed["learning_rate"] == uninterrupted["learning_rate"]  # scheduler restored
    # the step-3 update itself used the restored Adam moments and LR: the adapters end up equal
    final = dict(run["trainer"].model.named_parameters())
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, final[name], rtol=1e-5, atol=1e-7, msg=name)


def test_incomplete_checkpoint_is_refused(run: dict[str, Any], tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        run["trainer"].train(resume_from_checkpoint=str(ckpt))


def test_aqn_on_a_dense_model_with_per_token_draws(
    tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qerl.train.aqn import NormNoise

    calls: list[int] = []
    real_hook = NormNoise.token_hook
    monkeypatch.setattr(NormNoise, "token_hook", lambda self: (calls.append(1), real_hook(self))[1])
    trainer = make_trainer(
        tiny_dense_dir,
        tmp_path / "dense",
        max_steps=2,
        num_stages=2,
        max_completion_length=4,
        aqn_resample="token",
        learning_rate=None,
        save_strategy="no",
    )
    trainer.train()
    assert trainer.args.learning_rate == 5e-6  # the bf16-LoRA recipe's LR for a non-quantized model
    logs = step_logs(trainer)
    assert [r["aqn/sigma"] for r in logs] == [0.0, 1e-2]
    assert logs[1]["aqn/changed_frac"] > 0.99
    assert len(calls) >= 2 * 4  # the engine redrew before prefill and before every decode step


def test_token_resampling_needs_an_engine_step_hook(tiny_dense_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_dense_dir, tmp_path / "hf", rollout_engine="hf", aqn_resample="token")
    with pytest.raises(ValueError, match="--aqn_resample token"):
        trainer.rollout_engine()


def test_group_repeats() -> None:
    assert group_repeats([[1, 2], [1, 2], [3], [3]]) == ([[1, 2], [3]], 2)
    assert group_repeats([[1], [1], [2]]) == ([[1], [1], [2]], 1)
    assert group_repeats([[1], [2]]) == ([[1], [2]], 1)


def test_config_defaults_and_errors(tmp_path: Path) -> None:
    from qerl.train.config import TRL_DEFAULT_OVERRIDES, trl_differences

    cfg = QeRLConfig(output_dir=str(tmp_path), report_to=[])
    assert cfg.vllm_importance_sampling_mode == "token_truncate" and cfg.vllm_importance_sampling_clip_max == 2.0
    assert cfg.bf16 is torch.cuda.is_available()
    # trl's defaults everywhere else: the reference's DAPO recipe lives in training/recipes
    assert (cfg.loss_type, cfg.epsilon_high, cfg.mask_truncated_completions, cfg.weight_decay) == (
        "dapo",
        None,
        False,
        0.0,
    )
    assert (cfg.num_train_epochs, cfg.logging_steps, cfg.max_grad_norm, cfg.lr_scheduler_type) == (3, 10, 1.0, "linear")
    assert set(trl_differences(cfg)) <= set(TRL_DEFAULT_OVERRIDES)  # every difference is listed with its reason
    ref = QeRLConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, warmup_ratio=0.05)  # reference spellings
    assert (ref.rollout_engine, ref.use_vllm, ref.warmup_steps) == ("vllm", False, 0.05)
    for bad, message in (
        (dict(rollout_engine="sglang"), r"--rollout_engine: expected one of .*'vllm'\), got 'sglang'"),
        (dict(aqn_resample="layer"), r"--aqn_resample: expected one of \('step', 'token'\), got 'layer'"),
        (dict(num_stages=1), r"--num_stages: expected >= 2 \(stage 0 is noise-free\), got 1"),
        (dict(rollout_engine_kwargs="{not json"), r"--rollout_engine_kwargs: expected a JSON object, got '\{not json'"),
        (dict(aqn_schedule="step"), r"--aqn_schedule: expected one of .*'logarithmic'\), got 'step'"),
    ):
        with pytest.raises(ValueError, match=message):
            QeRLConfig(output_dir=str(tmp_path), report_to=[], **bad)


def test_8bit_adamw_falls_back_without_bitsandbytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with caplog.at_level("WARNING", logger="qerl.train.config"):
        cfg = QeRLConfig(output_dir=str(tmp_path), report_to=[], optim="adamw_8bit")
    assert cfg.optim == "adamw_torch"
    assert "--optim adamw_8bit: bitsandbytes is not installed, using adamw_torch" in caplog.text


def test_plot_writes_curves(run: dict[str, Any], tmp_path: Path) -> None:
    import csv

    from qerl.train.plot import main as plot_main

    plot_main([str(run["out"]), "--out", str(tmp_path)])
    for name in ("reward.png", "entropy.png", "sigma.png", "completion_length.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    rows = list(csv.DictReader((tmp_path / "curves.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [float(r["aqn/sigma"]) for r in rows] == pytest.approx([0.0, 1e-2, 1e-3])


def test_cli_accepts_the_reference_flags(tmp_path: Path) -> None:
    from trl import TrlParser

    from qerl.train.run import ScriptArguments

    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset: arithmetic\nlora_rank: 8\nsigma_start: 0.02\n")
    script, cfg = TrlParser((ScriptArguments, QeRLConfig)).parse_args_and_config(
        [
            "--config",
            str(recipe),
            "--model-name",
            "m",
            "--dataset",
            "gsm8k",
            "--lora-rank",
            "16",
            "--lora-alpha",
            "16",
            "--ln",
            "True",
            "--sigma-start",
            "1e-2",
            "--sigma-end",
            "1e-4",
            "--num-stages",
            "10",
            "--use-vllm",
            "True",
            "--warmup-ratio",
            "0.1",
            "--max-prompt-length",
            "256",
            "--max-completion-length",
            "2048",
            "--loss-type",
            "bnpo",
            "--epsilon-high",
            "0.28",
            "--mask-truncated-completions",
            "True",
            "--max-seq-length",
            "2500",
            "--fast-inference",
            "True",
            "--random-state",
            "2025",
            "--output-dir",
            str(tmp_path / "o"),
            "--report-to",
            "none",
        ]
    )
    assert (script.model_name, script.dataset, script.lora_rank, script.ln, script.max_prompt_length) == (
        "m",
        "gsm8k",
        16,
        True,
        256,
    )
    assert (cfg.sigma_start, cfg.sigma_end, cfg.num_stages, cfg.rollout_engine, cfg.warmup_steps) == (
        1e-2,
        1e-4,
        10,
        "vllm",
        0.1,
    )


def test_train_entry_point_end_to_end(tiny_dense_dir: Path, tmp_path: Path) -> None:
    from qerl.train.run import main

    out = tmp_path / "run"
    summary = main(
        [
            "--model-name",
            str(tiny_dense_dir),
            "--dataset",
            "arithmetic",
            "--num-samples",
            "12",
            "--heldout",
            "4",
            "--heldout-max-tokens",
            "4",
            "--lora-rank",
            "2",
            "--max-steps",
            "1",
            "--per-device-train-batch-size",
            "2",
            "--num-generations",
            "2",
            "--max-completion-length",
            "4",
            "--output-dir",
            str(out),
            "--report-to",
            "none",
            "--disable-tqdm",
            "True",
            "--save-strategy",
            "no",
            "--logging-steps",
            "1",
        ]
    )
    assert summary["global_step"] == 1 and summary["train_rows"] == 8 and summary["heldout_rows"] == 4
    for key in ("heldout_accuracy_before", "heldout_accuracy_after"):  # a share of the 4 held-out questions
        assert summary[key] in (0.0, 0.25, 0.5, 0.75, 1.0), (key, summary[key])
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "plots" / "reward.png").exists()
    assert len((out / "heldout.jsonl").read_text().splitlines()) == 4
    assert json.loads((out / "summary.json").read_text())["adapter"] == str(out / "adapter")


def test_training_steps_run_without_cudnn_attention(
    tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN's SDPA backward can return NaN gradients (see ``cudnn_attention_disabled``): every training
    step (rollout, loss, backward) must run with that backend off, and the flag comes back afterwards."""
    from trl import GRPOTrainer

    seen: list[bool] = []
    real = GRPOTrainer.training_step

    def recording(self, *args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "training_step", recording)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    trainer = make_trainer(tiny_dense_dir, tmp_path / "sdp", max_steps=1, max_completion_length=4, save_strategy="no")
    trainer.train()
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()


# --- the settings that differ from trl's -----------------------------------------------------------------------------


def test_trl_differences_accepts_every_batch_shape_trl_accepts(tmp_path: Path) -> None:
    """18 completions per step in generations of 12 (4 prompts x 3): trl accepts it, and listing the settings that
    differ from trl's must not refuse it (it built its reference config without the generation batch)."""
    from qerl.train.config import QeRLConfig, trl_differences

    cfg = QeRLConfig(
        output_dir=str(tmp_path),
        report_to=[],
        per_device_train_batch_size=3,
        gradient_accumulation_steps=6,
        num_generations=4,
        generation_batch_size=12,
    )
    differences = trl_differences(cfg)
    assert "generation_batch_size" not in differences and "steps_per_generation" not in differences


def test_trl_differences_never_stops_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A reference config trl refuses (a trl release with a new rule) costs the report only."""
    from qerl.train import config

    cfg = config.QeRLConfig(output_dir=str(tmp_path), report_to=[])

    def refuse(**kwargs: object) -> None:
        raise ValueError("a rule of a newer trl")

    monkeypatch.setattr(config, "GRPOConfig", refuse)
    assert config.trl_differences(cfg) == {}
    assert "a rule of a newer trl" in caplog.text
