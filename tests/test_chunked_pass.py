"""The training pass in row chunks (``qerl.train.chunked_pass``, issue 71): a micro-batch's forward + backward run
over chunks of its rows gives the micro-batch's loss, gradients and logged metrics, for each loss type it normalises
(bnpo, dapo, grpo, dr_grpo) with and without the KL term, in chunks of 1, 2 and a ragged 3 of 8 rows; the rollout
importance-sampling metrics still come once per generation; the automatic choice takes the fewest chunks that fit the
(mocked) free memory, one way, and full recompute where not even one row fits; the rollout engine's memory is freed
before a pass only where the smallest pass would not fit beside it (or always / never, as asked); and a pass that
cannot be chunked is refused in one line where asked, kept in one piece where automatic.

Driven through a real QeRLTrainer's ``training_step`` (transformers' step: ``compute_loss``, then
``accelerator.backward`` of what it returns) on a seeded tiny Qwen2 with NVFP4 Linears and LoRA r4 (random non-zero A
and B) + trained norms, on fabricated micro-batches (left-padded prompts, right-padded completions of varied lengths,
one with no completion token, as a masked truncated completion; off-policy old, reference and sampling log-probs so
that clipping, KL and the importance-sampling ratio all act). The reference is the same step in one piece
(``pass_chunk_rows=0``).

Bounds (fp32 on CPU; only the order of sums moves, and one or two fp32 roundings of the normalising factor): loss and
every logged metric within rel 1e-6 of the unchunked (the IS-ratio metrics bitwise: each row's log-probs are bitwise
the same in a chunk); every LoRA and norm gradient within 1e-5 of its largest magnitude (observed: loss <= 2.9e-7,
gradients <= 8.1e-7, metrics <= 7.5e-8). The ``gpu`` test repeats the comparison on CUDA (bf16 autocast, Triton FP4
kernels)."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qerl.train import chunked_pass, recompute
from qerl.train.recompute import HEADROOM, chunk_rows

ROWS, PROMPT, COMPLETION, VOCAB = 8, 5, 7, 256
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LOSS_BOUND, GRAD_BOUND, METRIC_BOUND = 1e-6, 1e-5, 1e-6
CARD = int(100e9)  # the mocked card's total memory


def build_trainer(out_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, micro_batches: int = 1) -> Any:
    """A real QeRLTrainer (benchmarks.grpo_harness: the recipe's bnpo loss, token-truncated IS ratio from the loss
    pass) on the tiny NVFP4 Qwen2, no recompute, ``micro_batches`` of ROWS per generation and optimizer step; its
    micro-batches are handed to ``training_step`` as they are (no rollout)."""
    from benchmarks import grpo_harness

    n = ROWS * micro_batches
    args = argparse.Namespace(
        local_n=n, n=n, micro_batch=ROWS, tokens=COMPLETION, lora_r=4, gradient_checkpointing="off"
    )
    model = grpo_harness.build_model(SHAPE, VOCAB, True, torch.device(device), dtype, "qwen2")
    torch.manual_seed(0)
    prompt = {"prompt": "t1 t2"}
    trainer = grpo_harness.make_trainer(model, grpo_harness.build_tokenizer(VOCAB), prompt, args, out_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p))
    trainer._prepare_inputs = lambda batch: batch  # instance-level: the micro-batch is the fabricated one
    return trainer


def micro_batch(trainer: Any, seed: int, generation_tokens: int | None = None) -> dict[str, Any]:
    """ROWS fabricated completions as trl's ``_prepare_inputs`` hands them over (see the module docstring);
    ``num_items_in_batch``: the generation's completion tokens (default: this micro-batch's)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    completion_lengths = torch.randint(1, COMPLETION + 1, (ROWS,), generator=g)
    completion_lengths[2] = 0  # a masked (truncated) completion: no token in the loss
    batch = {
        "prompt_ids": torch.randint(1, VOCAB, (ROWS, PROMPT), generator=g),
        "prompt_mask": (torch.arange(PROMPT)[None] >= PROMPT - prompt_lengths[:, None]).long(),
        "completion_ids": torch.randint(1, VOCAB, (ROWS, COMPLETION), generator=g),
        "completion_mask": (torch.arange(COMPLETION)[None] < completion_lengths[:, None]).long(),
        "advantages": torch.randn(ROWS, generator=g),
    }
    tokens = int(batch["completion_mask"].sum()) if generation_tokens is None else generation_tokens
    batch["num_items_in_batch"] = torch.tensor(tokens)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    device = trainer.accelerator.device
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids.to(device), mask.to(device), COMPLETION)
    logps = logps[0].float().cpu()
    for key, spread in (("old_per_token_logps", 0.2), ("sampling_per_token_logps", 0.5), ("ref_per_token_logps", 0.3)):
        batch[key] = logps + spread * torch.randn(logps.shape, generator=g)
    return {k: v.to(device) for k, v in batch.items()}


