"""The training forward without a padding mask (``qerl.train.aligned_rows``, issue 71): rows of left-padded prompts
and right-padded completions shifted left, run with plain causal attention on the cut width, shifted back. The
logits and gradients of the real tokens are the masked forward's (fp32, each family), the decoder sees no mask and
fewer columns, masks it cannot serve are left alone, and a QeRLTrainer step over unequal lengths takes this path and
logs the loss of the masked one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import loss_logs, qerl_trainer
from tiny_models import FAMILY_CONFIGS, tiny_model

from qerl.train import aligned_rows
from qerl.train.aligned_rows import aligned, decoder_of, shift_back, shift_left, shifts

#: (leading pads, real tokens) per row of a 12-column batch: left-padded prompts, right-padded completions.
ROWS = [(0, 12), (3, 7), (5, 4), (1, 10)]
COLUMNS = 12


def trl_mask(rows: list[tuple[int, int]] = ROWS, columns: int = COLUMNS) -> torch.Tensor:
    mask = torch.zeros(len(rows), columns, dtype=torch.long)
    for i, (lead, real) in enumerate(rows):
        mask[i, lead : lead + real] = 1
    return mask


def test_shifts_of_trl_masks() -> None:
    leading, width = shifts(trl_mask())
    assert leading.tolist() == [0, 3, 5, 1] and width == 12
    leading, width = shifts(trl_mask([(2, 5), (0, 3)], 9))
    assert leading.tolist() == [2, 0] and width == 5  # the columns past the longest row are cut
    assert shifts(torch.ones(2, 5, dtype=torch.long)) is None  # nothing to gain: transformers drops it already
    holed = trl_mask()
    holed[0, 6] = 0  # a hole inside a row: shifting would change what the tokens after it see
    assert shifts(holed) is None


def test_shift_back_inverts_shift_left_on_the_real_tokens() -> None:
    mask = trl_mask()
    values = torch.arange(mask.numel() * 3, dtype=torch.float32).view(*mask.shape, 3)
    leading, width = shifts(mask)
    moved = shift_left(values, leading, width)
    assert all(bool(moved[i, 0, 0] == values[i, lead, 0]) for i, (lead, _) in enumerate(ROWS))
    back = shift_back(moved, leading, COLUMNS)
    real = mask.bool()
    assert torch.equal(back[real], values[real])


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 64, (len(ROWS), COLUMNS), generator=torch.Generator().manual_seed(seed))
    mask = trl_mask()
    return ids.masked_fill(mask == 0, 0), mask


def _logits_and_grads(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logps = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    weights = mask[:, 1:] * mask[:, :-1] * torch.linspace(-1, 1, logps.numel()).view_as(logps)
    (logps * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen2", *FAMILY_CONFIGS])
def test_the_aligned_forward_is_the_masked_forward(family: str) -> None:
    """Logits at every real column and every gradient of a loss over real tokens agree with the masked forward
    (fp32; positions start at 0 instead of after the pads, which RoPE does not see: rounding only), while the
    decoder's layers get no mask and the cut width."""
    model_type, config = FAMILY_CONFIGS.get(family, (family, {}))
    model = tiny_model(model_type, 0, vocab_size=64, max_position_embeddings=64, **config)
    model.config._attn_implementation = "sdpa"
    ids, mask = _inputs()
    want, want_grads = _logits_and_grads(model, ids, mask)
    decoder = decoder_of(model)
    seen: list[tuple[int, Any]] = []
    spy = decoder.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(
            (k["hidden_states"].shape[1] if "hidden_states" in k else a[0].shape[1], k.get("attention_mask"))
        ),
        with_kwargs=True,
    )
    with aligned(decoder):
        got, got_grads = _logits_and_grads(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert seen == [(COLUMNS, None)]
    ids_cut, mask_cut = ids[:, :10].clone(), trl_mask([(0, 9), (3, 7), (5, 4)], 10)
    with aligned(decoder):
        model(input_ids=ids_cut[:3], attention_mask=mask_cut)
    spy.remove()
    assert seen[-1][0] == 9  # the longest row, not the padded width


def test_masks_it_cannot_serve_are_left_alone() -> None:
    """A mask with a hole, explicit position ids, or no mask: the forward is the plain one, bit for bit."""
    model = tiny_model("qwen2", 0, vocab_size=64, max_position_embeddings=64).eval()
    ids, mask = _inputs()
    holed = mask.clone()
    holed[0, 6] = 0
    positions = torch.arange(COLUMNS).expand(len(ROWS), -1)
    cases = [dict(attention_mask=holed), dict(attention_mask=mask, position_ids=positions), dict()]
    with torch.no_grad():
        want = [model(input_ids=ids, **case).logits for case in cases]
        with aligned(decoder_of(model)):
            got = [model(input_ids=ids, **case).logits for case in cases]
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def _ragged_rollout(prompts: list[Any], trainer: Any) -> dict[str, list[list[Any]]]:
    """Prompts of 4 to 7 tokens and completions of 2 to 5 (EOS id 2 ends the shorter): trl pads both."""
    prompt_ids = [[1, 9690, 314, 216, 28, 2, 198][: 4 + i % 4] for i in range(len(prompts))]
    completion_ids = [[30 + i, 40 + (5 * i) % 7, 50, 61][: 1 + i % 4] + [2] for i in range(len(prompts))]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [[-1.0] * len(c) for c in completion_ids],
    }


def test_a_trainer_step_over_unequal_lengths_takes_the_aligned_path(
    qtiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One QeRLTrainer step with rollouts of unequal lengths shifts its passes (counted) and logs the loss, reward
    and entropy of the same step without the shift."""
    calls: list[bool] = []
    real_shifts = aligned_rows.shifts

    def counted(mask: torch.Tensor) -> Any:
        plan = real_shifts(mask)
        calls.append(plan is not None)
        return plan

    logs = {}
    for name in ("aligned", "masked"):
        monkeypatch.setattr(aligned_rows, "shifts", counted if name == "aligned" else lambda mask: None)
        trainer = qerl_trainer(qtiny, tmp_path / name, rollout_func=_ragged_rollout, max_steps=1)
        trainer.train()
        logs[name] = loss_logs(trainer)[0]
    assert calls and all(calls), calls
    for key in ("loss", "reward", "entropy"):
        assert logs["aligned"][key] == pytest.approx(logs["masked"][key], rel=1e-4, abs=1e-6), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_aligned_forward_is_the_masked_forward_on_cuda() -> None:
    """The same on CUDA as training runs it: NVFP4 projections (the Triton kernels), LoRA r8, bf16 autocast, SDPA.
    bf16 rounds differently at the new positions: real logits within 2% of the largest (bound to calibrate)."""
    from test_lora_direct import lora_model

    model = lora_model(nvfp4=True, dtype=torch.bfloat16, device="cuda")
    ids, mask = (t.cuda() for t in _inputs())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(input_ids=ids, attention_mask=mask).logits.float()
        with aligned(decoder_of(model)):
            got = model(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() <= 0.02 * want[real].abs().max()
