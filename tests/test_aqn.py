"""AQN: the schedule over the real run, which norms it touches, and bit-exact removal."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from qerl.load.lora import lora_config
from qerl.train.aqn import SCHEDULES, AQNSchedule, NormNoise, norm_weights


def aqn_model() -> torch.nn.Module:
    """A tiny Llama (hidden 32) whose norms are not all ones, so noise on them is seen."""
    model = tiny_model("llama", 0, hidden_size=32, intermediate_size=64, vocab_size=64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_exponential_matches_reference_table() -> None:
    # The reference code's 10-stage 1e-2 -> 1e-4 schedule, stages 1..9: 1e-2 * (1e-4 / 1e-2)^(i / 8), i = 0..8.
    expected = [1.0e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1.0e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1.0e-4]
    sched = AQNSchedule(1e-2, 1e-4, 10, "exponential")
    got = sched.sigmas()
    assert got[0] == 0.0
    assert got[1:] == pytest.approx(expected, rel=2e-3)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_runs_from_start_to_end_and_decays(kind: str) -> None:
    sched = AQNSchedule(5e-2, 5e-4, 6, kind)
    s = sched.sigmas()
    assert s[0] == 0.0
    assert s[1] == pytest.approx(5e-2) and s[-1] == pytest.approx(5e-4)
    assert all(a > b for a, b in zip(s[1:-1], s[2:], strict=True))


def test_schedules_differ_in_the_middle() -> None:
    mids = {k: AQNSchedule(1e-2, 1e-4, 6, k).stage_sigma(3) for k in SCHEDULES}  # stages 1..5: u = 0.5
    assert mids["exponential"] == pytest.approx(1e-3)
    assert mids["linear"] == pytest.approx((1e-2 + 1e-4) / 2)
    assert mids["cosine"] == pytest.approx((1e-2 + 1e-4) / 2)  # cosine and linear meet halfway...
    assert AQNSchedule(1e-2, 1e-4, 6, "cosine").stage_sigma(2) > AQNSchedule(1e-2, 1e-4, 6, "linear").stage_sigma(2)
    assert mids["logarithmic"] == pytest.approx(1e-4 + (1e-2 - 1e-4) * (1 - math.log1p((math.e - 1) * 0.5)))
    assert mids["logarithmic"] < mids["linear"]  # ...while the logarithmic decay falls fastest early


def test_stages_split_the_real_number_of_steps() -> None:
    sched = AQNSchedule(1e-2, 1e-4, 10)
    total = 200  # not the planned epoch length: whatever the trainer will really run
    stages = [sched.stage(step, total) for step in range(total)]
    assert stages[:20] == [0] * 20 and stages[20] == 1 and stages[-1] == 9
    assert [stages.count(k) for k in range(10)] == [20] * 10
    assert sched.sigma(19, total) == 0.0 and sched.sigma(20, total) == pytest.approx(1e-2)
    assert sched.sigma(10_000, total) == pytest.approx(1e-4)  # past the end: clamped to the last stage


@pytest.mark.parametrize("bad", [dict(num_stages=1), dict(sigma_start=0.0), dict(schedule="step")])
def test_bad_schedule_arguments_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        AQNSchedule(**bad)


def test_targets_are_qkv_and_gate_up_norms_only() -> None:
    model = aqn_model()
    names = [n for n, _ in norm_weights(model)]
    assert names == [f"model.layers.{i}.{k}" for i in range(2) for k in ("input_layernorm", "post_attention_layernorm")]
    assert all("model.norm" != n for n in names)


def test_targets_follow_peft_trained_norm_copies() -> None:
    from peft import get_peft_model

    model = get_peft_model(aqn_model(), lora_config(r=2, train_norms=True))
    targets = dict(norm_weights(model))
    wrapper = model.base_model.model.model.layers[0].input_layernorm
    assert targets["base_model.model.model.layers.0.input_layernorm"] is wrapper.modules_to_save["default"].weight


def test_norm_weights_raises_when_there_are_none() -> None:
    with pytest.raises(ValueError, match="AQN"):
        norm_weights(torch.nn.Linear(4, 4))


def test_noise_is_applied_then_removed_bit_exactly_and_never_accumulates() -> None:
    model = aqn_model()
    weights = norm_weights(model)
    final_before = model.model.norm.weight.detach().clone()
    clean = [w.detach().clone() for _, w in weights]
    noise = NormNoise(weights, seed=3)
    sigma = 1e-2
    for step in range(3):
        with noise.applied(sigma, step):
            deltas = torch.cat([(w - c).flatten() for (_, w), c in zip(weights, clean, strict=True)])
            assert deltas.abs().max() > 0
            assert deltas.std().item() == pytest.approx(sigma, rel=0.25)  # fresh N(0, sigma^2) around the clean weight
        for (_, w), c in zip(weights, clean, strict=True):
            assert torch.equal(w, c)
    assert torch.equal(model.model.norm.weight, final_before)


def test_noise_is_removed_even_when_the_rollout_fails() -> None:
    weights = norm_weights(aqn_model())
    clean = [w.detach().clone() for _, w in weights]
    noise = NormNoise(weights)
    with pytest.raises(RuntimeError, match="boom"), noise.applied(1e-2, 0):
        raise RuntimeError("boom")
    assert all(torch.equal(w, c) for (_, w), c in zip(weights, clean, strict=True))


def test_draws_are_deterministic_per_step_and_distinct_across_steps_and_resamples() -> None:
    w = torch.ones(1000)
    noise = NormNoise([("n", w)], seed=7)

    def draw(step: int, resamples: int = 0) -> torch.Tensor:
        with noise.applied(1e-2, step) as h:
            for _ in range(resamples):
                h.resample()
            return w.clone()

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))
    assert not torch.equal(draw(5), draw(5, resamples=1))
    with noise.applied(0.0, 1):
        assert torch.equal(w, torch.ones(1000))  # stage 0: nothing drawn


def test_bf16_noise_is_added_in_fp32_and_rounded_once() -> None:
    clean = torch.linspace(0.5, 1.5, 4096).to(torch.bfloat16)
    w = clean.clone()
    noise = NormNoise([("n", w)], seed=1)
    with noise.applied(2e-3, 0):
        gen = torch.Generator().manual_seed(noise_seed(noise, 0))
        z = torch.randn(4096, generator=gen) * 2e-3
        assert torch.equal(w, (clean.float() + z).to(torch.bfloat16))
        assert 0.0 < noise.changed_fraction < 1.0  # some draws sit under half a bf16 ulp
    assert torch.equal(w, clean)


def noise_seed(noise: NormNoise, step: int) -> int:
    from qerl.train.aqn import draw_seed

    return draw_seed(noise.seed, step, 0)


def test_applied_is_not_reentrant_and_rejects_bad_sigma() -> None:
    noise = NormNoise([("n", torch.ones(3))])
    with pytest.raises(ValueError):
        with noise.applied(float("nan"), 0):
            pass
    with noise.applied(1e-3, 0), pytest.raises(RuntimeError, match="re-entrant"):
        with noise.applied(1e-3, 0):
            pass


def test_token_hook_redraws_inside_a_rollout_and_is_inert_outside() -> None:
    w = torch.ones(4000)
    noise = NormNoise([("n", w)], seed=0)
    noise.token_hook()
    assert torch.equal(w, torch.ones(4000))  # registered with an engine but no rollout running
    with noise.applied(1e-2, 0):
        noise.token_hook()
        first = w.clone()
        noise.token_hook()
        assert not torch.equal(w, first)  # a fresh draw per decode step...
        assert (w - 1).std().item() == pytest.approx(1e-2, rel=0.1)  # ...around the clean weight, not accumulated
    assert torch.equal(w, torch.ones(4000))
    with torch.no_grad():
        w.fill_(2.0)  # e.g. the optimizer updated a trained norm between rollouts
    noise.token_hook()
    assert torch.equal(w, torch.full((4000,), 2.0))
    with noise.applied(1e-2, 1):
        noise.token_hook()
        assert (w - 2).abs().max() > 0 and (w - 2).std().item() == pytest.approx(1e-2, rel=0.1)
    assert torch.equal(w, torch.full((4000,), 2.0))