def run_step(
    trainer: Any, batches: list[dict[str, Any]], loss_type: str, chunk: int, beta: float = 0.0
) -> tuple[float, dict[str, torch.Tensor], dict[str, list[float]]]:
    """(summed loss, every trainable gradient, the logged metrics) of one optimizer step's training passes over
    ``batches`` (no optimizer step), in chunks of ``chunk`` rows (0: in one piece)."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.loss_type, trainer.beta, trainer.args.pass_chunk_rows = loss_type, beta, chunk
    trainer.current_gradient_accumulation_steps = len(batches)
    loss = sum(float(trainer.training_step(trainer.model_wrapped, dict(b), None)) for b in batches)
    grads = {n: p.grad.float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items() if k != "step_time"}  # wall time
    return loss, grads, metrics


def differences(
    got: tuple[float, dict[str, torch.Tensor], dict[str, list[float]]],
    ref: tuple[float, dict[str, torch.Tensor], dict[str, list[float]]],
) -> tuple[float, float, float]:
    """(loss relative difference, worst gradient difference over that tensor's largest magnitude, worst metric
    relative difference); the metrics must be the same names with as many values."""
    assert {k: len(v) for k, v in got[2].items()} == {k: len(v) for k, v in ref[2].items()}
    grad = max(float((got[1][n] - g).abs().max() / g.abs().max()) for n, g in ref[1].items())
    metric = max(
        abs(a - b) / max(abs(b), 1e-12) if not (math.isnan(a) and math.isnan(b)) else 0.0
        for k in ref[2]
        for a, b in zip(got[2][k], ref[2][k], strict=True)
    )
    return abs(got[0] - ref[0]) / abs(ref[0]), grad, metric


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_trainer(str(tmp_path_factory.mktemp("chunked")))


@pytest.fixture(scope="module")
def batch(trainer: Any) -> dict[str, Any]:
    return micro_batch(trainer, seed=5)


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("chunk", [1, 2, 3], ids=["chunk1", "chunk2", "ragged3"])
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo", "dr_grpo"])
def test_chunks_give_the_micro_batch_loss_gradients_and_metrics(
    trainer: Any, batch: dict[str, Any], loss_type: str, chunk: int, beta: float
) -> None:
    ref = run_step(trainer, [batch], loss_type, 0, beta)
    got = run_step(trainer, [batch], loss_type, chunk, beta)
    assert trainer.chunk_passes.get(chunk)  # it ran in chunks
    assert set(ref[2]) >= {
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_max",
        "sampling/importance_sampling_ratio/mean",
    }
    assert ("kl" in ref[2]) is (beta > 0) and ref[2]["clip_ratio/region_mean"][0] > 0  # the clipping acted
    loss, grad, metric = differences(got, ref)
    assert loss <= LOSS_BOUND and grad <= GRAD_BOUND and metric <= METRIC_BOUND, (loss, grad, metric)
    sampling = {k: v for k, v in ref[2].items() if k.startswith("sampling/")}
    assert sampling == {k: got[2][k] for k in sampling}  # bitwise: the same rows' log-probs, in the same order


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_two_micro_batches_of_one_generation(tmp_path: Path, loss_type: str) -> None:
    """Two micro-batches of one generation and optimizer step, dapo normalised by the generation's tokens: the
    chunked passes accumulate the same gradients, log each loss metric once per micro-batch and the
    importance-sampling metrics once per generation (after the second), with the same values."""
    trainer = build_trainer(str(tmp_path), micro_batches=2)
    tokens = [int(micro_batch(trainer, seed)["completion_mask"].sum()) for seed in (5, 7)]
    assert tokens[0] != tokens[1]  # bnpo's per-micro-batch normalisers then differ from dapo's generation-wide one
    batches = [micro_batch(trainer, seed, sum(tokens)) for seed in (5, 7)]
    ref = run_step(trainer, batches, loss_type, 0)
    got = run_step(trainer, batches, loss_type, 3)
    assert len(ref[2]["entropy"]) == 2 and len(ref[2]["sampling/importance_sampling_ratio/mean"]) == 1
    loss, grad, metric = differences(got, ref)
    assert loss <= LOSS_BOUND and grad <= GRAD_BOUND and metric <= METRIC_BOUND, (loss, grad, metric)


# ---------------------------------------------------------------------------------------------- the choice


def test_fewest_chunks_that_fit() -> None:
    """The largest chunk that fits, then the fewest chunks of it, as even as they come."""
    expected = {8: 8, 7: 4, 5: 4, 4: 4, 3: 3, 2: 2, 1: 1, 0: 0}
    for largest, chunk in expected.items():
        assert chunk_rows(8, lambda c, largest=largest: c <= largest) == chunk
    assert chunk_rows(6, lambda c: c <= 4) == 3 and chunk_rows(1, lambda c: True) == 1


@pytest.fixture
def auto_trainer(trainer: Any, batch: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """The module's trainer with ``gradient_checkpointing`` unset (auto, as on CUDA) and ``pass_chunk_rows`` unset,
    and the bytes its pass over the module's micro-batch needs per chunk size (free memory is then mocked)."""
    tokens = PROMPT + COMPLETION

    def need(rows: int) -> int:
        return trainer.pass_bytes(rows, tokens, True) + trainer.unallocated_state_bytes()

    trainer.args.gradient_checkpointing, trainer.planned_recompute, trainer.planned_chunk = None, None, None
    trainer.recompute_passes, trainer.chunk_passes = {"none": 0, "full": 0}, {}
    trainer.model.zero_grad(set_to_none=True)
    yield trainer, need
    trainer.args.gradient_checkpointing, trainer.planned_recompute, trainer.planned_chunk = False, None, None
    trainer.model.gradient_checkpointing_disable()


@pytest.mark.parametrize(
    ("fit", "asked", "passes", "chunks", "logged"),
    [
        ([8], None, {"none": 2, "full": 0}, {}, ["none from step 0"]),
        ([5], None, {"none": 2, "full": 0}, {4: 2}, ["none in chunks of 4 rows from step 0"]),
        ([3], None, {"none": 2, "full": 0}, {3: 2}, ["none in chunks of 3 rows from step 0"]),
        ([0], None, {"none": 0, "full": 2}, {}, ["full from step 0"]),
        ([5], 0, {"none": 0, "full": 2}, {}, ["full from step 0"]),
        ([5, 8], None, {"none": 2, "full": 0}, {4: 2}, ["none in chunks of 4 rows from step 0"]),
        ([8, 2, 0], None, {"none": 2, "full": 1}, {2: 1}, ["none from", "none in chunks of 2 rows from", "full from"]),
    ],
    ids=["whole-fits", "five-fit", "three-fit", "none-fits", "chunks-off", "one-way", "shrinking"],
)
def test_auto_takes_the_fewest_chunks_the_free_memory_holds(
    auto_trainer: tuple[Any, Any],
    batch: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fit: list[int],
    asked: int | None,
    passes: dict[str, int],
    chunks: dict[int, int],
    logged: list[str],
) -> None:
    """Before each pass the (mocked) free memory holds the pass of ``fit`` rows exactly, one reading per pass (the
    last repeats): the pass runs whole, in the fewest chunks that fit, or with full recompute where not one row fits
    (or chunks are off: ``pass_chunk_rows=0``); a chunk never grows back within the run; each change logged in one
    line."""
    trainer, need = auto_trainer
    trainer.args.pass_chunk_rows = asked
    readings = iter(fit)
    last = [fit[-1]]

    def memory(device: torch.device) -> tuple[int, int]:
        last[0] = next(readings, last[0])
        return need(last[0]) + int(HEADROOM * CARD) if last[0] else 0, CARD

    monkeypatch.setattr(recompute, "device_memory", memory)
    with caplog.at_level(logging.INFO, logger="qerl.train.recompute"):
        for _ in range(sum(passes.values())):
            trainer.model.zero_grad(set_to_none=True)  # the state the estimate counts stays the same
            trainer.current_gradient_accumulation_steps = 1
            trainer.training_step(trainer.model_wrapped, dict(batch), None)
    assert (trainer.recompute_passes, trainer.chunk_passes) == (passes, chunks)
    assert trainer.model.is_gradient_checkpointing is bool(passes["full"])
    lines = [
        r.getMessage().removeprefix("activation recompute: ") for r in caplog.records if r.name == recompute.__name__
    ]
    assert len(lines) == len(logged) and all(line.startswith(start) for line, start in zip(lines, logged, strict=True))
    assert all(("a chunk of" in line) is ("in chunks" in line) for line in lines)


# ---------------------------------------------------------------------------------------------- the engine's memory


class HeldEngine:
    """A rollout engine that holds its cache (a model ``view``, as NativeEngine after a generation) until ``release``
    (what ``free_rollout_memory`` reads and calls)."""

    def __init__(self) -> None:
        self.view: object | None = object()
        self.releases = 0

    def release(self) -> None:
        self.view, self.releases = None, self.releases + 1


def test_the_smallest_pass_by_checkpointing(
    auto_trainer: tuple[Any, Any], batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Auto: full recompute or one row without it, whichever is less (full where chunks are off or the pass cannot
    be chunked); on: full recompute; off: the whole micro-batch without recompute; ``--pass_chunk_rows N``: pieces of
    N rows, without recompute unless the checkpointing is on."""
    trainer, _ = auto_trainer
    tokens, state, masked = PROMPT + COMPLETION, trainer.unallocated_state_bytes(), trainer.pass_masked(batch)
    full = sum(recompute.recompute_terms(SHAPE, ROWS, tokens, nvfp4=True).values()) + state

    def need(rows: int) -> int:
        return trainer.pass_bytes(rows, tokens, masked) + state

    assert trainer.smallest_pass_bytes(batch) == min(full, need(1))
    with monkeypatch.context() as patched:
        patched.setattr(trainer, "loss_type", "sapo")  # a loss qerl cannot chunk
        assert trainer.smallest_pass_bytes(batch) == full
    trainer.args.pass_chunk_rows = 3
    assert trainer.smallest_pass_bytes(batch) == need(3)
    trainer.args.pass_chunk_rows = 0
    assert trainer.smallest_pass_bytes(batch) == full
    trainer.args.gradient_checkpointing = True
    assert trainer.smallest_pass_bytes(batch) == full
    trainer.args.pass_chunk_rows = 3
    three = sum(recompute.recompute_terms(SHAPE, 3, tokens, nvfp4=True).values()) + state
    assert trainer.smallest_pass_bytes(batch) == three
    trainer.args.gradient_checkpointing = False
    assert trainer.smallest_pass_bytes(batch) == need(3)
    trainer.args.pass_chunk_rows = None
    assert trainer.smallest_pass_bytes(batch) == need(ROWS)


@pytest.mark.parametrize(
    ("asked", "short", "releases", "logged"),
    [
        (None, 1, 1, "the pass needs ~"),
        (None, -1, 0, None),
        (True, -1, 1, "as asked"),
        (False, 1, 0, None),
    ],
    ids=["auto-short", "auto-room", "always", "never"],
)
def test_the_engine_memory_is_freed_where_the_pass_needs_it(
    auto_trainer: tuple[Any, Any],
    batch: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    asked: bool | None,
    short: int,
    releases: int,
    logged: str | None,
) -> None:
    """With the (mocked) free memory ``short`` bytes below the smallest pass (or above it), two passes: auto frees
    the engine's cache before the first where the pass needs it, True always, False never; the engine, once freed,
    is not asked again; the first release is logged in one line."""
    trainer, _ = auto_trainer
    engine = HeldEngine()
    monkeypatch.setattr(trainer, "_engine", engine, raising=False)
    monkeypatch.setattr(trainer.args, "release_rollout_memory", asked)
    monkeypatch.setattr(trainer, "rollout_memory_freed", 0)
    need = trainer.smallest_pass_bytes(batch)
    monkeypatch.setattr(recompute, "device_memory", lambda device: (need - short + int(HEADROOM * CARD), CARD))
    with caplog.at_level(logging.INFO, logger="qerl.train.recompute"):
        for _ in range(2):
            trainer.free_rollout_memory(batch)
    assert engine.releases == releases == trainer.rollout_memory_freed
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout memory: ")]
    assert len(lines) == (logged is not None) and all(logged in line for line in lines)


def test_the_engine_memory_is_freed_inside_the_training_step(
    auto_trainer: tuple[Any, Any], batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compute_loss`` asks before it plans the pass: with the card short of the smallest pass, the engine is freed
    and the pass (then planned with the memory the release gave back, here still short) recomputes in full."""
    trainer, _ = auto_trainer
    engine = HeldEngine()
    monkeypatch.setattr(trainer, "_engine", engine, raising=False)
    monkeypatch.setattr(trainer, "rollout_memory_freed", 0)
    monkeypatch.setattr(recompute, "device_memory", lambda device: (0, CARD))
    trainer.current_gradient_accumulation_steps = 1
    trainer.training_step(trainer.model_wrapped, dict(batch), None)
    assert engine.releases == 1 and trainer.recompute_passes == {"none": 0, "full": 1}


# ---------------------------------------------------------------------------------------------- refusals and defaults


def test_passes_that_cannot_be_chunked(trainer: Any, batch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss type whose chunks are not normalised, the entropy bonus, or image inputs: ``--pass_chunk_rows N`` is
    refused in one line naming the flag; auto keeps such a pass in one piece (here with full recompute)."""
    monkeypatch.setattr(trainer, "loss_type", "sapo")
    assert "loss_type sapo" in chunked_pass.refusal(trainer)
    monkeypatch.setattr(trainer.args, "pass_chunk_rows", 2)
    with pytest.raises(ValueError, match=r"^--pass_chunk_rows 2: cannot chunk the training pass: loss_type sapo"):
        trainer.check_pass_chunks()
    monkeypatch.setattr(trainer, "loss_type", "bnpo")
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
    assert "entropy bonus" in chunked_pass.refusal(trainer)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", False)
    images = {**batch, "pixel_values": torch.zeros(ROWS, 3)}
    assert "pixel_values" in chunked_pass.refusal(trainer, images)
    with pytest.raises(ValueError, match=r"^--pass_chunk_rows 2: .*carries pixel_values"):
        trainer.plan_pass(images)
    monkeypatch.setattr(trainer.args, "pass_chunk_rows", None)
    monkeypatch.setattr(trainer.args, "gradient_checkpointing", None)
    monkeypatch.setattr(trainer, "planned_recompute", None)
    monkeypatch.setattr(recompute, "device_memory", lambda device: (CARD, CARD))  # room for all but one piece
    monkeypatch.setattr(trainer, "pass_bytes", lambda rows, tokens, masked: CARD if rows > 1 else 0)
    monkeypatch.setattr(recompute, "enable_recompute", lambda model, kwargs: None)
    assert trainer.plan_pass(images) == ROWS and trainer.planned_recompute == "full"
    monkeypatch.setattr(trainer, "planned_recompute", None)
    assert trainer.plan_pass(batch) == 1  # the same memory, a micro-batch it can chunk


def test_the_flag_defaults_and_values(tmp_path: Path) -> None:
    """Unset by default (auto: chunks only where the checkpointing is auto, which it is not without CUDA, so the CPU
    pass stays as it was); 0 or N as given, on the command line too; anything else refused in one line."""
    from qerl.train.args import parse_args
    from qerl.train.config import QeRLConfig

    config = QeRLConfig(output_dir=str(tmp_path), report_to=[])
    assert config.pass_chunk_rows is None and config.gradient_checkpointing is True  # CPU: today's full recompute
    assert QeRLConfig(output_dir=str(tmp_path), pass_chunk_rows=0).pass_chunk_rows == 0
    base = ["--output_dir", str(tmp_path)]
    assert parse_args(base)[1].pass_chunk_rows is None
    assert parse_args([*base, "--pass_chunk_rows", "2"])[1].pass_chunk_rows == 2
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"^--pass_chunk_rows: expected an integer in \[0, 65536\]"):
            QeRLConfig(output_dir=str(tmp_path), pass_chunk_rows=bad)


def test_cpu_default_runs_the_pass_in_one_piece(trainer: Any, batch: dict[str, Any], monkeypatch) -> None:
    """Without CUDA the config's checkpointing is on: with ``pass_chunk_rows`` unset every pass is one piece."""
    monkeypatch.setattr(trainer.args, "gradient_checkpointing", True)
    monkeypatch.setattr(trainer.args, "pass_chunk_rows", None)
    assert trainer.plan_pass(batch) == ROWS


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo", "dr_grpo"])
def test_chunks_give_the_micro_batch_pass_on_cuda(tmp_path: Path, loss_type: str) -> None:
    """The comparison on CUDA: bf16 weights under accelerate's bf16 autocast, NVFP4 Linears on the Triton kernels,
    chunks of 1 and a ragged 3 with the KL term. Where each chunk's rows come out of the forward bitwise as in the
    whole micro-batch (the kernels do not depend on the row count), the loss and metrics hold the CPU bounds; where
    they do not (a GEMM picked by the row count sums in another order), the bf16 rounding bounds of
    docs/performance.md's plan. The gradients always get the rounding bound: under bf16 autocast each chunk's LoRA
    weight gradient is a bf16 GEMM over its own tokens, rounded before ``.grad`` adds it (an H100 showed 1.4e-2 of
    the largest magnitude at chunks of one row, with the forward bitwise)."""
    trainer = build_trainer(str(tmp_path), "cuda", torch.bfloat16)
    batch = micro_batch(trainer, seed=5)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad(), trainer.accelerator.autocast():
        whole = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION)[0]
        split = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION, batch_size=3)[0]
    same_rows = torch.equal(whole, split)
    bounds = (LOSS_BOUND, 2e-2, METRIC_BOUND) if same_rows else (1e-3, 2e-2, 1e-3)
    for chunk in (1, 3):
        ref = run_step(trainer, [batch], loss_type, 0, beta=0.04)
        got = run_step(trainer, [batch], loss_type, chunk, beta=0.04)
        found = differences(got, ref)
        print(f"\n{loss_type} chunk {chunk}: rows bitwise {same_rows}; loss, gradient, metric differences {found}")
        assert all(f <= b for f, b in zip(found, bounds, strict=True)), (same_rows, found, bounds)
